"""The NATS request plane of one worker: take envelopes from the worker's work-queue stream and its
cancels, and hand them to a ``RequestRunner`` (``infera_common.request_runner``), which runs each one
against the engine and accounts for it exactly once (ack, then one Release).

The durable consumer pushes envelopes to a subscription of this agent (no pull request per
message) and holds at most ``max_pending`` unacknowledged (``max_ack_pending``); the stream's
``max_msgs`` with discard-new is what refuses work beyond the pending limit. Messages are acked
when their response is complete, on every path; a malformed envelope is terminated (``term``),
counted and dropped. The consumer never redelivers (``max_deliver`` 1): a request is never
executed twice. While draining, envelopes still delivered are answered with the refusal at once.

On its way out (drain or engine exit) the agent seals its queue, so routers' publishes are refused
and go to another worker, and waits until every envelope stored before was delivered: deleting the
stream then loses no request (without it, an envelope stored in the moment between the consumer's
end and the stream's deletion left its client waiting for ``--upstream-timeout``).

It also answers ``FramesQuery`` (``frames_query_subject``): a frontend back from a broker outage asks
how many frames each of its open requests was sent, to find frames and envelopes the outage lost;
and ``FramesReplay`` (``frames_replay_subject``): it sends the frames a frontend missed again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from infera_common.engine_relay import Abort, Relay
from infera_common.frames_answer import FramesAnswers
from infera_common.requester_clocks import RequesterClocks
from infera_common.requester_watch import RequesterWatch
from infera_common.logs import get_logger
from infera_common.nats_conn import flush_all, seal_request_stream, unsubscribe_quietly
from infera_common.request_runner import CLOSING, Engine, RequestRunner, SeriesHooks, StopReason, quietly
from infera_common.schemas import WorkEnvelope, decode
from infera_common.subjects import (
    cancel_subject, frames_query_subject, frames_replay_subject, request_stream, work_consumer, work_subject,
)
from infera_common.tasks import stop_tasks
from infera_worker_agent.metrics import AgentMetrics

log = get_logger("worker_agent.worker")

ACK_WAIT = 30.0
SUB_DRAIN_TIMEOUT = 5.0  # for envelopes already delivered to be answered when the agent stops
SETTLE_TIMEOUT = 5.0  # for stopped or refused requests to send their last frame and release
DELIVERY_POLL = 0.02  # seconds between looks at the consumer while waiting for the queue to empty


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
        abort: Abort,
        metrics: AgentMetrics,
        finds_hangs: bool,
        ack_wait: float = ACK_WAIT,
    ) -> None:
        self._nc = nc
        self._js = js
        self.worker_id = worker_id
        self._max_pending = max_pending
        self._engine = Engine(relay, abort)
        self._metrics = metrics
        self._ack_wait = ack_wait
        self._clock_questions: set[asyncio.Task] = set()  # frontends asked the time (``requester_clocks``)
        clocks = RequesterClocks(nc, self._ask_clock, metrics.requester_clock_offset.set)
        self._runner = RequestRunner(nc.publish, SeriesHooks(metrics.requests, metrics.in_flight, metrics.cancels,
                                                             metrics.bad_cancels), lambda _: finds_hangs,
                                     clocks)
        self._answers = FramesAnswers(self._runner, metrics.frames_queries, metrics.frames_replays)
        self._requesters = RequesterWatch(nc, self._runner, metrics.requesters_gone)
        self._work_sub = None
        self._cancel_sub = None
        self._frames_sub = None
        self._replay_sub = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._unacked: dict[int, Msg] = {}  # delivered envelopes whose answer is not complete (by id())
        self._sealed = False  # the queue takes no more work (the agent is on its way out)

    def _ask_clock(self, question: Coroutine) -> None:
        task = asyncio.create_task(question, name="requester-clock")
        self._clock_questions.add(task)
        task.add_done_callback(self._clock_questions.discard)

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
        self._frames_sub = await self._nc.subscribe(frames_query_subject(self.worker_id), cb=self._on_frames_query)
        self._replay_sub = await self._nc.subscribe(frames_replay_subject(self.worker_id), cb=self._on_replay)
        await flush_all(self._nc)  # cancel subscription known to the broker before we register
        self._tasks["keepalive"] = asyncio.create_task(self._keepalive(), name="keepalive")
        self._requesters.start()

    @property
    def in_flight(self) -> int:
        return self._runner.in_flight

    @property
    def in_flight_sequences(self) -> int:
        return self._runner.in_flight_sequences

    def in_flight_by_rank(self) -> dict[int, tuple[int, int]]:
        """Per DP rank its requests were pinned to: (requests in flight, frames they have sent)."""
        return self._runner.in_flight_by_rank()

    def in_flight_by_router(self) -> dict[str, int]:
        """The requests being handled, counted per router that leased them."""
        return self._runner.in_flight_by_router()

    def work_by_router(self) -> dict[str, tuple[int, int]]:
        """The size of the requests in flight per router (``RequestRunner.work_by_router``)."""
        return self._runner.work_by_router()

    def begin_drain(self, refusal: StopReason) -> None:
        """Run no new work: from now on delivered envelopes are answered with ``refusal`` at once."""
        self._runner.begin_drain(refusal)

    async def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no request is being handled; False on timeout."""
        return await self._runner.wait_idle(timeout)

    @property
    def sealed(self) -> bool:
        return self._sealed

    async def restore(self) -> None:
        """After a reconnect: the durable consumer again, pushing to the same subscription, if the
        broker lost it (a restarted broker loses the memory stream and its consumer; the caller
        recreates the stream first). Nothing once sealed or closed."""
        if self._work_sub is None or self._sealed:
            return
        stream, name = request_stream(self.worker_id), work_consumer(self.worker_id)
        try:
            await self._js.consumer_info(stream, name)
            return
        except NotFoundError:
            pass
        config = consumer_config(self.worker_id, self._max_pending, self._work_sub.subject, self._ack_wait)
        await self._js.add_consumer(stream, config=config)
        log.info("consumer_restored", stream=stream)

    async def seal_queue(self) -> None:
        """Take no more envelopes: the broker refuses every publish to this worker's queue from now on
        (routers try another worker), and what it already holds is still delivered."""
        self._sealed = True
        if not self._nc.is_connected:  # reconnecting: the update would only wait out its timeout
            log.warning("queue_not_sealed", error="NATS unreachable")
            return
        try:
            await seal_request_stream(self._js, self.worker_id)
        except Exception as exc:  # broker gone or stream already deleted: nothing more arrives anyway
            log.warning("queue_not_sealed", error=str(exc) or type(exc).__name__)

    async def wait_delivered(self, timeout: float) -> int:
        """Wait until the broker has delivered every envelope the queue holds (each then runs or gets
        the drain refusal, so none is lost with the stream); returns how many were still undelivered
        at ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if not self._nc.is_connected:  # nothing is delivered while the broker is away
                log.warning("queue_state_unknown", error="NATS unreachable")
                return 0
            try:
                info = await self._js.consumer_info(request_stream(self.worker_id), work_consumer(self.worker_id))
            except Exception as exc:  # broker gone or consumer deleted: nothing more can be delivered
                log.warning("queue_state_unknown", error=str(exc) or type(exc).__name__)
                return 0
            if info.num_pending == 0 or loop.time() >= deadline:
                return info.num_pending or 0
            await asyncio.sleep(DELIVERY_POLL)

    async def drain(self, refusal: StopReason, cancel: StopReason, timeout: float, force: asyncio.Event) -> None:
        """The agent stops: refuse new envelopes and seal the queue, let the running requests finish
        within ``timeout`` (or until ``force`` is set), stop the rest with ``cancel``, then settle."""
        self.begin_drain(refusal)
        await self.seal_queue()
        idle = asyncio.create_task(self.wait_idle(timeout))
        forced = asyncio.create_task(force.wait())
        await asyncio.wait({idle, forced}, return_when=asyncio.FIRST_COMPLETED)
        forced.cancel()
        if not (idle.done() and idle.result()):
            idle.cancel()
            log.warning("drain_incomplete_cancelled", cancelled=self.stop_all(cancel))
        await self.settle()

    async def abandon(self, refusal: StopReason, reason: StopReason) -> None:
        """The engine is gone: refuse and seal, stop every running request with ``reason``, settle."""
        self.begin_drain(refusal)
        await self.seal_queue()
        self.stop_all(reason)
        await self.settle()

    async def settle(self) -> None:
        """Every envelope the sealed queue still holds delivered (and refused), every answer sent."""
        undelivered = await self.wait_delivered(SETTLE_TIMEOUT)
        if undelivered:
            log.warning("queued_requests_unanswered", count=undelivered, timeout_s=SETTLE_TIMEOUT)
        await self.wait_idle(SETTLE_TIMEOUT)

    def stop_unanswered(self, reason: StopReason) -> int:
        """Stop the requests whose requester has had nothing of the answer yet (see ``RequestRunner``)."""
        return self._runner.stop_unanswered(reason)

    def stop_all(self, reason: StopReason) -> int:
        """Stop every in-flight request with ``reason``; returns how many were stopped."""
        return self._runner.stop_all(reason)

    async def close(self, reason: StopReason = CLOSING) -> None:
        """Take no more work, stop what still runs with ``reason``, and wait for every answer and release.

        Envelopes the broker already delivered are answered (refused with ``reason`` unless a drain
        refusal is set), so none is left without a frame and a Release.
        """
        self._runner.refuse_new(reason)
        await self._requesters.stop()
        await stop_tasks(*self._tasks.values(), *self._clock_questions)
        self._tasks.clear()
        work_sub, self._work_sub = self._work_sub, None
        if work_sub is not None:
            try:
                await asyncio.wait_for(work_sub.drain(), SUB_DRAIN_TIMEOUT)
            except Exception:  # connection closed or draining: nothing more arrives
                await unsubscribe_quietly(work_sub)
        for sub in (self._cancel_sub, self._frames_sub, self._replay_sub):
            if sub is not None:
                await unsubscribe_quietly(sub)
        self._cancel_sub = self._frames_sub = self._replay_sub = None
        await self._runner.close(reason)

    # --- delivery ---------------------------------------------------------------------------------
    async def _on_work(self, msg: Msg) -> None:
        """The subscription's callback: decode the envelope and hand it to the runner (which runs it in
        its own task or answers it at once); the ack follows its answer."""
        try:
            env = decode(WorkEnvelope, msg.data)
        except ValueError as exc:
            self._metrics.bad_envelopes.inc()
            log.warning("bad_envelope", error=str(exc)[:500], size=len(msg.data))
            await quietly(msg.term(), "term")
            return
        self._unacked[id(msg)] = msg

        async def ack() -> None:
            self._unacked.pop(id(msg), None)
            await msg.ack()

        await self._runner.submit(self.worker_id, env, self._engine, ack)

    async def _keepalive(self) -> None:
        """Tell the broker long generations are still being worked on (no redelivery, no loss)."""
        while True:
            await asyncio.sleep(self._ack_wait / 3)
            for msg in list(self._unacked.values()):
                try:
                    await msg.in_progress()
                except Exception as exc:
                    log.debug("in_progress_failed", error=str(exc))

    # --- cancel ----------------------------------------------------------------------------------
    async def _on_cancel(self, msg: Msg) -> None:
        self._runner.cancel(self.worker_id, msg.data)

    # --- after a broker outage ----------------------------------------------------------------------
    async def _on_frames_query(self, msg: Msg) -> None:
        """A frontend that reconnected asks how many frames its requests were sent: it compares them
        with what it received (frames published while it was away are lost) and learns of requests
        this worker never received (lost from the queue of a restarted broker)."""
        await self._answers.on_query(msg, self.worker_id)

    async def _on_replay(self, msg: Msg) -> None:
        """A frontend missed frames of a request: send them again (they go out before the answer)."""
        await self._answers.on_replay(msg, self.worker_id)
