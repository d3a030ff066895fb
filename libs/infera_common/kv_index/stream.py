"""The JetStream KV event stream (``--kv-event-transport nats``): replayed from its start, then followed.

``prepare`` makes sure the stream exists (with the kv-indexer's limits); ``replay`` subscribes an
ordered consumer over the whole stream (DeliverPolicy.ALL) and returns once the history present at
that moment has been handed to ``handle`` (or has aged out meanwhile); new messages keep coming
after that. Then, and whenever the broker lost the stream, ``resync`` (when given) asks the
worker-agents to put their whole holding on the stream (``KvResync``): the stream only has the
events of its max age and size, and blocks stored before them are still cached.

Why an ordered (ephemeral) consumer and not a durable one: the index lives in memory, so every
start has to rebuild it from the stream's whole history anyway; a durable consumer would remember
a position the new process has no use for, and would need acks for nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from infera_common.logs import get_logger
from infera_common.nats_conn import ensure_kv_event_stream, unsubscribe_quietly
from infera_common.schemas import KvResync, encode
from infera_common.subjects import KV_EVENT_STREAM, KV_EVENT_SUBJECTS, KV_RESYNC

log = get_logger("kv_index.stream")

#: How often replay progress is checked (the history may age out under a slow replay).
TICK = 1.0
#: While replaying, every how many messages the stream seq is read (for progress; the end is exact).
SEQ_EVERY = 64
#: ``handle(subject, data)``: one stream message (never raises: the caller counts what it cannot read)
Handle = Callable[[str, bytes], None]


class Flag(Protocol):
    """Where the follower says whether it is replaying (a Prometheus gauge: 1, then 0)."""

    def set(self, value: float) -> None: ...


class StreamFollower:
    def __init__(self, js: JetStreamContext, handle: Handle, replaying: Flag,
                 resync: Callable[[], Awaitable[None]] | None = None) -> None:
        self._js = js
        self._handle = handle
        self._replaying = replaying
        self._resync = resync
        self._sub: Subscription | None = None
        self._replay_until = 0  # stream sequence of the last message present at start
        self._replay_count = 0  # messages present at start
        self._applied_seq = 0  # stream sequence of the last message applied (read every SEQ_EVERY while replaying)
        self._last: Msg | None = None  # the last message applied
        self._caught_up = asyncio.Event()
        self._limits: tuple[float | None, float | None] = (None, None)  # as given to prepare()
        self._created = None  # when the followed stream was created (another one: follow it from its start)
        self._following = False  # between replay() and stop(): what restore() puts back
        self._resume_from = 0  # after restore(): messages of a lower stream seq were applied already
        self.messages = 0
        self.repeats = 0  # messages delivered again after a restore, dropped

    @property
    def replaying(self) -> bool:
        """True until the history present at start is applied."""
        return not self._caught_up.is_set()

    async def prepare(self, max_age: float | None, max_bytes: int | None) -> None:
        """Create the stream if absent; apply these limits (None: leave the stream's own, as a router does)."""
        self._limits = (max_age, max_bytes)
        await ensure_kv_event_stream(self._js, max_age, max_bytes)

    async def restore(self) -> None:
        """After a reconnect, follow the stream again at once (the ordered consumer of a restarted
        broker is gone; nats-py would notice only after missing its heartbeats): a stream that
        survived from the message after the last one applied; a stream the broker lost (restarted
        without its store), created again, from its start. The index built so far stays either way
        (the engines still hold those blocks)."""
        if not self._following:
            return
        try:
            created = (await self._js.stream_info(KV_EVENT_STREAM)).created
        except NotFoundError:
            created = None
        same = created is not None and created == self._created
        start = self._next_seq() if same else 1
        log.info("stream_refollowed", stream=KV_EVENT_STREAM, from_seq=start,
                 reason="reconnected" if same else "recreated" if created else "lost")
        if not same:  # (created anew by this call or by an agent's restore: read when)
            await ensure_kv_event_stream(self._js, *self._limits)
            created = (await self._js.stream_info(KV_EVENT_STREAM)).created
        await self._unsubscribe()
        self._resume_from = start
        self._sub = await self._subscribe(start)
        self._created = created  # (only now: an attempt that failed is redone from the same decision)
        if not same:
            await self._ask_resync("stream_recreated")

    def _next_seq(self) -> int:
        """The stream seq after the last message applied (after the history present at start, if none)."""
        if self._last is not None:
            try:
                return self._last.metadata.sequence.stream + 1
            except Exception:  # not a JetStream message
                pass
        return self._replay_until + 1

    async def _subscribe(self, start_seq: int = 1) -> Subscription:
        config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        if start_seq > 1:
            config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq)
        sub = await self._js.subscribe(KV_EVENT_SUBJECTS, stream=KV_EVENT_STREAM, cb=self._on_message,
                                       ordered_consumer=True, config=config)
        _resumes_after(sub, start_seq - 1)
        return sub

    async def replay(self) -> None:
        t0 = time.monotonic()
        info = await self._js.stream_info(KV_EVENT_STREAM)
        state, self._created = info.state, info.created
        self._replay_until = state.last_seq if state.messages else 0
        self._replay_count = state.messages
        self._replaying.set(1)
        if not self._replay_until:
            self._caught_up.set()
        self._sub = await self._subscribe()
        self._following = True
        log.info("replay_started", stream=KV_EVENT_STREAM, messages=state.messages, last_seq=state.last_seq)
        while not self._caught_up.is_set():
            try:
                await asyncio.wait_for(self._caught_up.wait(), TICK)
            except TimeoutError:
                await self._check_replay_end()
        self._replaying.set(0)
        log.info("replay_done", messages=self.messages, seconds=round(time.monotonic() - t0, 3))
        await self._ask_resync("started")

    async def _ask_resync(self, why: str) -> None:
        if self._resync is None:
            return
        try:
            await self._resync()
        except Exception as exc:  # the bus is away: the stream's own history is what the index has
            log.warning("kv_resync_not_asked", why=why, error=str(exc) or type(exc).__name__)
        else:
            log.info("kv_resync_asked", why=why)

    async def _check_replay_end(self) -> None:
        """The history present at start may have aged out under us: nothing left to wait for."""
        if self._last is not None and self._note_seq(self._last):
            return
        state = (await self._js.stream_info(KV_EVENT_STREAM)).state
        if not state.messages or state.first_seq > self._replay_until:
            self._caught_up.set()
        else:
            log.info("replaying", applied_seq=self._applied_seq, until=self._replay_until)

    async def stop(self) -> None:
        self._following = False
        await self._unsubscribe()

    async def _unsubscribe(self) -> None:
        sub, self._sub = self._sub, None
        await unsubscribe_quietly(sub)

    async def _on_message(self, msg: Msg) -> None:
        if self._resume_from:  # (until the first message past the restore point)
            try:
                seq = msg.metadata.sequence.stream
            except Exception:  # not a JetStream message
                seq = self._resume_from
            if seq < self._resume_from:
                if not self.repeats:
                    log.warning("stream_repeats_dropped", from_seq=seq, resumed_at=self._resume_from)
                self.repeats += 1
                return
            self._resume_from = 0
        self._handle(msg.subject, msg.data)
        self.messages += 1
        self._last = msg
        if not self._caught_up.is_set():
            # a message's stream seq is parsed from its reply subject: not for every message of a long
            # replay, but from the count present at start on (the end, unless some aged out: then the TICK)
            if self.messages >= self._replay_count or not self.messages % SEQ_EVERY:
                self._note_seq(msg)

    def _note_seq(self, msg: Msg) -> bool:
        """Record ``msg``'s stream seq; True (and caught up) once the history present at start is applied."""
        try:
            self._applied_seq = msg.metadata.sequence.stream
        except Exception:  # not a JetStream message
            return False
        if self._applied_seq >= self._replay_until:
            self._caught_up.set()
            return True
        return False


def _resumes_after(sub: Subscription, seq: int) -> None:
    """nats-py's ordered consumer, when it misses two idle heartbeats (a broker that stalls), begins
    again after the last stream seq it delivered: 0 until one arrives, so one begun at a later seq
    (``restore``) would be sent the whole stream again. Tell it where it begins (``_on_message``
    drops what it would repeat all the same)."""
    jsi = getattr(getattr(sub, "_sub", None), "_jsi", None)  # (the push subscription's inner one)
    if seq > 0 and jsi is not None and getattr(jsi, "_sseq", None) == 0:
        jsi._sseq = seq


async def request_resync(nc, requester: str) -> None:
    """Ask every worker-agent to relay its whole holding (``KvResync`` on ``KV_RESYNC``)."""
    await nc.publish(KV_RESYNC, encode(KvResync(requester=requester)))
