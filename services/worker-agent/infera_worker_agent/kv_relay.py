"""Relaying the engine's ZMQ KV events to JetStream, in order, with gaps filled from replay.

The reading (one SUB socket per DP rank, seq order, replay after subscribing and on every gap) is
``infera_common.kv_zmq.KvZmqReader``; this module decides what an in-order batch becomes: one
``KvRelay(kind="blocks")`` with the engine's seq and the batch translated by the rank's
``BlockTranslator`` (the index hashes its events touched, by whether the engine holds them at the
end), published
on ``kv_event_subject(worker_id)`` with the JetStream ack awaited (so order and persistence hold).
Translating here, once per engine on its own host, leaves the kv-indexer set updates only (no token
decoding or hashing in the one process that serves the whole fleet) and puts 8 bytes per block on
the stream instead of the block's token ids. A ``KvRelay(kind="cleared")`` goes out first: the engine
starts with an empty cache, so anything indexed for this worker id is stale. A bad message or event,
a failed replay or a failed publish is logged and counted; the relay keeps going (an undecodable
batch still goes out, empty, so the indexer's seq stays continuous). Nothing a failed publish
carried is lost: its delta is kept and the rank's next batches are translated into it, so the next
relay carries both (``first_seq``..``seq``); a ``cleared`` that failed becomes a ``reset`` on every
rank's next relay. The index cannot keep blocks the engine evicted while JetStream was away.

``publish_state`` answers a kv-indexer's ``KvResync``: every rank's whole holding, as
``KvRelay(kind="state")`` parts, between two batches of that rank (a lock per rank), so that an
index restarted after the events of long-held blocks left the stream (``--kv-event-max-age``, a
broker that lost its store) holds them again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from infera_common.kv_endpoints import local_endpoint, subscriber_binds
from infera_common.kv_translate import BlockDelta, BlockTranslator, delta_relay, dump_translator, state_relays
from infera_common.kv_wire import BlockStored, KvEvent, KvWireError, RawBatch, read_batch
from infera_common.kv_zmq import REPLAY_TIMEOUT, KvReadObserver, KvZmqReader, ZmqKvSource
from infera_common.logs import get_logger
from infera_common.schemas import KvRelay
from infera_worker_agent.kv_config import KvSource
from infera_worker_agent.metrics import AgentMetrics

log = get_logger("worker_agent.kv_relay")

Publish = Callable[[KvRelay], Awaitable[None]]

__all__ = ["REPLAY_TIMEOUT", "KvRelayer", "Publish", "reader_source"]


def reader_source(source: KvSource) -> ZmqKvSource:
    """How the agent, on the engine's host, opens a publisher: wildcards at 127.0.0.1, and bound
    when the engine connects out to a concrete address."""
    replay = local_endpoint(source.replay_endpoint) if source.replay_endpoint else None
    if subscriber_binds(source.endpoint):
        return ZmqKvSource(source.dp_rank, source.endpoint, replay, bind=True)
    return ZmqKvSource(source.dp_rank, local_endpoint(source.endpoint), replay)


class _AgentObserver(KvReadObserver):
    """The reader's reports as the agent's metrics."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self.metrics = metrics

    def malformed(self, source: ZmqKvSource, reason: str) -> None:
        self.metrics.kv_malformed.labels("zmq").inc()

    def gap_detected(self, source: ZmqKvSource, missing: range) -> None:
        self.metrics.kv_gaps.labels("detected").inc()

    def gap_closed(self, source: ZmqKvSource, missing: range, lost: int) -> None:
        if lost:
            self.metrics.kv_gaps.labels("unrecoverable").inc()
            self.metrics.kv_lost_batches.inc(lost)
        else:
            self.metrics.kv_gaps.labels("filled").inc()


class KvRelayer:
    def __init__(
        self,
        worker_id: str,
        sources: Sequence[KvSource],
        block_size: int | None,
        publish: Publish,
        metrics: AgentMetrics,
        replay_timeout: float = REPLAY_TIMEOUT,
        on_block_size: Callable[[int], Awaitable[None]] | None = None,
        index_size_for: Callable[[int | None], int | None] = lambda page: page,
    ) -> None:
        self.worker_id = worker_id
        self.sources = list(sources)
        self.block_size = block_size  # the engine's page size
        # the size the relayed index hashes are at: the page, or a multiple its pages fold into (kv_coarse)
        self._index_size_for = index_size_for
        self.index_size = index_size_for(block_size)
        # the engine's events carry its real block size: the first one stored settles it (vLLM on CPU
        # defaults to 128 where the GPU default is 16, and vLLM has no /server_info to say so)
        self._on_block_size = on_block_size
        self._block_size_seen = False
        self._publish = publish
        self.metrics = metrics
        self.replay_timeout = replay_timeout
        self._reader: KvZmqReader | None = None
        self._translators: dict[int, BlockTranslator] = {}  # per DP rank
        self._carried: dict[int, _Carried] = {}  # per DP rank: what a failed publish did not deliver
        self._last_seq: dict[int, int] = {}  # per DP rank: the last engine batch translated
        self._locks: dict[int, asyncio.Lock] = {}  # per DP rank: a batch, or the state, at a time

    @property
    def block_size_seen(self) -> bool:
        """Whether a stored block has shown the engine's real block size."""
        return self._block_size_seen

    async def start(self) -> None:
        """Publish ``cleared`` (before anything else), then relay every rank."""
        self._translators.clear()
        self._carried.clear()
        self._last_seq.clear()
        if not await self._send(KvRelay(worker_id=self.worker_id, kind="cleared", dp_rank=None,
                                        block_size=self.index_size)):
            for source in self.sources:  # every rank's first relay clears what the index held of it
                self._carried[source.dp_rank] = _Carried(None, 0, BlockDelta(reset=True))
        self._reader = KvZmqReader(
            [reader_source(s) for s in self.sources], self._relay_batch, observer=_AgentObserver(self.metrics),
            replay_timeout=self.replay_timeout, log_fields={"worker_id": self.worker_id},
        )
        self._reader.start()
        log.info("kv_relay_started", worker_id=self.worker_id, block_size=self.block_size,
                 sources=[(s.dp_rank, s.endpoint, s.replay_endpoint) for s in self.sources])

    async def close(self) -> None:
        if self._reader is not None:
            reader, self._reader = self._reader, None
            await reader.close()

    # --- publishing ----------------------------------------------------------------------------
    def _lock(self, rank: int) -> asyncio.Lock:
        lock = self._locks.get(rank)
        if lock is None:
            lock = self._locks[rank] = asyncio.Lock()
        return lock

    def _translated(self, rank: int) -> tuple[BlockTranslator, int] | None:
        """Rank ``rank``'s translator and the seq of its last batch (call holding its lock)."""
        translator, seq = self._translators.get(rank), self._last_seq.get(rank)
        return None if translator is None or seq is None else (translator, seq)

    async def translator_states(self) -> list[dict]:
        """Each rank's translator as it is after its last batch (``kv_translate.dump_translator``), with
        that batch's seq: what lets an index that starts reading the engine's events late continue
        from there (``{"dp_rank", "seq", "translator"}``; each taken between two of the rank's batches)."""
        states: list[dict] = []
        for rank in sorted(self._translators):
            async with self._lock(rank):
                if (done := self._translated(rank)) is not None:
                    states.append({"dp_rank": rank, "seq": done[1], "translator": dump_translator(done[0])})
        return states

    async def publish_state(self) -> int:
        """Every rank's whole holding (``kv_translate.state_relays``) published on the stream, each
        rank's parts between two of its batches (so the stream has them in order with its relays);
        the parts sent (a rank's first failure ends its parts: the next resync sends them whole)."""
        sent = 0
        for rank in sorted(self._translators):
            async with self._lock(rank):
                if (done := self._translated(rank)) is None:
                    continue
                for relay in state_relays(self.worker_id, rank, done[1], done[0], self.index_size):
                    if not await self._send(relay):
                        break
                    sent += 1
        return sent

    async def _relay_batch(self, source: ZmqKvSource, seq: int, payload: bytes) -> None:
        try:
            batch: RawBatch | None = read_batch(payload)
        except KvWireError as exc:
            batch = None
            self.metrics.kv_malformed.labels("batch").inc()
            log.warning("kv_batch_malformed", worker_id=self.worker_id, dp_rank=source.dp_rank, seq=seq,
                        error=str(exc)[:300])
        rank = batch.dp_rank if batch is not None and batch.dp_rank is not None else source.dp_rank
        async with self._lock(rank):  # the batch's own rank wins
            await self._relay_one(rank, seq, batch)

    async def _relay_one(self, rank: int, seq: int, batch: RawBatch | None) -> None:
        carried = self._carried.pop(rank, None) or _Carried(None, 0, BlockDelta())
        delta = carried.delta
        if batch is not None:
            unreadable: list[str] = []
            events: Iterable[KvEvent] = batch.decoded(unreadable)
            if not self._block_size_seen:
                events = list(events)
                await self._check_block_size(events)
            translator = self._translators.get(rank)
            if translator is None:
                translator = self._translators[rank] = BlockTranslator(self.index_size)
            before = (delta.malformed, delta.orphaned, delta.unknown_removed)
            # in slices: the engine's first token of the request that stored these blocks is
            # usually right behind this batch, waiting for this process to relay it
            for _ in translator.apply_in_slices(events, delta):
                await asyncio.sleep(0)
            self._count_errors(len(unreadable), before, delta)
        self._last_seq[rank] = seq
        first = seq if carried.first_seq is None else carried.first_seq
        if await self._send(delta_relay(self.worker_id, rank, seq, delta, self.index_size, first)):
            self.metrics.kv_batches.labels(str(rank)).inc(carried.batches + 1)
            stored, removed = delta.blocks()
            self.metrics.kv_blocks.labels("stored").inc(stored)
            self.metrics.kv_blocks.labels("removed").inc(removed)
        else:  # the next relay of this rank carries it
            self._carried[rank] = _Carried(first, carried.batches + 1, delta)

    def _count_errors(self, unreadable: int, before: tuple[int, int, int], delta: BlockDelta) -> None:
        """One batch's errors: its ``unreadable`` events, and what its translation added to ``delta``'s
        counts since ``before``."""
        m = self.metrics
        malformed = unreadable + delta.malformed - before[0]
        orphaned, unknown = delta.orphaned - before[1], delta.unknown_removed - before[2]
        if malformed:
            m.kv_malformed.labels("event").inc(malformed)
        if orphaned:
            m.kv_orphaned.inc(orphaned)
        if unknown:
            m.kv_unknown_removed.inc(unknown)

    async def _check_block_size(self, events: list[KvEvent]) -> None:
        size = next((e.block_size for e in events if isinstance(e, BlockStored) and not e.placeholder), None)
        if size is None:
            return
        self._block_size_seen = True
        if size == self.block_size:
            return
        log.warning("kv_block_size_corrected", registered=self.block_size, engine_events=size)
        self.block_size, self.index_size = size, self._index_size_for(size)
        self._translators.clear()  # (nothing stored was translated yet: this is the first stored block)
        if self._on_block_size is not None:
            await self._on_block_size(size)

    async def _send(self, relay: KvRelay) -> bool:
        try:
            await self._publish(relay)
            return True
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.metrics.kv_publish_failures.inc()
            log.warning("kv_relay_publish_failed", kind=relay.kind, dp_rank=relay.dp_rank, seq=relay.seq,
                        error=str(exc) or type(exc).__name__)
            return False


@dataclass(slots=True)
class _Carried:
    """A rank's changes not delivered yet: from engine batch ``first_seq`` on (None: the next one)."""

    first_seq: int | None
    batches: int
    delta: BlockDelta
