"""The KV prefix index of the whole fleet: block changes in, overlap answers out (pure, no I/O).

Per target ``(worker_id, dp_rank)`` and block size it keeps the set of index hashes the target
holds (``block_hash`` chains over the engine events' ``token_ids``). Per model, a ``PrefixIndex``
maps index hashes to the targets holding them.

Changes arrive in two forms. The worker-agent relays each engine batch already translated
(``apply_blocks``: the index hashes its events touched, by whether the rank holds them at the end,
``kv_translate``), so on the NATS plane the indexer does set updates only. An engine batch read raw (from the engine's
ZMQ publisher, or a ``kind="batch"`` relay) goes through the target's own ``BlockTranslator``
first (``apply_batch``): the map engine hash -> index hash lives there.

A worker's model comes from discovery (``worker_joined``). Changes of a worker not in discovery
are applied to its own sets all the same, just not published in any model's index; when its
record arrives the blocks are attached to the model's index at once. Such an unattached worker is
forgotten after a grace period without events (``expire_unattached``): a worker that left before
the indexer (re)started, whose old events came back with the stream's replay; or a worker that
left discovery (``worker_left``): it leaves every model's index at once, but its blocks are kept,
unattached, for the grace period from its leave. Its engine may well have kept its cache: a broker
outage longer than the discovery TTL, or an agent stalled that long, makes every such worker leave
and come back, and blocks stored before are never announced again. A worker that comes back with
another engine start (its record's ``started_at``) has the kept blocks dropped first, unless they
were cleared since (the new engine's ``cleared`` came before its record): those are the new
engine's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from infera_common.kv_translate import BlockDelta, BlockTranslator
from infera_common.kv_wire import EventBatch
from infera_common.schemas import OverlapQuery, OverlapReply, WorkerOverlap

from infera_common.kv_index.prefix import PrefixIndex, Target


#: Seconds a worker not in discovery keeps its blocks after its last event or its leave: long enough
#: for a broker or etcd outage, or a stalled agent, to end and the worker to come back (its engine
#: kept its cache); the memory of a worker that never comes back is given back after it.
UNATTACHED_GRACE = 600.0


@dataclass(slots=True)
class Outcome:
    """What applying one batch did (for metrics)."""

    target: Target
    applied: dict[str, int] = field(default_factory=dict)  # event type -> events applied (raw batches)
    stored: int = 0  # index hashes the target newly holds
    removed: int = 0  # index hashes it no longer holds
    malformed: int = 0  # events that could not be applied
    duplicate: bool = False  # seq already seen: the batch was skipped
    gap: int = 0  # engine batches missing before this one
    unknown_removed: int = 0  # removed engine hashes the index never saw (aged out, or lost)
    orphaned: int = 0  # stored blocks dropped because their parent block is unknown


@dataclass(slots=True)
class RawApply:
    """A raw engine batch between ``KvIndex.open_batch`` and ``close_batch``."""

    worker: _Worker
    target: _Target
    outcome: Outcome
    translator: BlockTranslator | None  # None: the batch was applied already (a duplicate)
    delta: BlockDelta = field(default_factory=BlockDelta)


class _Target:
    __slots__ = ("key", "last_seq", "held", "bit", "translator")

    def __init__(self, key: Target) -> None:
        self.key = key
        self.last_seq: int | None = None
        self.held: dict[int, set[int]] = {}  # block size -> index hashes
        self.bit = 0  # its bit in the model's PrefixIndex; 0 while the worker's model is unknown
        self.translator: BlockTranslator | None = None  # for raw engine batches, made on the first


class _Worker:
    __slots__ = ("worker_id", "model", "targets", "last_event", "started_at")

    def __init__(self, worker_id: str, model: str | None, now: float, started_at: float | None = None) -> None:
        self.worker_id = worker_id
        self.model = model
        self.targets: dict[int, _Target] = {}
        self.last_event = now
        self.started_at = started_at  # the engine start the blocks belong to (None: not known)


class KvIndex:
    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}  # workers whose events arrived
        self._fleet: dict[str, str] = {}  # discovery: worker -> model
        self._by_model: dict[str, set[str]] = {}  # discovery: model -> workers
        self._models: dict[str, PrefixIndex] = {}
        self._index_sizes: dict[str, int] = {}  # worker -> its index block size, when pages fold
        self._started: dict[str, float] = {}  # discovery: worker -> its record's started_at

    # --- discovery ----------------------------------------------------------------------------
    def worker_joined(self, worker_id: str, model: str, index_size: int | None = None,
                      started_at: float | None = None) -> None:
        """A discovery record arrived (join or update); ``index_size`` is the record's
        ``kv_index_block_size``, at which raw engine batches of the worker are translated;
        ``started_at`` its engine start (blocks kept from another start of a worker that had left
        are dropped)."""
        kept = self._workers.get(worker_id)
        if (kept is not None and worker_id not in self._fleet and started_at is not None
                and kept.started_at is not None and kept.started_at != started_at):
            self._forget(worker_id)  # it left, and came back with a restarted engine
        if started_at is not None:
            self._started[worker_id] = started_at
            worker = self._workers.get(worker_id)
            if worker is not None:
                worker.started_at = started_at
        if self._index_sizes.get(worker_id) != index_size:
            self._set_index_size(worker_id, index_size)
        old = self._fleet.get(worker_id)
        if old == model:
            return
        if old is not None:
            self._by_model[old].discard(worker_id)
        self._fleet[worker_id] = model
        self._by_model.setdefault(model, set()).add(worker_id)
        worker = self._workers.get(worker_id)
        if worker is not None:
            self._detach(worker)
            worker.model = model
            self._attach(worker)

    def _set_index_size(self, worker_id: str, index_size: int | None) -> None:
        if index_size is None:
            self._index_sizes.pop(worker_id, None)
        else:
            self._index_sizes[worker_id] = index_size
        worker = self._workers.get(worker_id)
        if worker is not None and any(t.translator is not None for t in worker.targets.values()):
            self._drop_targets(worker, list(worker.targets))  # translated at the old size: never matched again

    def worker_left(self, worker_id: str, now: float) -> None:
        """The worker left discovery: no answer names it from now on; its blocks are kept, unattached,
        until ``expire_unattached``'s grace has passed from ``now`` (see the module doc)."""
        self._started.pop(worker_id, None)
        model = self._fleet.pop(worker_id, None)
        if model is not None:
            self._by_model[model].discard(worker_id)
            if not self._by_model[model]:
                del self._by_model[model]
        worker = self._workers.get(worker_id)
        if worker is None:
            self._index_sizes.pop(worker_id, None)
            return
        self._detach(worker)
        worker.model = None
        worker.last_event = now

    def expire_unattached(self, now: float, grace: float) -> list[str]:
        """Forget workers not in discovery whose last event (or leave) is older than ``grace`` seconds."""
        gone = [wid for wid, w in self._workers.items() if w.model is None and now - w.last_event > grace]
        for wid in gone:
            self._forget(wid)
        return gone

    def _forget(self, worker_id: str) -> None:
        worker = self._workers.pop(worker_id, None)
        if worker is not None:
            self._detach(worker)
        if worker_id not in self._fleet:
            self._index_sizes.pop(worker_id, None)

    # --- changes ------------------------------------------------------------------------------
    def apply_batch(self, worker_id: str, dp_rank: int | None, seq: int, batch: EventBatch, now: float) -> Outcome:
        """Apply one raw engine batch; ``dp_rank`` is the relay's (the batch's own rank wins), ``seq``
        the engine's sequence number (negative: unknown, no duplicate/gap check)."""
        raw = self.open_batch(worker_id, batch.dp_rank if batch.dp_rank is not None else (dp_rank or 0), seq, now)
        if raw.translator is not None:
            raw.translator.apply(batch.events, into=raw.delta)
        return self.close_batch(raw, len(batch.malformed))

    def open_batch(self, worker_id: str, dp_rank: int, seq: int, now: float) -> RawApply:
        """Begin applying raw engine batch ``seq`` of the target: translate its events with
        ``translator`` (None: ``seq`` was applied already, nothing to do) into ``delta``, then
        ``close_batch``. Between the two the index answers as before the batch."""
        worker = self._worker(worker_id, now)
        target = self._target(worker, dp_rank)
        out = Outcome(target.key)
        if self._skip(target, seq, out):
            return RawApply(worker, target, out, None)
        translator = target.translator
        if translator is None:
            translator = target.translator = BlockTranslator(self._index_sizes.get(worker_id))
        return RawApply(worker, target, out, translator)

    def close_batch(self, raw: RawApply, unreadable: int = 0) -> Outcome:
        """Apply what ``open_batch``'s translator gathered (``unreadable``: events the wire could not
        decode). Nothing is applied when the worker left or its target was cleared in between."""
        out, delta = raw.outcome, raw.delta
        out.malformed += unreadable
        if raw.translator is None:
            return out
        out.applied, out.malformed = delta.applied, out.malformed + delta.malformed
        out.unknown_removed, out.orphaned = delta.unknown_removed, delta.orphaned
        worker, target = raw.worker, raw.target
        if self._workers.get(worker.worker_id) is worker and worker.targets.get(target.key[1]) is target:
            self._change(worker, target, delta.reset, delta.stored, delta.removed, out)
        return out

    def apply_blocks(self, worker_id: str, dp_rank: int, seq: int, reset: bool,
                     stored: Mapping[int, Iterable[int]], removed: Mapping[int, Iterable[int]], now: float,
                     first_seq: int | None = None) -> Outcome:
        """Apply engine batches ``first_seq``..``seq`` (None: ``seq`` alone) the worker-agent already
        translated (``kv_translate.BlockDelta``'s fields). Skipped when ``seq`` was applied; batches of
        the range applied already are harmless (the change is by end state, not by difference)."""
        worker = self._worker(worker_id, now)
        target = self._target(worker, dp_rank)
        out = Outcome(target.key)
        if not self._skip(target, seq, out, first_seq):
            self._change(worker, target, reset, stored, removed, out)
        return out

    def apply_state(self, worker_id: str, dp_rank: int, seq: int, reset: bool,
                    stored: Mapping[int, Iterable[int]], now: float) -> Outcome:
        """Part of everything the target holds after engine batch ``seq`` (a worker-agent's answer to
        a resync): the first part (``reset``) replaces what it held, the others add to it. Skipped as
        stale when the index has applied a later batch (its changes would be undone). Restores the
        blocks whose events the index never saw (aged out of the stream before it started)."""
        worker = self._worker(worker_id, now)
        target = self._target(worker, dp_rank)
        out = Outcome(target.key)
        if seq >= 0 and target.last_seq is not None and seq < target.last_seq:
            out.duplicate = True
            return out
        if seq >= 0:
            target.last_seq = seq
        self._change(worker, target, reset, stored, {}, out)
        return out

    def restore_target(self, worker_id: str, dp_rank: int, seq: int, translator: BlockTranslator,
                       now: float) -> Outcome | None:
        """The target's translator as the worker-agent has it after engine batch ``seq`` (read before
        the engine's own publisher, ``--kv-event-transport zmq``): its holding replaces the target's,
        and the next raw batches continue from it. None (nothing changed) when it is at another index
        block size than the worker's record names, or older than a batch the index applied."""
        if translator.index_size != self._index_sizes.get(worker_id):
            return None
        worker = self._worker(worker_id, now)
        target = self._target(worker, dp_rank)
        if target.last_seq is not None and seq < target.last_seq:
            return None
        out = Outcome(target.key)
        target.translator = translator
        target.last_seq = seq
        held = {size: set(hashes) for size, hashes in translator.held().items()}
        self._change(worker, target, True, held, {}, out)
        return out

    def clear(self, worker_id: str, dp_rank: int | None, now: float) -> None:
        """The worker's engine (re)started empty: forget its blocks and sequence numbers
        (every rank when ``dp_rank`` is None)."""
        worker = self._worker(worker_id, now)
        self._drop_targets(worker, list(worker.targets) if dp_rank is None else [dp_rank])
        if dp_rank is None and worker_id not in self._fleet:
            worker.started_at = None  # what comes next is the next start's, whichever its record says

    def _drop_targets(self, worker: _Worker, ranks: list[int]) -> None:
        prefix = self._models.get(worker.model) if worker.model is not None else None
        for rank in ranks:
            target = worker.targets.pop(rank, None)
            if target is not None and prefix is not None:
                prefix.remove_target(target.key, target.held)

    @staticmethod
    def _skip(target: _Target, seq: int, out: Outcome, first_seq: int | None = None) -> bool:
        """Whether ``seq`` was applied already; records it and any gap before ``first_seq`` (default:
        ``seq``) otherwise."""
        if seq < 0:
            return False
        last = target.last_seq
        if last is not None and seq <= last:
            out.duplicate = True
            return True
        first = seq if first_seq is None else first_seq
        if last is not None and first > last + 1:
            out.gap = first - last - 1
        target.last_seq = seq
        return False

    def _change(self, worker: _Worker, target: _Target, reset: bool, stored: Mapping[int, Iterable[int]],
                removed: Mapping[int, Iterable[int]], out: Outcome) -> None:
        """Set union and difference: applying the same change twice changes nothing more."""
        prefix = self._models[worker.model] if target.bit else None  # type: ignore[index]
        bit = target.bit
        if reset:
            if prefix is not None:
                for size, hashes in target.held.items():
                    prefix.remove_all(size, hashes, bit)
            target.held.clear()
        for size, hashes in removed.items():
            held = target.held.get(size)
            if held:
                before = len(held)
                held.difference_update(hashes)
                out.removed += before - len(held)
                if prefix is not None:
                    prefix.remove_all(size, hashes, bit)
        for size, hashes in stored.items():
            held = target.held.get(size)
            if held is None:
                held = target.held[size] = set()
            before = len(held)
            held.update(hashes)
            out.stored += len(held) - before
            if prefix is not None:
                prefix.add_all(size, hashes, bit)

    # --- bookkeeping --------------------------------------------------------------------------
    def _worker(self, worker_id: str, now: float) -> _Worker:
        worker = self._workers.get(worker_id)
        if worker is None:
            worker = self._workers[worker_id] = _Worker(worker_id, self._fleet.get(worker_id), now,
                                                        self._started.get(worker_id))
        worker.last_event = now
        return worker

    def _target(self, worker: _Worker, rank: int) -> _Target:
        target = worker.targets.get(rank)
        if target is None:
            target = worker.targets[rank] = _Target((worker.worker_id, rank))
            if worker.model is not None:
                target.bit = self._prefix(worker.model).add_target(target.key)
        return target

    def _prefix(self, model: str) -> PrefixIndex:
        prefix = self._models.get(model)
        if prefix is None:
            prefix = self._models[model] = PrefixIndex()
        return prefix

    def _attach(self, worker: _Worker) -> None:
        assert worker.model is not None
        prefix = self._prefix(worker.model)
        for target in worker.targets.values():
            target.bit = prefix.add_target(target.key)
            for size, hashes in target.held.items():
                prefix.add_all(size, hashes, target.bit)

    def _detach(self, worker: _Worker) -> None:
        prefix = self._models.get(worker.model) if worker.model is not None else None
        for target in worker.targets.values():
            if prefix is not None:
                prefix.remove_target(target.key, target.held)
            target.bit = 0
        if prefix is not None and not prefix.targets:
            del self._models[worker.model]  # type: ignore[arg-type]

    # --- queries ------------------------------------------------------------------------------
    def overlap(self, query: OverlapQuery) -> OverlapReply:
        overlaps, unseen = self.depths(query.model, query.hashes, query.workers)
        return OverlapReply(
            overlaps=[WorkerOverlap(worker_id=wid, dp_rank=rank, blocks=blocks) for wid, rank, blocks in overlaps],
            unseen=unseen,
            held=[WorkerOverlap(worker_id=wid, dp_rank=rank, blocks=blocks)
                  for wid, rank, blocks in self.held(query.model, query.workers)],
        )

    def depths(self, model: str, hashes: dict[int, list[int]],
               workers: list[str] | None = None) -> tuple[list[tuple[str, int, int]], list[str]]:
        """``OverlapReply``'s content as plain values: ``[(worker_id, dp_rank, blocks)]`` sorted,
        and the unseen workers (the query handler encodes these without building models)."""
        wanted = None if workers is None else set(workers)
        prefix = self._models.get(model)
        overlaps = prefix.ordered(prefix.overlap(hashes, wanted)) if prefix is not None else []
        fleet = self._by_model.get(model)
        if not fleet:
            return overlaps, []
        seen = self._workers
        unseen = sorted(w for w in fleet if w not in seen and (wanted is None or w in wanted))
        return overlaps, unseen

    def held(self, model: str, workers: list[str] | None = None) -> list[tuple[str, int, int]]:
        """Blocks each target of the model's workers holds (all block sizes), ``[(worker_id, dp_rank,
        blocks)]`` sorted: with the record's capacity, how full its cache is. Workers whose events
        never arrived are absent (unknown, not empty)."""
        wanted = None if workers is None else set(workers)
        out = []
        for wid in self._by_model.get(model, ()):
            worker = self._workers.get(wid)
            if worker is None or (wanted is not None and wid not in wanted):
                continue
            out.extend((wid, rank, sum(map(len, t.held.values()))) for rank, t in worker.targets.items())
        out.sort()
        return out

    def worker_blocks(self, worker_id: str) -> int:
        """Blocks the worker holds (all ranks and block sizes; 0 when unknown)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return 0
        return sum(len(h) for t in worker.targets.values() for h in t.held.values())

    def is_seen(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def counts(self) -> tuple[int, int, int]:
        """(workers in discovery with events, in discovery without events, not in discovery with events)."""
        seen = sum(1 for w in self._fleet if w in self._workers)
        return seen, len(self._fleet) - seen, len(self._workers) - seen
