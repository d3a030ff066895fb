"""The request plane of one worker: pull envelopes from the worker's work-queue stream, run them,
cancel them, and account for every one of them exactly once (ack, then one Release).

Pulled messages are acked when their response is complete, on every path; a malformed envelope
is terminated (``term``), counted and dropped. The durable consumer never redelivers
(``max_deliver`` 1): a request is never executed twice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext

from infera_common.logs import get_logger
from infera_common.schemas import Cancel, Release, WorkEnvelope, decode, encode
from infera_common.subjects import cancel_subject, request_stream, router_release_subject, work_consumer, work_subject
from infera_worker_agent.metrics import AgentMetrics
from infera_worker_agent.recent import RecentIds
from infera_worker_agent.relay import FrameSink, Outcome, Relay

log = get_logger("worker_agent.worker")

ACK_WAIT = 30.0
FETCH_TIMEOUT = 5.0
CANCELLED_MEMORY = 60.0


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
    task: asyncio.Task | None = None
    stop: StopReason | None = None


def consumer_config(worker_id: str, max_pending: int, ack_wait: float = ACK_WAIT) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=work_consumer(worker_id),
        name=work_consumer(worker_id),
        filter_subject=work_subject(worker_id),
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
        self._slots = asyncio.Semaphore(max_pending)
        self._inflight: dict[str, InFlight] = {}
        self._handlers: set[asyncio.Task] = set()
        self._cancelled = RecentIds(ttl=CANCELLED_MEMORY)
        self._refusal: StopReason | None = None  # set while draining: pulled work is refused with it
        self._psub = None
        self._cancel_sub = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        stream = request_stream(self.worker_id)
        config = consumer_config(self.worker_id, self._max_pending, self._ack_wait)
        try:
            await self._js.add_consumer(stream, config=config)
        except Exception as exc:  # a consumer left by an earlier run with another config
            log.info("consumer_recreated", stream=stream, reason=str(exc))
            await self._js.delete_consumer(stream, config.durable_name)
            await self._js.add_consumer(stream, config=config)
        self._psub = await self._js.pull_subscribe_bind(config.durable_name, stream=stream)
        self._cancel_sub = await self._nc.subscribe(cancel_subject(self.worker_id), cb=self._on_cancel)
        self._tasks["pull"] = asyncio.create_task(self._pull_loop(), name="pull")
        self._tasks["keepalive"] = asyncio.create_task(self._keepalive(), name="keepalive")

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def begin_drain(self, refusal: StopReason) -> None:
        """Run no new work: from now on pulled envelopes are answered with ``refusal`` at once."""
        self._refusal = refusal
        pull = self._tasks.pop("pull", None)
        if pull is not None:
            pull.cancel()
        if "refuse" not in self._tasks:
            self._tasks["refuse"] = asyncio.create_task(self._refuse_loop(pull), name="refuse")

    async def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no request is being handled; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def stop_all(self, reason: StopReason) -> int:
        """Stop every in-flight request with ``reason``; returns how many were stopped."""
        stopped = 0
        for entry in list(self._inflight.values()):
            if entry.task is not None and not entry.task.done():
                entry.stop = entry.stop or reason
                entry.task.cancel()
                stopped += 1
        return stopped

    async def close(self, reason: StopReason = CLOSING) -> None:
        """Stop pulling, stop what still runs with ``reason``, and wait for every answer and release."""
        self._refusal = self._refusal or reason
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        for sub in (self._cancel_sub, self._psub):
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except Exception:  # connection already closed
                    pass
        self.stop_all(reason)
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)

    # --- pulling ---------------------------------------------------------------------------------
    async def _pull_loop(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                msgs = await self._fetch(FETCH_TIMEOUT)
            except asyncio.CancelledError:
                self._slots.release()
                raise
            if not msgs:
                self._slots.release()
            for msg in msgs:
                self._spawn(msg, holds_slot=True)
            _raise_if_cancel_requested()

    async def _refuse_loop(self, pull: asyncio.Task | None) -> None:
        if pull is not None:  # one fetch at a time on the subscription
            await asyncio.gather(pull, return_exceptions=True)
        while True:
            for msg in await self._fetch(1.0):
                self._spawn(msg, holds_slot=False)
            _raise_if_cancel_requested()

    async def _fetch(self, timeout: float) -> list[Msg]:
        """At most one message; [] on timeout or a (logged) broker error."""
        try:
            return await self._psub.fetch(1, timeout=timeout)
        except TimeoutError:
            return []
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("fetch_failed", error=str(exc) or type(exc).__name__)
            await asyncio.sleep(0.5)
            return []

    def _spawn(self, msg: Msg, holds_slot: bool) -> None:
        self._idle.clear()
        task = asyncio.create_task(self._handle(msg, holds_slot))
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

    # --- one message -----------------------------------------------------------------------------
    async def _handle(self, msg: Msg, holds_slot: bool) -> None:
        try:
            try:
                env = decode(WorkEnvelope, msg.data)
            except ValueError as exc:
                self._metrics.bad_envelopes.inc()
                log.warning("bad_envelope", error=str(exc)[:500], size=len(msg.data))
                await _quietly(msg.term(), "term")
                return
            outcome = await self._run(env, msg)
            await _quietly(msg.ack(), "ack", env.request_id)
            self._metrics.requests.labels(outcome).inc()
            release = Release(lease_id=env.lease_id, worker_id=self.worker_id, outcome=outcome)
            await _quietly(self._nc.publish(router_release_subject(env.router_id), encode(release)),
                           "release", env.request_id)
        finally:
            if holds_slot:
                self._slots.release()

    async def _run(self, env: WorkEnvelope, msg: Msg) -> Outcome:
        """Answer one envelope; never raises (except for the agent's own cancellation)."""
        sink = FrameSink(self._publish, env.reply_subject)
        try:
            if self._cancelled.contains(env.request_id, time.monotonic()):
                await sink.error(CLIENT_CANCELLED.status, "cancelled before it started")
                return "cancelled"
            if env.deadline <= time.time():
                await sink.error(504, "deadline passed before the worker started the request")
                return "expired"
            if self._refusal is not None:
                await sink.error(self._refusal.status, self._refusal.message)
                return self._refusal.outcome
            if env.request_id in self._inflight:
                await sink.error(409, f"request id {env.request_id} is already running on this worker")
                return "error"
            return await self._relay_tracked(env, msg, sink)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("request_failed", request_id=env.request_id)
            if not sink.closed:
                await _quietly(sink.error(500, f"worker-agent failure: {exc}"), "error_frame", env.request_id)
            return "error"

    async def _relay_tracked(self, env: WorkEnvelope, msg: Msg, sink: FrameSink) -> Outcome:
        entry = InFlight(env, msg)
        entry.task = asyncio.create_task(self._relay.run(env, sink), name=f"relay-{env.request_id}")
        self._inflight[env.request_id] = entry
        self._metrics.in_flight.set(len(self._inflight))
        try:
            outcome: Outcome = await entry.task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the agent itself is being torn down
            reason = entry.stop or CLIENT_CANCELLED
            if not sink.closed:
                await sink.error(reason.status, reason.message)
            if reason.abort_engine:
                await self._abort(env.request_id)
            return reason.outcome
        finally:
            self._inflight.pop(env.request_id, None)
            self._metrics.in_flight.set(len(self._inflight))
        if outcome == "expired":
            await self._abort(env.request_id)
        return outcome

    async def _publish(self, subject: str, data: bytes) -> None:
        await self._nc.publish(subject, data)

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
        if entry is not None and entry.task is not None and not entry.task.done():
            entry.stop = entry.stop or CLIENT_CANCELLED
            entry.task.cancel()
            log.info("request_cancelled", request_id=cancel.request_id)


def _raise_if_cancel_requested() -> None:
    """Python 3.11's wait_for (inside nats-py's fetch) can swallow a cancellation: honour it anyway."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def _quietly(aw: Awaitable, what: str, request_id: str | None = None) -> None:
    try:
        await aw
    except Exception as exc:  # broker gone or connection closing: nothing more to do for this one
        log.warning(f"{what}_failed", request_id=request_id, error=str(exc) or type(exc).__name__)
