"""The KV prefix index of the whole fleet: engine events in, overlap answers out (pure, no I/O).

Per target ``(worker_id, dp_rank)`` and block size it keeps the map engine hash -> index hash
(index hashes are ``block_hash`` chains over the events' ``token_ids``; engine hashes are only keys
for resolving a ``BlockStored``'s parent and a ``BlockRemoved``). Per model, a ``PrefixIndex``
maps index hashes to the targets holding them.

A worker's model comes from discovery (``worker_joined``). Events of a worker not in discovery
are applied to its own maps all the same, just not published in any model's index; when its
record arrives the blocks are attached to the model's index at once. Such an unattached worker is
forgotten after a grace period without events (``expire_unattached``): it is typically a worker
that left before the indexer (re)started, whose old events came back with the stream's replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infera_common.block_hash import ROOT, block_hashes
from infera_common.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from infera_common.schemas import OverlapQuery, OverlapReply, WorkerOverlap

from infera_kv_indexer.prefix import PrefixIndex, Target


@dataclass(slots=True)
class Outcome:
    """What applying one engine batch did (for metrics)."""

    target: Target
    applied: dict[str, int] = field(default_factory=dict)  # event type -> events applied
    malformed: int = 0  # events that could not be applied
    duplicate: bool = False  # seq already seen: the batch was skipped
    gap: int = 0  # engine batches missing before this one
    unknown_removed: int = 0  # removed engine hashes the index never saw (aged out, or lost)
    orphaned: int = 0  # stored blocks dropped because their parent block is unknown


class _Blocks:
    """One target's blocks at one block size."""

    __slots__ = ("engine", "refs")

    def __init__(self) -> None:
        self.engine: dict[int, int] = {}  # engine hash -> index hash
        self.refs: dict[int, int] = {}  # index hash -> engine hashes mapping to it


class _Target:
    __slots__ = ("key", "last_seq", "sizes", "bit")

    def __init__(self, key: Target) -> None:
        self.key = key
        self.last_seq: int | None = None
        self.sizes: dict[int, _Blocks] = {}
        self.bit = 0  # its bit in the model's PrefixIndex; 0 while the worker's model is unknown

    def held(self) -> dict[int, list[int]]:
        return {size: list(b.refs) for size, b in self.sizes.items()}


class _Worker:
    __slots__ = ("worker_id", "model", "targets", "last_event")

    def __init__(self, worker_id: str, model: str | None, now: float) -> None:
        self.worker_id = worker_id
        self.model = model
        self.targets: dict[int, _Target] = {}
        self.last_event = now


class KvIndex:
    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}  # workers whose events arrived
        self._fleet: dict[str, str] = {}  # discovery: worker -> model
        self._by_model: dict[str, set[str]] = {}  # discovery: model -> workers
        self._models: dict[str, PrefixIndex] = {}

    # --- discovery ----------------------------------------------------------------------------
    def worker_joined(self, worker_id: str, model: str) -> None:
        """A discovery record arrived (join or update)."""
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

    def worker_left(self, worker_id: str) -> None:
        """The worker left discovery: forget it and every block it held."""
        model = self._fleet.pop(worker_id, None)
        if model is not None:
            self._by_model[model].discard(worker_id)
            if not self._by_model[model]:
                del self._by_model[model]
        worker = self._workers.pop(worker_id, None)
        if worker is not None:
            self._detach(worker)

    def expire_unattached(self, now: float, grace: float) -> list[str]:
        """Forget workers not in discovery whose last event is older than ``grace`` seconds."""
        gone = [wid for wid, w in self._workers.items() if w.model is None and now - w.last_event > grace]
        for wid in gone:
            del self._workers[wid]
        return gone

    # --- events -------------------------------------------------------------------------------
    def apply_batch(self, worker_id: str, dp_rank: int | None, seq: int, batch: EventBatch, now: float) -> Outcome:
        """Apply one engine batch; ``dp_rank`` is the relay's (the batch's own rank wins), ``seq``
        the engine's sequence number (negative: unknown, no duplicate/gap check)."""
        worker = self._worker(worker_id, now)
        rank = batch.dp_rank if batch.dp_rank is not None else (dp_rank or 0)
        target = self._target(worker, rank)
        out = Outcome(target.key, malformed=len(batch.malformed))
        if seq >= 0:
            last = target.last_seq
            if last is not None and seq <= last:
                out.duplicate = True
                return out
            if last is not None and seq > last + 1:
                out.gap = seq - last - 1
            target.last_seq = seq
        applied = out.applied
        prefix = self._models[worker.model] if target.bit else None  # type: ignore[index]
        for event in batch.events:
            cls = type(event)
            try:
                if cls is BlockStored:
                    done = self._store(worker, target, event, out, prefix)
                elif cls is BlockRemoved:
                    done = self._remove(worker, target, event, out)
                elif cls is AllBlocksCleared:
                    done = self._clear_blocks(worker, target)
                else:  # pragma: no cover - kv_wire only yields the three
                    done = False
            except (ValueError, OverflowError, TypeError):  # token ids that are not 0..2**32-1 integers
                out.malformed += 1
                continue
            if done:
                name = cls.__name__
                applied[name] = applied.get(name, 0) + 1
        return out

    def clear(self, worker_id: str, dp_rank: int | None, now: float) -> None:
        """The worker's engine (re)started empty: forget its blocks and sequence numbers
        (every rank when ``dp_rank`` is None)."""
        worker = self._worker(worker_id, now)
        ranks = list(worker.targets) if dp_rank is None else [dp_rank]
        prefix = self._models.get(worker.model) if worker.model is not None else None
        for rank in ranks:
            target = worker.targets.pop(rank, None)
            if target is not None and prefix is not None:
                prefix.remove_target(target.key, target.held())

    def _store(self, worker: _Worker, target: _Target, ev: BlockStored, out: Outcome,
               prefix: PrefixIndex | None) -> bool:
        size = ev.block_size
        blocks = target.sizes.get(size)
        if ev.parent_block_hash is None:
            parent: int | None = ROOT
        else:
            parent = blocks.engine.get(ev.parent_block_hash) if blocks is not None else None
        if parent is None:
            out.orphaned += len(ev.block_hashes)
            return False
        hashes = block_hashes(ev.token_ids, size, parent)  # raises on bad token ids: nothing changed yet
        if blocks is None:
            blocks = target.sizes[size] = _Blocks()
        engine, refs = blocks.engine, blocks.refs
        fresh: list[int] = []  # index hashes this target did not hold: added to the model's index
        for engine_hash, index_hash in zip(ev.block_hashes, hashes):
            old = engine.get(engine_hash)
            if old == index_hash:
                continue  # stored again (another medium, a replay)
            if old is not None:  # the engine reused a hash for other content (rare): keep the order
                if fresh and prefix is not None:
                    prefix.add_all(size, fresh, target.bit)
                fresh = []
                self._unref(worker, target, size, blocks, old)
            engine[engine_hash] = index_hash
            count = refs.get(index_hash, 0)
            refs[index_hash] = count + 1
            if not count:
                fresh.append(index_hash)
        if fresh and prefix is not None:
            prefix.add_all(size, fresh, target.bit)
        return True

    def _remove(self, worker: _Worker, target: _Target, ev: BlockRemoved, out: Outcome) -> bool:
        for engine_hash in ev.block_hashes:
            for size, blocks in target.sizes.items():
                index_hash = blocks.engine.pop(engine_hash, None)
                if index_hash is not None:
                    self._unref(worker, target, size, blocks, index_hash)
                    break
            else:
                out.unknown_removed += 1
        return True

    def _unref(self, worker: _Worker, target: _Target, size: int, blocks: _Blocks, index_hash: int) -> None:
        count = blocks.refs[index_hash] - 1
        if count:
            blocks.refs[index_hash] = count
            return
        del blocks.refs[index_hash]
        if target.bit:
            self._models[worker.model].remove(size, index_hash, target.bit)  # type: ignore[index]

    def _clear_blocks(self, worker: _Worker, target: _Target) -> bool:
        if target.bit:
            prefix = self._models[worker.model]  # type: ignore[index]
            for size, blocks in target.sizes.items():
                for index_hash in blocks.refs:
                    prefix.remove(size, index_hash, target.bit)
        target.sizes.clear()
        return True

    # --- bookkeeping --------------------------------------------------------------------------
    def _worker(self, worker_id: str, now: float) -> _Worker:
        worker = self._workers.get(worker_id)
        if worker is None:
            worker = self._workers[worker_id] = _Worker(worker_id, self._fleet.get(worker_id), now)
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
            for size, blocks in target.sizes.items():
                for index_hash in blocks.refs:
                    prefix.add(size, index_hash, target.bit)

    def _detach(self, worker: _Worker) -> None:
        prefix = self._models.get(worker.model) if worker.model is not None else None
        for target in worker.targets.values():
            if prefix is not None:
                prefix.remove_target(target.key, target.held())
            target.bit = 0
        if prefix is not None and not prefix.targets:
            del self._models[worker.model]  # type: ignore[arg-type]

    # --- queries ------------------------------------------------------------------------------
    def overlap(self, query: OverlapQuery) -> OverlapReply:
        overlaps, unseen = self.depths(query.model, query.hashes, query.workers)
        return OverlapReply(
            overlaps=[WorkerOverlap(worker_id=wid, dp_rank=rank, blocks=blocks) for wid, rank, blocks in overlaps],
            unseen=unseen,
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

    def worker_blocks(self, worker_id: str) -> int:
        """Blocks the worker holds (all ranks and block sizes; 0 when unknown)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return 0
        return sum(len(b.refs) for t in worker.targets.values() for b in t.sizes.values())

    def is_seen(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def counts(self) -> tuple[int, int, int]:
        """(workers in discovery with events, in discovery without events, not in discovery with events)."""
        seen = sum(1 for w in self._fleet if w in self._workers)
        return seen, len(self._fleet) - seen, len(self._workers) - seen
