"""Workers whose agent left the bus, found within about two load-report periods instead of the
discovery TTL.

A worker-agent SIGKILLed, OOM-killed or cut off from the broker sends nothing more, but its
discovery entry ages out only after ``--discovery-ttl`` (6 s by default). Until then the router
kept placing requests in its JetStream queue, which the broker accepts for a consumer nobody reads:
each such request waited for the frontend's sender check (3 s and more) before it was retried (the
scale audit: churn p99 5.4-5.8 s from 16 workers up). Every agent reports its load every
``--load-interval`` and says so (``LoadReport.report_every``). A report ``core.OVERDUE_FACTOR``
times that late gets its agent an empty ``FramesQuery`` (a late report from a live agent, its
engine scrape slow, only costs that question and its answer): "no responders" from NATS means no
process holds the agent's subscriptions, and the worker sits out of routing (unless every
candidate does) until it reports again or leaves discovery. An answer, or a timeout (a busy
agent), keeps it in. Workers on ``--request-transport http`` are not asked (the
router calls their engines itself, and learns of a dead one from the call).
"""

from __future__ import annotations

import asyncio
import time

from nats.errors import NoRespondersError

from infera_common.logs import get_logger
from infera_common.schemas import FramesQuery, encode
from infera_common.subjects import frames_query_subject
from infera_common.tasks import stop_tasks

from infera_router.core import RouterCore
from infera_router.metrics import RouterMetrics

log = get_logger("router.off_bus")

#: How often the reports' ages are looked at, and how long an agent gets to answer.
CHECK_EVERY = 0.25
ASK_TIMEOUT = 1.0


class OffBusWatch:
    def __init__(self, nc, core: RouterCore, metrics: RouterMetrics) -> None:  # noqa: ANN001 - nats Client
        self._nc = nc
        self._core = core
        self._metrics = metrics
        self._task: asyncio.Task | None = None
        self._asking: set[asyncio.Task] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="off-bus-watch")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_tasks(task, *self._asking)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(CHECK_EVERY)
            for worker_id in self._core.back_on_bus:
                log.info("worker_back_on_bus", worker_id=worker_id)
            self._core.back_on_bus.clear()
            for worker_id, reported_at in self._core.overdue(time.monotonic()):
                task = asyncio.create_task(self._ask(worker_id, reported_at))
                self._asking.add(task)
                task.add_done_callback(self._asking.discard)

    async def _ask(self, worker_id: str, reported_at: float) -> None:
        question = encode(FramesQuery(request_ids=[], worker_id=worker_id))
        try:
            await self._nc.request(frames_query_subject(worker_id), question, timeout=ASK_TIMEOUT)
        except NoRespondersError:
            if self._core.mark_off_bus(worker_id, reported_at):
                self._metrics.workers_off_bus.inc()
                log.warning("worker_off_bus", worker_id=worker_id,
                            last_report_s=round(time.monotonic() - reported_at, 2),
                            hint="its agent holds no subscription on the broker (killed, or cut off): "
                                 "no requests go there until it reports again or leaves discovery")
        except Exception:  # an answer is not needed; a timeout, or the router's own connection down
            pass
