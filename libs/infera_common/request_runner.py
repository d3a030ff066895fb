"""Running work envelopes against engines: one task per request, stoppable, each accounted exactly once.

Shared by the two callers of an engine's HTTP API: the worker-agent (envelopes from its JetStream
work queue, NATS request plane) and the router's HTTP dispatcher (``--request-transport http``).
For every submitted envelope exactly one of these happens, then ``on_done`` (the agent acks) and
one ``Release`` to the lease's router:

- it is answered at once with an ``error`` frame (cancelled before it started, deadline passed,
  draining, a duplicate request id on the same worker);
- it runs (``engine_relay.Relay``) until the engine's answer ends, or until it is stopped: a
  ``Cancel`` on the worker's cancel subject, a drain timeout, the engine gone. A stopped request
  gets its reason's ``error`` frame (unless the answer already ended) and the engine an abort.

A streamed request's first data frame also sends ``Prefilled`` to its router (its prefill is done).
An envelope with ``keepalive`` gets an ``alive`` frame whenever its requester has had nothing for
that long while the engine holds it and no part of the answer went out (a non-streaming answer
is one frame at the end, however long the engine takes; a stream's first token may wait behind a
long queue): so the requester's own timeout measures silence of the worker, not the engine's
pace. Only for engines whose hang would be found (``vouch``: the agent's health probes generate,
or its stall check runs), which then hands such requests back; otherwise the requester's timeout
is the only guard against a hung engine and nothing restarts it. Mid-stream silence gets none:
an engine that stops between tokens shows as such.
Requests are keyed by (worker id, request id): a retry of a request on another worker is another
request. ``frames_sent`` says how many frames a request running or recently finished has sent, so
that a requester that lost its connection to the broker can tell whether frames were lost, and
``replay`` sends them again: each request keeps its last ``KEPT_FRAMES`` frames while it runs and
for ``REPLAY_MEMORY`` seconds after (at most ``REPLAY_REMEMBERED`` finished requests keep theirs).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from infera_common.dp_pin import RANK_HEADER
from infera_common.engine_relay import Abort, FrameSink, Outcome, Publish, Relay
from infera_common.logs import get_logger
from infera_common.recent import RecentIds
from infera_common.schemas import Cancel, Prefilled, Release, WorkEnvelope, decode, encode
from infera_common.subjects import requester_alive_subject, router_prefilled_subject, router_release_subject

log = get_logger("request_runner")

#: Seconds a cancelled request id is remembered, so that its envelope arriving late is not run.
CANCELLED_MEMORY = 60.0
#: Seconds (and how many) finished requests are remembered with the number of frames they sent.
FINISHED_MEMORY = 120.0
FINISHED_REMEMBERED = 50_000
#: Frames each request keeps to send again (~0.25 kB each: a 1k-token answer whole, and at 50
#: tokens/s the last 20 s of a longer one), and for how long (and how many) finished requests keep
#: them: a broker restart takes seconds.
KEPT_FRAMES = 1024
REPLAY_MEMORY = 30.0
REPLAY_REMEMBERED = 2000
#: The shortest wait between two looks for requests due an ``alive`` frame (seconds).
KEEPALIVE_MIN_TICK = 0.05


@dataclass(frozen=True, slots=True)
class StopReason:
    """Why a request is stopped or refused by its runner: the outcome released and the error frame sent."""

    outcome: Outcome
    status: int
    message: str
    abort_engine: bool = True
    #: the worker whose failure stopped this request, when not its own (the prefill worker of a
    #: disaggregated pair): the error frame names it, and the requester's retry avoids it instead
    failed_worker: str = ""


CLIENT_CANCELLED = StopReason("cancelled", 499, "cancelled by the requester")
CLOSING = StopReason("error", 503, "worker-agent stopping")
#: What a request gets whose frontend left the message bus (``requester_watch``): nobody reads its answer.
REQUESTER_GONE = StopReason("cancelled", 499, "its requester (a frontend) left the message bus")
#: What a request waiting on an engine its agent found unresponsive gets (``stop_unanswered``).
ENGINE_UNHEALTHY = StopReason("error", 503, "the worker's engine stopped answering its health checks; "
                              "retry on another worker")


class RunnerHooks(Protocol):
    """What a runner tells its service's metrics."""

    def finished(self, outcome: Outcome) -> None: ...
    def in_flight(self, count: int) -> None: ...
    def cancel_received(self) -> None: ...
    def bad_cancel(self) -> None: ...


class SeriesHooks:
    """``RunnerHooks`` over a service's Prometheus series: requests by outcome (a counter labelled
    ``outcome``), the in-flight gauge, and the counters of Cancel messages received and unreadable."""

    def __init__(self, requests: Any, in_flight: Any, cancels: Any, bad_cancels: Any) -> None:
        self._outcomes = {o: requests.labels(o) for o in ("ok", "error", "cancelled", "expired")}
        self._in_flight, self._cancels, self._bad_cancels = in_flight, cancels, bad_cancels

    def finished(self, outcome: Outcome) -> None:
        self._outcomes[outcome].inc()

    def in_flight(self, count: int) -> None:
        self._in_flight.set(count)

    def cancel_received(self) -> None:
        self._cancels.inc()

    def bad_cancel(self) -> None:
        self._bad_cancels.inc()


@dataclass(frozen=True, slots=True)
class Engine:
    """Where one worker's requests go: its relay and its abort."""

    relay: Relay
    abort: Abort


Done = Callable[[], Awaitable[None]]


@dataclass(slots=True)
class InFlight:
    worker_id: str
    envelope: WorkEnvelope
    engine: Engine
    sink: FrameSink
    on_done: Done | None
    task: asyncio.Task | None = None
    stop: StopReason | None = None  # set (once) when the runner stops this request; then its task is cancelled
    started: bool = False  # its task has run: a task cancelled before that never runs a line of it


class RequesterClock(Protocol):
    """This host's wall clock against the requester behind a reply subject (``requester_clocks``)."""

    def offset_for(self, reply_subject: str) -> float | None: ...

    def waiting(self, reply_subject: str) -> asyncio.Future[float | None] | None: ...


#: How long an envelope waits for its requester's first clock answer (``RequesterClock.waiting``).
CLOCK_WAIT = 0.25


class RequestRunner:
    def __init__(self, publish: Publish, hooks: RunnerHooks, vouch: Callable[[str], bool],
                 clock: RequesterClock | None = None) -> None:
        self._publish = publish
        self._hooks = hooks
        self._vouch = vouch  # worker id -> whether a hang of its engine would be found (then alive frames)
        self._clock = clock  # an envelope's deadline is on its requester's clock: read with the offset to it
        self._inflight: dict[tuple[str, str], InFlight] = {}
        self._per_worker: Counter[str] = Counter()
        self._handlers: set[asyncio.Task] = set()
        self._cancelled = RecentIds(ttl=CANCELLED_MEMORY)
        self._finished = RecentIds(ttl=FINISHED_MEMORY, max_size=FINISHED_REMEMBERED)  # key -> its FrameSink
        self._replayable: deque[tuple[float, FrameSink]] = deque()  # finished sinks still keeping frames
        self._refusal: StopReason | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._keepalive: asyncio.Task | None = None  # runs while some request may need alive frames

    # --- state ---------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    @property
    def in_flight_sequences(self) -> int:
        """The sequences the requests being handled run in the engine (``n`` x prompts each)."""
        return sum(entry.envelope.sequences for entry in self._inflight.values())

    def in_flight_of(self, worker_id: str) -> int:
        return self._per_worker.get(worker_id, 0)

    def in_flight_by_router(self) -> dict[str, int]:
        """The requests being handled, counted per router that leased them."""
        return dict(Counter(entry.envelope.router_id for entry in self._inflight.values()))

    def work_by_router(self) -> dict[str, tuple[int, int]]:
        """Per router that said the size of every one of its requests here: (prompt tokens still to
        prefill, prompt tokens x samples decoding). A request counts as prefilling until its first
        streamed data frame went out (a unary one throughout), as its router counts it."""
        work: dict[str, tuple[int, int]] = {}
        unsized: set[str] = set()
        for entry in self._inflight.values():
            env = entry.envelope
            if env.prefill_tokens is None or env.decode_tokens is None:
                unsized.add(env.router_id)
                continue
            prefill, decode = work.get(env.router_id, (0, 0))
            if env.stream and entry.sink.data_sent:
                decode += env.decode_tokens
            else:
                prefill += env.prefill_tokens
            work[env.router_id] = (prefill, decode)
        for router_id in unsized:
            work.pop(router_id, None)
        return work

    def in_flight_by_rank(self) -> dict[int, tuple[int, int]]:
        """Per DP rank the router pinned requests to (``dp_pin.RANK_HEADER``): the requests being
        handled there and the frames they have sent so far (a mark that moves while the rank works)."""
        ranks: dict[int, tuple[int, int]] = {}
        for entry in self._inflight.values():
            rank = entry.envelope.headers.get(RANK_HEADER)
            if rank is None or not rank.isdigit():
                continue
            count, frames = ranks.get(int(rank), (0, 0))
            ranks[int(rank)] = (count + 1, frames + entry.sink.seq)
        return ranks

    def frames_sent(self, worker_id: str, request_id: str) -> int | None:
        """How many frames the request has sent to its requester so far (all of them once finished);
        None when this runner does not know it (never received, or finished too long ago)."""
        sink = self._sink_of(worker_id, request_id)
        return None if sink is None else sink.seq

    async def replay(self, worker_id: str, request_id: str, from_seq: int) -> int:
        """Send the request's frames from number ``from_seq`` on again (to its requester); how many,
        or -1 when the request is unknown or some of those frames are no longer kept."""
        sink = self._sink_of(worker_id, request_id)
        frames = None if sink is None else sink.kept_from(from_seq)
        if frames is None:
            return -1
        await sink.resend(frames)
        return len(frames)

    def _sink_of(self, worker_id: str, request_id: str) -> FrameSink | None:
        entry = self._inflight.get((worker_id, request_id))
        if entry is not None:
            return entry.sink
        sink = self._finished.get(_key(worker_id, request_id), time.monotonic())
        return sink if isinstance(sink, FrameSink) else None

    def _retire(self, worker_id: str, request_id: str, sink: FrameSink) -> None:
        """The request ended (its sink may still send one error frame): remember it, keep its frames a while."""
        now = time.monotonic()
        self._finished.add(_key(worker_id, request_id), now, sink)
        self._replayable.append((now, sink))
        while self._replayable and (now - self._replayable[0][0] >= REPLAY_MEMORY
                                    or len(self._replayable) > REPLAY_REMEMBERED):
            self._replayable.popleft()[1].forget_frames()

    def begin_drain(self, refusal: StopReason) -> None:
        """Run no new work: from now on submitted envelopes are answered with ``refusal`` at once."""
        self._refusal = refusal

    async def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no request is being handled; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def stop_all(self, reason: StopReason) -> int:
        """Stop every in-flight request with ``reason``; how many were stopped."""
        return sum(self._stop(entry, reason) for entry in list(self._inflight.values()))

    def stop_unanswered(self, reason: StopReason, worker_id: str | None = None) -> int:
        """Stop the in-flight requests (of ``worker_id``, or all) whose requester has had nothing of the
        answer yet: no data frame, no final one (a frontend then still tries another worker)."""
        return sum(self._stop(entry, reason) for entry in list(self._inflight.values())
                   if (worker_id is None or entry.worker_id == worker_id)
                   and not entry.sink.closed and not entry.sink.data_sent)

    def requesters(self) -> set[str]:
        """Where to ask whether each frontend waiting for a request in flight is still on the bus
        (``subjects.requester_alive_subject``; requests answering a router are left out)."""
        out: set[str] = set()
        for entry in self._inflight.values():
            if entry.stop is None and (subject := requester_alive_subject(entry.envelope.reply_subject)):
                out.add(subject)
        return out

    def stop_requester(self, alive_subject: str, reason: StopReason) -> int:
        """Stop the requests of the frontend behind ``alive_subject`` (``requesters``); how many."""
        return sum(self._stop(entry, reason) for entry in list(self._inflight.values())
                   if requester_alive_subject(entry.envelope.reply_subject) == alive_subject)

    def refuse_new(self, reason: StopReason) -> None:
        """Answer submitted envelopes with ``reason`` at once, unless a drain refusal is already set."""
        self._refusal = self._refusal or reason

    async def close(self, reason: StopReason = CLOSING) -> None:
        """Refuse new work with ``reason``, stop what runs with it and wait for every answer and release."""
        self.refuse_new(reason)
        self.stop_all(reason)
        if self._handlers:
            await asyncio.gather(*list(self._handlers), return_exceptions=True)
        if self._keepalive is not None:
            self._keepalive.cancel()
            await asyncio.gather(self._keepalive, return_exceptions=True)
            self._keepalive = None

    # --- submit --------------------------------------------------------------------------------
    async def submit(self, worker_id: str, env: WorkEnvelope, engine: Engine, on_done: Done | None = None) -> None:
        """Run ``env`` on ``engine`` in its own task, or answer it at once when it must not run.
        Its ``deadline`` is moved onto this host's clock first (``clock``): while the first question to
        its requester is under way, in a task of its own, so that the envelopes behind it do not wait."""
        if self._clock is not None:
            subject = env.clock_of or env.reply_subject
            offset = self._clock.offset_for(subject)
            answer = self._clock.waiting(subject) if offset is None else None
            if answer is not None:
                task = asyncio.create_task(self._submit_on_answer(answer, worker_id, env, engine, on_done),
                                           name=f"request-clock-{env.request_id}")
                self._handlers.add(task)
                self._idle.clear()
                task.add_done_callback(self._handler_done)
                return
            if offset:
                env.deadline += offset
        await self._submit(worker_id, env, engine, on_done)

    async def _submit_on_answer(self, answer: asyncio.Future[float | None], worker_id: str, env: WorkEnvelope,
                                engine: Engine, on_done: Done | None) -> None:
        try:
            offset = await asyncio.wait_for(asyncio.shield(answer), CLOCK_WAIT)
        except TimeoutError:
            offset = None
        if offset:
            env.deadline += offset
        await self._submit(worker_id, env, engine, on_done)

    async def _submit(self, worker_id: str, env: WorkEnvelope, engine: Engine, on_done: Done | None) -> None:
        refused = self._refusal_for(worker_id, env)
        if refused is None:
            self._start(worker_id, env, engine, on_done)
            return
        sink = FrameSink(self._publish, env.reply_subject, keep=1)
        self._retire(worker_id, env.request_id, sink)
        await tell_stop(sink, refused, env.request_id)
        await self._finish(worker_id, env, on_done, refused.outcome)

    def _refusal_for(self, worker_id: str, env: WorkEnvelope) -> StopReason | None:
        """Why ``env`` is answered at once instead of run; None to run it. An envelope whose ``Cancel``
        came first gets that cancel's reason: a leg of a disaggregated pair stopped because the other
        leg failed reports that failure, not a cancel by its client."""
        cancelled = self._cancelled.get(_key(worker_id, env.request_id), time.monotonic())
        if cancelled is not None:
            reason, lease_id = cancelled
            if not lease_id or lease_id == env.lease_id:  # (another lease: a retry after that attempt)
                if reason is CLIENT_CANCELLED:
                    return StopReason("cancelled", CLIENT_CANCELLED.status, "cancelled before it started")
                return reason
        if env.deadline <= time.time():
            return StopReason("expired", 504, "deadline passed before the worker started the request")
        if self._refusal is not None:
            return self._refusal
        if (worker_id, env.request_id) in self._inflight:
            return StopReason("error", 409, f"request id {env.request_id} is already running on this worker")
        return None

    def _start(self, worker_id: str, env: WorkEnvelope, engine: Engine, on_done: Done | None) -> None:
        prefilled = (lambda: self._prefilled(worker_id, env)) if env.stream else None
        entry = InFlight(worker_id, env, engine, FrameSink(self._publish, env.reply_subject, prefilled, KEPT_FRAMES),
                         on_done)
        self._inflight[(worker_id, env.request_id)] = entry
        self._per_worker[worker_id] += 1
        self._hooks.in_flight(len(self._inflight))
        self._idle.clear()
        entry.task = task = asyncio.create_task(self._serve(entry), name=f"request-{env.request_id}")
        self._handlers.add(task)
        task.add_done_callback(self._handler_done)
        if env.keepalive and self._vouch(worker_id) and (self._keepalive is None or self._keepalive.done()):
            self._keepalive = asyncio.create_task(self._keep_alive(), name="request-keepalive")

    async def _keep_alive(self) -> None:
        """Send ``alive`` frames to the requests that asked for them and are due one; ends when no
        request in flight may need one any more."""
        while True:
            waiting = [e for e in self._inflight.values() if e.envelope.keepalive and e.stop is None
                       and not e.sink.answer_begun and self._vouch(e.worker_id)]
            if not waiting:
                return
            now = time.monotonic()
            for entry in waiting:
                if now - entry.sink.last_sent >= entry.envelope.keepalive:  # type: ignore[operator]
                    await quietly(entry.sink.alive(), "alive_frame", entry.envelope.request_id)
            await asyncio.sleep(max(KEEPALIVE_MIN_TICK, min(e.envelope.keepalive for e in waiting) / 2))  # type: ignore[type-var]

    def _handler_done(self, task: asyncio.Task) -> None:
        self._handlers.discard(task)
        if not self._handlers:
            self._idle.set()

    # --- one request ---------------------------------------------------------------------------
    async def _serve(self, entry: InFlight) -> None:
        entry.started = True
        if entry.stop is not None:  # stopped before this task first ran: the engine never had it
            outcome = await self._stopped_unstarted(entry)
        else:
            outcome = await self._relay_once(entry)
        # One turn of the loop lets the client's flusher send the last frame on its own: batched
        # with the ack, the broker would forward it only after doing the ack's stream work.
        await asyncio.sleep(0)
        await self._finish(entry.worker_id, entry.envelope, entry.on_done, outcome, unreachable=entry.sink.unreached)

    async def _relay_once(self, entry: InFlight) -> Outcome:
        """Relay the request to the engine; never raises (except for the runner's own teardown).

        A stop cancels this task with ``entry.stop`` set: the requester then gets that reason's
        error frame and the engine an abort when it applies.
        """
        env, sink = entry.envelope, entry.sink
        try:
            outcome: Outcome = await entry.engine.relay.run(env, sink)
        except asyncio.CancelledError:
            self._untrack(entry)  # from here on no stop reaches this task
            reason = entry.stop
            if reason is None:
                raise  # not a stop of this request: the service itself is torn down
            task = asyncio.current_task()
            while task is not None and task.uncancel():
                pass
            await tell_stop(sink, reason, env.request_id)
            if reason.abort_engine:
                await entry.engine.abort(env.request_id)
            return reason.outcome
        except Exception as exc:
            self._untrack(entry)
            log.exception("request_failed", request_id=env.request_id, worker_id=entry.worker_id)
            if not sink.closed:
                await quietly(sink.error(500, f"relay failure: {exc}"), "error_frame", env.request_id)
            return "error"
        self._untrack(entry)
        if outcome == "expired":
            await entry.engine.abort(env.request_id)
        return outcome

    async def _stopped_unstarted(self, entry: InFlight) -> Outcome:
        """A request stopped (a cancel right behind its envelope) before its task ran: the requester
        gets the stop's error frame, and the request is finished like any other."""
        self._untrack(entry)
        reason = entry.stop
        assert reason is not None
        await tell_stop(entry.sink, reason, entry.envelope.request_id)
        return reason.outcome

    def _untrack(self, entry: InFlight) -> None:
        key = (entry.worker_id, entry.envelope.request_id)
        if self._inflight.pop(key, None) is not None:
            self._retire(*key, entry.sink)
            self._per_worker[entry.worker_id] -= 1
            if self._per_worker[entry.worker_id] <= 0:
                del self._per_worker[entry.worker_id]
        self._hooks.in_flight(len(self._inflight))

    @staticmethod
    def _stop(entry: InFlight, reason: StopReason) -> bool:
        """Cancel one running request (once: a request already being stopped keeps its first reason)."""
        if entry.stop is not None or entry.task is None or entry.task.done():
            return False
        entry.stop = reason
        if entry.started:  # else it sees the stop when it runs: cancelled now, it would never run at all
            entry.task.cancel()
        return True

    async def _prefilled(self, worker_id: str, env: WorkEnvelope) -> None:
        """The first token went out: tell the lease's router this request now only decodes."""
        note = Prefilled(lease_id=env.lease_id, worker_id=worker_id)
        await quietly(self._publish(router_prefilled_subject(env.router_id), encode(note)),
                       "prefilled", env.request_id)

    async def _finish(self, worker_id: str, env: WorkEnvelope, on_done: Done | None, outcome: Outcome,
                      unreachable: bool = False) -> None:
        """Exactly once per envelope: ``on_done`` (the agent's ack), count it, release its lease
        (``unreachable``: the engine refused the connection, which its router's breaker acts on at once)."""
        if on_done is not None:
            await quietly(on_done(), "ack", env.request_id)
        self._hooks.finished(outcome)
        release = Release(lease_id=env.lease_id, worker_id=worker_id, outcome=outcome, unreachable=unreachable)
        await quietly(self._publish(router_release_subject(env.router_id), encode(release)),
                       "release", env.request_id)

    # --- cancel --------------------------------------------------------------------------------
    def cancel(self, worker_id: str, data: bytes) -> None:
        """A ``Cancel`` message for ``worker_id``: stop the request (or refuse it if it comes later)."""
        try:
            cancel = decode(Cancel, data)
        except ValueError as exc:
            self._hooks.bad_cancel()
            log.warning("bad_cancel", error=str(exc)[:500])
            return
        self._hooks.cancel_received()
        reason = CLIENT_CANCELLED
        if cancel.worker_fault:  # the requester waited too long for this worker: its fault
            reason = StopReason("error", cancel.status, cancel.message or "timed out")
        elif cancel.status != CLIENT_CANCELLED.status:  # stopped for a failure elsewhere, not by its client
            reason = StopReason("cancelled", cancel.status, cancel.message or "cancelled",
                                failed_worker=cancel.failed_worker)
        self._cancelled.add(_key(worker_id, cancel.request_id), time.monotonic(), (reason, cancel.lease_id))
        entry = self._inflight.get((worker_id, cancel.request_id))
        if entry is not None and cancel.lease_id and entry.envelope.lease_id != cancel.lease_id:
            return  # another attempt of the request (a retry on this worker): not the one to stop
        if entry is not None and self._stop(entry, reason):
            log.info("request_cancelled", request_id=cancel.request_id, worker_id=worker_id, status=reason.status)


def _key(worker_id: str, request_id: str) -> str:
    return f"{worker_id}\x00{request_id}"


async def tell_stop(sink: FrameSink, reason: StopReason, request_id: str) -> None:
    """The requester's error frame for a stopped (or refused) request, unless its answer has ended."""
    if not sink.closed:
        await quietly(sink.error(reason.status, reason.message, reason.failed_worker), "error_frame", request_id)


async def quietly(aw: Awaitable, what: str, request_id: str | None = None) -> None:
    try:
        await aw
    except Exception as exc:  # broker gone or connection closing: nothing more to do for this one
        log.warning(f"{what}_failed", request_id=request_id, error=str(exc) or type(exc).__name__)
