"""How the router hands a placed request to its worker: the ``--request-transport`` of the router.

``JetStreamDispatcher`` (``nats``): the envelope goes to the worker's work-queue stream and the
broker's acknowledgement says whether it was stored, the queue was full or the worker has no queue.

``HttpDispatcher`` (``http``): the router itself calls the engine's HTTP API at the worker record's
URL (``infera_common.request_runner`` with ``engine_relay``: the same frames, Release and Prefilled
a worker-agent would send, on the same subjects, so the frontend and the rest of the router do not
know the difference). The worker's ``max_pending`` bounds the requests this router has running on
it ("full" beyond); a worker no longer in discovery is "gone". It listens to every worker's cancel
subject: a ``Cancel`` closes the engine connection and calls the engine's abort. Since the frames
come from this router, so do the answers to a frontend back from a broker outage
(``frames_answer``, on ``router_frames_query_subject`` / ``router_frames_replay_subject`` of this
router; ``frames_from`` "router" in the route reply tells the frontend to ask here).

Both answer ``send`` exactly once through ``on_result`` (a ``PubResult``). When a worker leaves
discovery with requests of this router unfinished, ``worker_left`` sees that no requester waits
for an answer that cannot come; when its agent registers it ``unhealthy``, ``worker_unhealthy``
hands back what its engine has not answered yet (see each class).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

import aiohttp

from infera_common.engine_relay import ABORT_PATHS, EngineAborter, Relay, bearer_header
from infera_common.frames_answer import FramesAnswers
from infera_common.logs import get_logger
from infera_common.nats_conn import unsubscribe_quietly
from infera_common.requester_watch import RequesterWatch
from infera_common.request_runner import (
    ENGINE_UNHEALTHY, Engine, RequesterClock, RequestRunner, SeriesHooks, StopReason,
)
from infera_common.frames import encode_frame
from infera_common.schemas import WorkEnvelope, WorkerRecord, encode
from infera_common.subjects import (
    CANCEL_SUBJECTS, router_frames_query_subject, router_frames_replay_subject, work_subject, worker_of_cancel_subject,
)

from infera_router.jetstream import AckedPublisher, OnResult, PubResult
from infera_router.leases import Lease
from infera_router.metrics import RouterMetrics

log = get_logger("router.dispatch")

#: What a request still running on an engine gets when the router stops.
ROUTER_STOPPING = StopReason("error", 503, "router stopping")


class Dispatcher(Protocol):
    frames_from: Literal["worker", "router"]  # who sends the frames of the requests it hands over

    async def start(self) -> None: ...
    async def send(self, worker_id: str, env: WorkEnvelope, timeout: float, on_result: OnResult) -> None: ...
    async def worker_left(self, worker_id: str, dropped: list[Lease]) -> int: ...
    def worker_unhealthy(self, worker_id: str) -> int: ...
    async def wait_idle(self, timeout: float) -> bool: ...
    async def stop(self) -> None: ...


class JetStreamDispatcher:
    """The NATS request plane: the worker-agent takes it from its work queue."""

    frames_from = "worker"

    def __init__(self, nc: Any) -> None:
        self._nc = nc
        self._publisher = AckedPublisher(nc)

    async def start(self) -> None:
        await self._publisher.start()

    async def send(self, worker_id: str, env: WorkEnvelope, timeout: float, on_result: OnResult) -> None:
        await self._publisher.publish(work_subject(worker_id), encode(env), timeout, on_result)

    async def worker_left(self, worker_id: str, dropped: list[Lease]) -> int:
        """The worker left discovery (its agent deregistered, or stopped heartbeating for the TTL) while
        requests of this router ran there: each requester hears a 502 error frame now, so the frontend
        tries another worker (nothing sent to the client yet) or ends the stream with the error,
        instead of waiting ``--upstream-timeout`` for frames from an agent that is gone. An agent
        that deregistered and still fails its requests itself (engine exit) sends its own error
        too: the frontend keeps whichever comes first. Returns how many requesters were told."""
        frame = encode_frame("error", 0, 502, message=f"worker {worker_id} left the fleet before its answer was complete")
        told = 0
        for lease in dropped:
            if lease.requester:  # a prefill leg answers this router: its pair is failed instead
                try:
                    await self._nc.publish(lease.requester, frame)
                except Exception as exc:  # connection closing: the frontend's timeout remains
                    log.warning("worker_left_not_told", request_id=lease.request_id, error=str(exc))
                    continue
                told += 1
        return told

    def worker_unhealthy(self, worker_id: str) -> int:
        """Nothing here: the worker-agent hands back what its engine has not answered yet."""
        return 0

    async def wait_idle(self, timeout: float) -> bool:
        """Every envelope sent has had its broker acknowledgement (or its timeout)."""
        return await self._publisher.wait_idle(timeout)

    async def stop(self) -> None:
        await self._publisher.stop()


class HttpDispatcher:
    """The HTTP request plane: this router calls the engine (see the module doc)."""

    frames_from = "router"

    def __init__(self, nc: Any, router_id: str, record_of: Callable[[str], WorkerRecord | None],
                 metrics: RouterMetrics, drain_timeout: float, engine_api_key: str | None = None,
                 clock: RequesterClock | None = None) -> None:
        self._nc = nc
        self._engine_api_key = engine_api_key  # --engine-api-key: sent to every engine
        self._router_id = router_id
        self._drain_timeout = drain_timeout  # what the router's own engine calls get to finish when it stops
        self._record_of = record_of
        self._runner = RequestRunner(nc.publish, SeriesHooks(metrics.http_requests, metrics.http_in_flight,
                                                             metrics.http_cancels, metrics.bad_messages.labels("cancel")),
                                     self._finds_hangs, clock)
        self._answers = FramesAnswers(self._runner, metrics.http_frames_queries, metrics.http_frames_replays)
        self._requesters = RequesterWatch(nc, self._runner, metrics.http_requester_gone)
        self._session: aiohttp.ClientSession | None = None
        self._engines: dict[str, tuple[str, Engine]] = {}  # worker id -> (url, engine)
        self._subs: list[Any] = []

    def _finds_hangs(self, worker_id: str) -> bool:
        """Whether the worker's agent would take its engine out of routing if it hung (then the
        requests waiting there are handed back: ``alive`` frames may be sent for them)."""
        record = self._record_of(worker_id)
        return record is not None and record.finds_hangs

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),  # every worker's max_pending is the bound
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            headers=bearer_header(self._engine_api_key),
        )
        self._subs = [
            await self._nc.subscribe(CANCEL_SUBJECTS, cb=self._on_cancel),
            await self._nc.subscribe(router_frames_query_subject(self._router_id), cb=self._answers.on_query),
            await self._nc.subscribe(router_frames_replay_subject(self._router_id), cb=self._answers.on_replay),
        ]
        self._requesters.start()

    async def send(self, worker_id: str, env: WorkEnvelope, timeout: float, on_result: OnResult) -> None:
        record = self._record_of(worker_id)
        if record is None or self._session is None:
            await on_result(PubResult("gone", description="not in discovery"))
            return
        if record.max_pending and self._runner.in_flight_of(worker_id) >= record.max_pending:
            await on_result(PubResult("full", description=f"{record.max_pending} requests running"))
            return
        await on_result(PubResult("stored"))
        await self._runner.submit(worker_id, env, self._engine(record))

    def _engine(self, record: WorkerRecord) -> Engine:
        known = self._engines.get(record.worker_id)
        if known is not None and known[0] == record.url:
            return known[1]
        assert self._session is not None
        engine = Engine(Relay(self._session, record.url),
                        EngineAborter(self._session, record.url, ABORT_PATHS[record.engine]))
        self._engines[record.worker_id] = (record.url, engine)
        return engine

    async def worker_left(self, worker_id: str, dropped: list[Lease]) -> int:
        """The worker left discovery: this router's own calls to its engine run on (the engine may
        still answer; a dead one fails the call, which answers the requester), so nobody is told
        here; its engine handle is dropped once they end."""
        if not self._runner.in_flight_of(worker_id):
            self._engines.pop(worker_id, None)
        return 0

    def worker_unhealthy(self, worker_id: str) -> int:
        """The worker's agent says its engine stopped answering: this router's calls to it that have
        not answered anything yet are stopped (503), so their frontends try another worker."""
        return self._runner.stop_unanswered(ENGINE_UNHEALTHY, worker_id)

    async def _on_cancel(self, msg) -> None:
        worker_id = worker_of_cancel_subject(msg.subject)
        if worker_id is not None:
            self._runner.cancel(worker_id, msg.data)

    async def wait_idle(self, timeout: float) -> bool:
        """Every request this router runs has ended."""
        return await self._runner.wait_idle(timeout)

    async def stop(self) -> None:
        await self._requesters.stop()
        if not await self._runner.wait_idle(self._drain_timeout):
            log.warning("http_requests_stopped", count=self._runner.in_flight, grace_s=self._drain_timeout)
        await self._runner.close(ROUTER_STOPPING)
        for sub in self._subs:
            await unsubscribe_quietly(sub)
        self._subs = []
        if self._session is not None:
            await self._session.close()
            self._session = None
