"""Requests whose requester left the bus are stopped: the engine stops working for nobody.

The reverse of the frontend's sender watch. A frontend SIGKILLed, OOM-killed or cut off from the
broker leaves its requests running on the engines to their last token (the HA audit of session 28:
four 3,000-token streams ran 15 s on after their frontend was killed, counted as load all along);
a client that disconnects is cancelled by its frontend, but a dead frontend tells nobody. Every
``CHECK_EVERY`` seconds the runner's owner (a worker-agent, or a router running requests on
``--request-transport http``) asks each frontend waiting for a request in flight whether it is still
there (``subjects.requester_alive_subject``: its inbox subscription takes the question, a current
frontend answers it, an older one says nothing, which counts as there). "No responders" for
``GONE_AFTER`` seconds in a row (a frontend reconnecting to the broker is away for a moment)
stops that frontend's requests (``request_runner.REQUESTER_GONE``: the engine aborts them, their
leases are released ``cancelled``).
"""

from __future__ import annotations

import asyncio

import nats.errors

from infera_common.absence import Absences
from infera_common.logs import get_logger
from infera_common.request_runner import REQUESTER_GONE, RequestRunner
from infera_common.tasks import stop_tasks

log = get_logger("requester_watch")

CHECK_EVERY = 2.0
ASK_TIMEOUT = 1.0
GONE_AFTER = 3.0


class RequesterWatch:
    def __init__(self, nc, runner: RequestRunner, stopped=None) -> None:  # noqa: ANN001 - a NATS client
        self._nc = nc
        self._runner = runner
        self._stopped = stopped  # a counter of the requests stopped (prometheus ``Counter``), if any
        self._absent = Absences(GONE_AFTER)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="requester-watch")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_tasks(task)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(CHECK_EVERY)
            try:
                await self.check()
            except Exception:  # never the end of the watch
                log.exception("requester_watch_failed")

    async def check(self) -> int:
        """Ask every waiting frontend once; stop the requests of those gone. How many were stopped."""
        subjects = self._runner.requesters()
        self._absent.forget_except(subjects)
        if not subjects or not self._nc.is_connected:
            self._absent.clear()  # (absences seen while this process was away from the broker mean nothing)
            return 0
        asked = list(subjects)
        answers = await asyncio.gather(*(self._ask(s) for s in asked))
        now = asyncio.get_running_loop().time()
        stopped = 0
        for subject, on_bus in zip(asked, answers):
            if on_bus is None:
                continue
            if on_bus:
                self._absent.present(subject)
                continue
            away = self._absent.absent(subject, now)
            if self._absent.gone(subject, now):
                n = self._runner.stop_requester(subject, REQUESTER_GONE)
                self._absent.present(subject)
                if n:
                    stopped += n
                    log.warning("requester_gone", requester=subject.rsplit(".", 1)[0], requests_stopped=n,
                                absent_s=round(away, 2))
        if stopped and self._stopped is not None:
            self._stopped.inc(stopped)
        return stopped

    async def _ask(self, subject: str) -> bool | None:
        """Whether the frontend is on the bus (a timeout: subscribed, busy or older); None: unknown."""
        try:
            await self._nc.request(subject, b"", timeout=ASK_TIMEOUT)
            return True
        except nats.errors.NoRespondersError:
            return False
        except (nats.errors.TimeoutError, TimeoutError):
            return True
        except Exception:  # this process's own connection in trouble
            return None
