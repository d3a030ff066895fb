"""The request plane of one worker: take envelopes from the worker's work-queue stream, run them,
cancel them, and account for every one of them exactly once (ack, then one Release).

The durable consumer pushes envelopes to a subscription of this agent (no pull request per
message) and holds at most ``max_pending`` unacknowledged (``max_ack_pending``); the stream's
``max_msgs`` with discard-new is what refuses work beyond the pending limit. Messages are acked
when their response is complete, on every path; a malformed envelope is terminated (``term``),
counted and dropped. The consumer never redelivers (``max_deliver`` 1): a request is never
executed twice. While draining, envelopes still delivered are answered with the refusal at once.
"""

from __future__ import annotations

import asyncio
import functools
from collections import Counter
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext

from infera_common.logs import get_logger
from infera_common.nats_conn import unsubscribe_quietly
from infera_common.schemas import Cancel, Prefilled, Release, WorkEnvelope, decode, encode
from infera_common.subjects import (
    cancel_subject, request_stream, router_prefilled_subject, router_release_subject, work_consumer, work_subject,
)
from infera_worker_agent.metrics import AgentMetrics
from infera_worker_agent.recent import RecentIds
from infera_worker_agent.relay import FrameSink, Outcome, Relay

log = get_logger("worker_agent.worker")

ACK_WAIT = 30.0
CANCELLED_MEMORY = 60.0
SUB_DRAIN_TIMEOUT = 5.0  # for envelopes already delivered to be answered when the agent stops


@dataclass(frozen=True, slots=True)
class StopReason:
    """Why the agent stops a request itself: the outcome released and the error frame sent."""

    outcome: Outcome
    status: int
    message: str
    abort_engine: bool = True


CLIENT_CANCELLED = StopReason("cancelled", 499, "cancelled by the requester")
CLOSING = StopReason("error", 503, "worker-agent stopping")


@dataclass(slots=True)
class InFlight:
    envelope: WorkEnvelope
    msg: Msg
    sink: FrameSink
    task: asyncio.Task | None = None
    stop: StopReason | None = None  # set (once) when the agent stops this request; then its task is cancelled


def consumer_config(worker_id: str, max_pending: int, deliver_subject: str, ack_wait: float = ACK_WAIT) -> ConsumerConfig:
    """The agent's durable push consumer: delivers to ``deliver_subject``, at most ``max_pending`` unacked."""
    return ConsumerConfig(
        durable_name=work_consumer(worker_id),
        name=work_consumer(worker_id),
        filter_subject=work_subject(worker_id),
        deliver_subject=deliver_subject,
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait,
        max_deliver=1,
        max_ack_pending=max_pending,
    )


class RequestWorker:
    def __init__(
        self,
        *,
        nc: NATS,
        js: JetStreamContext,
        worker_id: str,
        max_pending: int,
        relay: Relay,
        abort: Callable[[str], Awaitable[None]],
        metrics: AgentMetrics,
        ack_wait: float = ACK_WAIT,
    ) -> None:
        self._nc = nc
        self._js = js
        self.worker_id = worker_id
        self._max_pending = max_pending
        self._relay = relay
        self._abort = abort
        self._metrics = metrics
        self._ack_wait = ack_wait
        self._inflight: dict[str, InFlight] = {}
        self._handlers: set[asyncio.Task] = set()
        self._cancelled = RecentIds(ttl=CANCELLED_MEMORY)
        self._outcomes = {o: metrics.requests.labels(o) for o in ("ok", "error", "cancelled", "expired")}
        self._refusal: StopReason | None = None  # set while draining: delivered work is refused with it
        self._work_sub = None
        self._cancel_sub = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        stream = request_stream(self.worker_id)
        deliver = self._nc.new_inbox()
        # subscribed before the consumer exists: nothing it pushes can miss the subscription
        self._work_sub = await self._nc.subscribe(deliver, cb=self._on_work)
        config = consumer_config(self.worker_id, self._max_pending, deliver, self._ack_wait)
        try:
            await self._js.add_consumer(stream, config=config)
        except Exception as exc:  # a consumer left by an earlier run with another config
            log.info("consumer_recreated", stream=stream, reason=str(exc))
            await self._js.delete_consumer(stream, config.durable_name)
            await self._js.add_consumer(stream, config=config)
        self._cancel_sub = await self._nc.subscribe(cancel_subject(self.worker_id), cb=self._on_cancel)
        await self._nc.flush()  # cancel subscription known to the broker before we register
        self._tasks["keepalive"] = asyncio.create_task(self._keepalive(), name="keepalive")

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def in_flight_by_router(self) -> dict[str, int]:
        """The requests being handled, counted per router that leased them."""
        return dict(Counter(entry.envelope.router_id for entry in self._inflight.values()))

    def begin_drain(self, refusal: StopReason) -> None:
        """Run no new work: from now on delivered envelopes are answered with ``refusal`` at once."""
        self._refusal = refusal

    async def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no request is being handled; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def stop_all(self, reason: StopReason) -> int:
        """Stop every in-flight request with ``reason``; returns how many were stopped."""
        return sum(self._stop(entry, reason) for entry in list(self._inflight.values()))

    @staticmethod
    def _stop(entry: InFlight, reason: StopReason) -> bool:
        """Cancel one running request (once: a request already being stopped keeps its first reason)."""
        if entry.stop is not None or entry.task is None or entry.task.done():
            return False
        entry.stop = reason
        entry.task.cancel()
        return True

    async def close(self, reason: StopReason = CLOSING) -> None:
        """Take no more work, stop what still runs with ``reason``, and wait for every answer and release.

        Envelopes the broker already delivered are answered (refused with ``reason`` unless a drain
        refusal is set), so none is left without a frame and a Release.
        """
        self._refusal = self._refusal or reason
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        work_sub, self._work_sub = self._work_sub, None
        if work_sub is not None:
            try:
                await asyncio.wait_for(work_sub.drain(), SUB_DRAIN_TIMEOUT)
            except Exception:  # connection closed or draining: nothing more arrives
                await unsubscribe_quietly(work_sub)
        cancel_sub, self._cancel_sub = self._cancel_sub, None
        if cancel_sub is not None:
            await unsubscribe_quietly(cancel_sub)
        self.stop_all(reason)
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)

    # --- delivery ---------------------------------------------------------------------------------
    async def _on_work(self, msg: Msg) -> None:
        """The subscription's callback: decode and vet the envelope, then run it in its own task or
        answer it at once (refused, expired, cancelled before it started, malformed)."""
        try:
            env = decode(WorkEnvelope, msg.data)
        except ValueError as exc:
            self._metrics.bad_envelopes.inc()
            log.warning("bad_envelope", error=str(exc)[:500], size=len(msg.data))
            await _quietly(msg.term(), "term")
            return
        refused = self._refusal_for(env)
        if refused is None:
            self._start(env, msg)
            return
        status, message, outcome = refused
        sink = FrameSink(self._nc.publish, env.reply_subject)
        await _quietly(sink.error(status, message), "error_frame", env.request_id)
        await self._finish(env, msg, outcome)

    def _refusal_for(self, env: WorkEnvelope) -> tuple[int, str, Outcome] | None:
        """Why ``env`` is answered at once instead of run: (status, message, outcome); None to run it."""
        if self._cancelled.contains(env.request_id, time.monotonic()):
            return CLIENT_CANCELLED.status, "cancelled before it started", "cancelled"
        if env.deadline <= time.time():
            return 504, "deadline passed before the worker started the request", "expired"
        if self._refusal is not None:
            return self._refusal.status, self._refusal.message, self._refusal.outcome
        if env.request_id in self._inflight:
            return 409, f"request id {env.request_id} is already running on this worker", "error"
        return None

    def _start(self, env: WorkEnvelope, msg: Msg) -> None:
        prefilled = functools.partial(self._prefilled, env) if env.stream else None
        entry = InFlight(env, msg, FrameSink(self._nc.publish, env.reply_subject, prefilled))
        self._inflight[env.request_id] = entry
        self._metrics.in_flight.set(len(self._inflight))
        self._idle.clear()
        entry.task = task = asyncio.create_task(self._serve(entry), name=f"request-{env.request_id}")
        self._handlers.add(task)
        task.add_done_callback(self._handler_done)

    def _handler_done(self, task: asyncio.Task) -> None:
        self._handlers.discard(task)
        if not self._handlers:
            self._idle.set()

    async def _keepalive(self) -> None:
        """Tell the broker long generations are still being worked on (no redelivery, no loss)."""
        while True:
            await asyncio.sleep(self._ack_wait / 3)
            for entry in list(self._inflight.values()):
                try:
                    await entry.msg.in_progress()
                except Exception as exc:
                    log.debug("in_progress_failed", request_id=entry.envelope.request_id, error=str(exc))

    # --- one request -----------------------------------------------------------------------------
    async def _serve(self, entry: InFlight) -> None:
        outcome = await self._relay_once(entry)
        # One turn of the loop lets the client's flusher send the last frame on its own: batched
        # with the ack, the broker would forward it only after doing the ack's stream work.
        await asyncio.sleep(0)
        await self._finish(entry.envelope, entry.msg, outcome)

    async def _relay_once(self, entry: InFlight) -> Outcome:
        """Relay the request to the engine; never raises (except for the agent's own teardown).

        A stop (cancel, drain timeout, engine gone) cancels this task with ``entry.stop`` set: the
        requester then gets that reason's error frame and the engine an abort when it applies.
        """
        env, sink = entry.envelope, entry.sink
        try:
            outcome: Outcome = await self._relay.run(env, sink)
        except asyncio.CancelledError:
            self._untrack(env.request_id)  # from here on no stop reaches this task
            reason = entry.stop
            if reason is None:
                raise  # not a stop of this request: the agent itself is torn down
            task = asyncio.current_task()
            while task is not None and task.uncancel():
                pass
            if not sink.closed:
                await _quietly(sink.error(reason.status, reason.message), "error_frame", env.request_id)
            if reason.abort_engine:
                await self._abort(env.request_id)
            return reason.outcome
        except Exception as exc:
            self._untrack(env.request_id)
            log.exception("request_failed", request_id=env.request_id)
            if not sink.closed:
                await _quietly(sink.error(500, f"worker-agent failure: {exc}"), "error_frame", env.request_id)
            return "error"
        self._untrack(env.request_id)
        if outcome == "expired":
            await self._abort(env.request_id)
        return outcome

    def _untrack(self, request_id: str) -> None:
        self._inflight.pop(request_id, None)
        self._metrics.in_flight.set(len(self._inflight))

    async def _prefilled(self, env: WorkEnvelope) -> None:
        """The first token went out: tell the lease's router this request now only decodes."""
        note = Prefilled(lease_id=env.lease_id, worker_id=self.worker_id)
        await _quietly(self._nc.publish(router_prefilled_subject(env.router_id), encode(note)),
                       "prefilled", env.request_id)

    async def _finish(self, env: WorkEnvelope, msg: Msg, outcome: Outcome) -> None:
        """Exactly once per envelope: ack it (it leaves the queue), count it, release its lease."""
        await _quietly(msg.ack(), "ack", env.request_id)
        self._outcomes[outcome].inc()
        release = Release(lease_id=env.lease_id, worker_id=self.worker_id, outcome=outcome)
        await _quietly(self._nc.publish(router_release_subject(env.router_id), encode(release)),
                       "release", env.request_id)

    # --- cancel ----------------------------------------------------------------------------------
    async def _on_cancel(self, msg: Msg) -> None:
        try:
            cancel = decode(Cancel, msg.data)
        except ValueError as exc:
            self._metrics.bad_cancels.inc()
            log.warning("bad_cancel", error=str(exc)[:500])
            return
        self._metrics.cancels.inc()
        self._cancelled.add(cancel.request_id, time.monotonic())
        entry = self._inflight.get(cancel.request_id)
        reason = CLIENT_CANCELLED
        if cancel.status != CLIENT_CANCELLED.status:  # stopped for a failure elsewhere, not by its client
            reason = StopReason("cancelled", cancel.status, cancel.message or "cancelled")
        if entry is not None and self._stop(entry, reason):
            log.info("request_cancelled", request_id=cancel.request_id, status=reason.status)


async def _quietly(aw: Awaitable, what: str, request_id: str | None = None) -> None:
    try:
        await aw
    except Exception as exc:  # broker gone or connection closing: nothing more to do for this one
        log.warning(f"{what}_failed", request_id=request_id, error=str(exc) or type(exc).__name__)
