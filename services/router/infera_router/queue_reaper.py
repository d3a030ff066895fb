"""Deleting the work queue of a worker that left without deleting it (NATS request plane).

A worker-agent deletes its ``INFERA_REQ_<worker>`` stream when it stops cleanly. One that was
SIGKILLed, OOM-killed or lost with its node leaves the stream and its durable consumer in the
broker; with the default worker ids (random per start) every such crash of a long-lived fleet left
one more pair behind for good (the scale audit). So when a worker leaves discovery, each router
waits one discovery TTL past it (``core.leave_grace``: a live agent puts its record back within
it), and then, if the worker is still not listed and no subscriber is bound to its consumer (a
live agent always is), deletes the stream. Several routers may do it at once: deleting a stream
that is gone already is nothing. Requests still queued there were for an agent that cannot run
them; their frontends have retried them elsewhere (``sender_gone``, ``frames_lost``).

A broker outage longer than the TTL makes every worker leave every router's view at once, and
when the broker is back the agents need a moment to reconnect, register and bind again: a queue
is therefore only deleted once this router has been back on the broker for a whole grace too
(``reconnected``). Before, a grace that ended in the instant of the reconnect deleted a live
agent's queue, and its worker took no request until it restarted (a broker-restart test in CI).

The one window left open: an agent started again with the same ``--worker-id`` that has created
its stream but not yet bound its consumer (milliseconds) exactly when the grace ends; it then fails
its start with the broker's error, and is started again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from nats.js.errors import NotFoundError

from infera_common.logs import get_logger
from infera_common.subjects import request_stream, work_consumer
from infera_common.tasks import stop_tasks

log = get_logger("router.queue_reaper")

#: Seconds past the grace before a queue is looked at (heartbeats landing late, clocks apart).
MARGIN = 1.0


class QueueReaper:
    def __init__(self, nc, listed: Callable[[str], bool], on_deleted: Callable[[], None]) -> None:  # noqa: ANN001
        self._nc = nc
        self._listed = listed  # whether discovery lists the worker (again)
        self._on_deleted = on_deleted
        self._waiting: dict[str, asyncio.Task] = {}
        self._back_at = time.monotonic()  # when this router was last (re)connected to the broker

    def reconnected(self) -> None:
        """The router is back on the broker: every worker gets a whole grace to be back too."""
        self._back_at = time.monotonic()

    def left(self, worker_id: str, grace: float) -> None:
        """``worker_id`` left discovery: look at its queue after ``grace`` seconds (once)."""
        if worker_id not in self._waiting:
            task = asyncio.create_task(self._later(worker_id, grace), name=f"reap-{worker_id}")
            self._waiting[worker_id] = task
            task.add_done_callback(lambda _t: self._waiting.pop(worker_id, None))

    async def stop(self) -> None:
        await stop_tasks(*self._waiting.values())
        self._waiting.clear()

    async def _later(self, worker_id: str, grace: float) -> None:
        await asyncio.sleep(grace + MARGIN)
        while True:
            if self._listed(worker_id):
                return
            if not self._nc.is_connected:  # away from the broker: its grace starts when both are back
                self._back_at = time.monotonic()
            elif time.monotonic() - self._back_at >= grace + MARGIN:
                break
            await asyncio.sleep(max(0.1, self._back_at + grace + MARGIN - time.monotonic()))
        js = self._nc.jetstream()
        stream = request_stream(worker_id)
        try:
            try:
                info = await js.consumer_info(stream, work_consumer(worker_id))
                if info.push_bound:  # an agent reads it: alive, though not (yet) in this router's view
                    return
            except NotFoundError:  # no consumer (or no stream): nothing reads it
                pass
            await js.delete_stream(stream)
        except NotFoundError:  # gone already (its agent, or another router)
            return
        except Exception as exc:  # the broker away: the next leave of the worker, or a restart, will do
            log.info("queue_delete_skipped", worker_id=worker_id, stream=stream, error=str(exc) or type(exc).__name__)
            return
        self._on_deleted()
        log.info("queue_deleted", worker_id=worker_id, stream=stream,
                 reason="its worker left discovery without deleting it, and nothing reads it")
