"""One engine rank's KV events as changes to the index hashes it holds (pure, no I/O).

A ``BlockTranslator`` follows one target (a worker's DP rank). Per block size it keeps the map
engine hash -> index hash (index hashes are ``block_hash`` chains over the events' ``token_ids``;
engine hashes are only keys for resolving a ``BlockStored``'s parent and a ``BlockRemoved``) and,
per index hash, how many engine hashes map to it (two engine blocks with the same tokens but, say,
another LoRA or cache salt are one index block).

``apply`` turns engine events into a ``BlockDelta``: every index hash the events touched, by where
it ended — held (``stored``) or not held (``removed``) — and whether everything held before was
cleared first (``reset``). A consumer applies it as ``held -= removed; held |= stored`` (after
clearing on ``reset``): the result does not depend on what it held of the touched hashes before,
so applying a delta twice, or a delta that overlaps one already applied, is harmless, and the
consumer needs no reference counts of its own. One delta may gather several batches (``into``):
the worker-agent keeps the delta of a batch whose relay failed and sends it with the next one.
``apply_in_slices`` does the same work a slice at a time, for callers that share their process with
requests (a long prompt's blocks arrive just ahead of its first token).

A translator made with an ``index_size`` indexes pages smaller than it (that divide it) in blocks
of ``index_size`` tokens (``kv_coarse``): the worker's index block size, at which the router hashes.

Where an engine holds a block is its *residency*: the event's (``medium``, ``group_idx``), the GPU
and group 0 when absent. An engine with a second tier (vLLM's CPU offloading, SGLang's HiCache)
stores a block there while the GPU holds it, and drops it from the GPU before the tier: the block
stays held until its last residency drops it (its prefix is still a hit, loaded back instead of
computed), and a removal from a residency that never stored it changes nothing. A tier's
placeholder store (``block_size`` 0: no tokens) adds the residency to an engine block already
known and is otherwise dropped. A hybrid model's KV cache groups are residencies too, so a block
leaves the index when its last group evicts it. Pages folded into larger index blocks (``kv_coarse``)
are followed on the GPU alone: other residencies' events for them are skipped.

Two places translate: the worker-agent, which relays each engine batch as its delta
(``KvRelay(kind="blocks")``), so the kv-indexer never decodes a token on the NATS plane; and the
kv-indexer itself for batches it reads raw (``--kv-event-transport zmq``, or ``kind="batch"``
relays).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from infera_common.block_hash import ROOT, adapter_root, block_hashes, opaque, pack_hashes, salted_root
from infera_common.int_columns import pack_map, unpack_map
from infera_common.kv_coarse import CoarsePages, dump_pages, load_pages
from infera_common.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from infera_common.schemas import KvRelay

#: Blocks applied between two chances for other work (``apply_in_slices``): ~0.2 ms of SGLang-style
#: per-block events on this project's 2-core CI machine.
SLICE_BLOCKS = 32


@dataclass(slots=True)
class BlockDelta:
    """Where the index hashes some events touched ended, and what of the events could not be applied."""

    reset: bool = False  # every block held before the events is gone (AllBlocksCleared)
    stored: dict[int, set[int]] = field(default_factory=dict)  # block size -> touched index hashes held at the end
    removed: dict[int, set[int]] = field(default_factory=dict)  # block size -> touched index hashes not held at the end
    applied: dict[str, int] = field(default_factory=dict)  # event type -> events applied
    malformed: int = 0  # events that could not be applied (token ids that are not 0..2**32-1 integers)
    unknown_removed: int = 0  # removed engine hashes never stored (aged out of a replay, or lost)
    orphaned: int = 0  # stored blocks dropped because their parent block is unknown

    def sets(self, size: int) -> tuple[set[int], set[int]]:
        """The (stored, removed) sets of one block size, made empty if missing."""
        stored, removed = self.stored.get(size), self.removed.get(size)
        if stored is None:
            stored = self.stored[size] = set()
        if removed is None:
            removed = self.removed[size] = set()
        return stored, removed

    def blocks(self) -> tuple[int, int]:
        """(stored, removed) index hashes, summed over block sizes."""
        return sum(map(len, self.stored.values())), sum(map(len, self.removed.values()))


#: The residency of an event without ``medium`` or ``group_idx``: the GPU, KV cache group 0.
PRIMARY = ("GPU", 0)


def residency(event: BlockStored | BlockRemoved) -> tuple[str, int]:
    """Where ``event`` stores or drops its blocks: (medium, KV cache group)."""
    return (event.medium or "GPU", event.group_idx or 0)


class _Blocks:
    """The target's blocks at one block size."""

    __slots__ = ("engine", "refs", "tiers")

    def __init__(self) -> None:
        self.engine: dict[int, int] = {}  # engine hash -> index hash
        self.refs: dict[int, int] = {}  # index hash -> engine hashes mapping to it
        # engine hash -> its residencies, for the blocks held anywhere but on the PRIMARY alone
        self.tiers: dict[int, set[tuple[str, int]]] = {}


class BlockTranslator:
    __slots__ = ("_sizes", "_coarse", "index_size")

    def __init__(self, index_size: int | None = None) -> None:
        self._sizes: dict[int, _Blocks] = {}
        self._coarse: dict[int, CoarsePages] = {}  # engine page size -> its pages, indexed at index_size
        self.index_size = index_size  # None: every page size is indexed as it is

    def held(self) -> dict[int, Iterable[int]]:
        """Block size -> the index hashes the target holds."""
        held: dict[int, Iterable[int]] = {size: b.refs.keys() for size, b in self._sizes.items()}
        for c in self._coarse.values():
            both = held.get(c.index_size)
            held[c.index_size] = c.refs.keys() if both is None else set(both) | c.refs.keys()
        return held

    def _coarse_for(self, page_size: int) -> CoarsePages | None:
        """The pages of this size when they are folded into larger index blocks."""
        coarse = self._coarse.get(page_size)
        if coarse is None:
            if not self._folds(page_size):
                return None
            coarse = self._coarse[page_size] = CoarsePages(page_size, self.index_size)  # type: ignore[arg-type]
        return coarse

    def _folds(self, page_size: int) -> bool:
        size = self.index_size
        return size is not None and 0 < page_size < size and size % page_size == 0

    def apply(self, events: Iterable[KvEvent], into: BlockDelta | None = None) -> BlockDelta:
        """Apply events in order, into ``into`` (the delta of the batches before them) or a new delta;
        a bad event is counted and skipped."""
        delta = into if into is not None else BlockDelta()
        if self.index_size is None:
            for event in events:
                self._apply_one(event, delta, 1)
            return delta
        for event, parts in _chained(events, self._folds):  # SGLang's one-event-per-page runs, joined
            if not self._apply_one(event, delta, len(parts)) and len(parts) > 1:
                for part in parts:  # a bad token id somewhere in the run: each event on its own
                    self._apply_one(part, delta, 1)
        return delta

    def _apply_one(self, event: KvEvent, delta: BlockDelta, events: int) -> bool:
        """Apply ``event`` (standing for ``events`` engine events); False if it was malformed."""
        cls = type(event)
        try:
            if cls is BlockStored:
                done = self._store(event, delta)  # type: ignore[arg-type]
            elif cls is BlockRemoved:
                done = self._remove(event, delta)  # type: ignore[arg-type]
            elif cls is AllBlocksCleared:
                self._sizes.clear()
                self._coarse.clear()
                delta.reset, done = True, True
                delta.stored.clear()
                delta.removed.clear()
            else:  # pragma: no cover - kv_wire only yields the three
                done = False
        except (ValueError, OverflowError, TypeError):  # token ids that are not 0..2**32-1 integers
            if events == 1:
                delta.malformed += 1
            return False
        if done:
            applied = delta.applied
            name = cls.__name__
            applied[name] = applied.get(name, 0) + events
        return True

    def apply_in_slices(self, events: Iterable[KvEvent], into: BlockDelta,
                        blocks: int = SLICE_BLOCKS) -> Iterator[None]:
        """``apply``, a slice at a time: the iterator yields each time about ``blocks`` blocks were
        applied (whole events: an event is never split; pages folded into index blocks count as
        the index blocks they make), so that an adapter can let other work run in between; ``into``
        is complete when it ends. Applying a 16k-token prompt's blocks at once holds a Python process
        for milliseconds, in which a token waiting to be relayed waits too."""
        done = 0.0
        chunk: list[KvEvent] = []
        weights: dict[int, float] = {}  # block size -> what one block of it counts for
        removed_weight = min((c.page_size / c.index_size for c in self._coarse.values()), default=1.0)
        for event in events:
            chunk.append(event)
            cls = type(event)
            if cls is BlockStored:
                size = event.block_size  # type: ignore[union-attr]
                weight = weights.get(size)
                if weight is None:  # a folded page counts as the part of an index block it is
                    folds = self._folds(size)
                    weight = weights[size] = size / self.index_size if folds else 1.0  # type: ignore[operator]
                done += len(event.block_hashes) * weight  # type: ignore[union-attr]
            elif cls is BlockRemoved:
                done += len(event.block_hashes) * removed_weight  # type: ignore[union-attr]
            else:
                done += 1
            if done >= blocks:
                self.apply(chunk, into)
                chunk, done = [], 0.0
                yield
        if chunk:
            self.apply(chunk, into)

    def _store(self, ev: BlockStored, delta: BlockDelta) -> bool:
        size = ev.block_size
        where = residency(ev)
        if not size:
            return self._store_placeholder(ev, where)
        if self.index_size is not None and size < self.index_size:
            coarse = self._coarse_for(size)
            if coarse is not None:
                return where != PRIMARY or self._store_coarse(coarse, ev, delta)
        blocks = self._sizes.get(size)
        if ev.parent_block_hash is None:
            parent: int | None = event_root(ev)
        else:
            parent = blocks.engine.get(ev.parent_block_hash) if blocks is not None else None
        if parent is None:
            delta.orphaned += len(ev.block_hashes)
            return False
        keys = ev.extra_keys
        if type(keys) is list and any(k is not None for k in keys):  # (vLLM sends one entry per block)
            hashes = keyed_hashes(ev, size, parent)
        else:
            hashes = block_hashes(ev.token_ids, size, parent)  # raises on bad token ids: nothing changed yet
        if blocks is None:
            blocks = self._sizes[size] = _Blocks()
        engine, refs, tiers = blocks.engine, blocks.refs, blocks.tiers
        elsewhere = where != PRIMARY
        stored = delta.stored.get(size)
        if stored is None:
            stored = delta.stored[size] = set()
        removed = delta.removed.get(size)  # (``_moved`` inlined: this loop is the ingest hot path)
        for engine_hash, index_hash in zip(ev.block_hashes, hashes):
            old = engine.get(engine_hash)
            if old == index_hash:  # stored again (a replay), or in one more residency
                if elsewhere or tiers:
                    _add_residency(tiers, engine_hash, where)
                continue
            if old is not None:  # the engine reused a hash for other content (rare)
                tiers.pop(engine_hash, None)
                self._unref(size, refs, old, delta)
                removed = delta.removed.get(size)
            if elsewhere:
                tiers[engine_hash] = {where}
            engine[engine_hash] = index_hash
            count = refs.get(index_hash, 0)
            refs[index_hash] = count + 1
            if not count:
                if removed:
                    removed.discard(index_hash)
                stored.add(index_hash)
        return True

    def _store_placeholder(self, ev: BlockStored, where: tuple[str, int]) -> bool:
        """A residency that holds engine blocks it does not describe: known blocks get it."""
        for engine_hash in ev.block_hashes:
            for blocks in self._sizes.values():
                if engine_hash in blocks.engine:
                    _add_residency(blocks.tiers, engine_hash, where)
                    break
        return True

    @staticmethod
    def _store_coarse(coarse: CoarsePages, ev: BlockStored, delta: BlockDelta) -> bool:
        at = coarse.start(ev.parent_block_hash, event_root(ev))
        if at is None:
            delta.orphaned += len(ev.block_hashes)
            return False
        coarse.store(ev.block_hashes, ev.token_ids, at, *delta.sets(coarse.index_size))
        return True

    def _remove(self, ev: BlockRemoved, delta: BlockDelta) -> bool:
        where = residency(ev)
        if not self._sizes and len(self._coarse) == 1:  # only folded pages (SGLang at page 1): no search
            if where != PRIMARY:
                return True  # (folded pages are followed on the GPU alone)
            coarse = next(iter(self._coarse.values()))
            stored, removed = delta.sets(coarse.index_size)
            for engine_hash in ev.block_hashes:
                if not coarse.remove(engine_hash, stored, removed):
                    delta.unknown_removed += 1
            return True
        for engine_hash in ev.block_hashes:
            for size, blocks in self._sizes.items():
                engine = blocks.engine
                if engine_hash not in engine:
                    continue
                held = blocks.tiers.get(engine_hash)
                if held is None:
                    if where != PRIMARY:  # held on the GPU alone: not stored where it is dropped from
                        delta.unknown_removed += 1
                        break
                elif where not in held:
                    delta.unknown_removed += 1
                    break
                elif len(held) > 1:
                    held.discard(where)  # still held elsewhere
                    break
                else:
                    del blocks.tiers[engine_hash]
                self._unref(size, blocks.refs, engine.pop(engine_hash), delta)
                break
            else:
                if not self._remove_coarse(engine_hash, where, delta):
                    delta.unknown_removed += 1
        return True

    def _remove_coarse(self, engine_hash: int, where: tuple[str, int], delta: BlockDelta) -> bool:
        if where != PRIMARY:
            return any(engine_hash in coarse.pages for coarse in self._coarse.values())
        for coarse in self._coarse.values():
            if engine_hash in coarse.pages:
                return coarse.remove(engine_hash, *delta.sets(coarse.index_size))
        return False

    @staticmethod
    def _unref(size: int, refs: dict[int, int], index_hash: int, delta: BlockDelta) -> None:
        count = refs[index_hash] - 1
        if count:
            refs[index_hash] = count
            return
        del refs[index_hash]
        _moved(delta.stored, delta.removed, size, index_hash)


def _add_residency(tiers: dict[int, set[tuple[str, int]]], engine_hash: int, where: tuple[str, int]) -> None:
    """A block already held (on the PRIMARY alone unless ``tiers`` says otherwise) is held in ``where`` too."""
    held = tiers.get(engine_hash)
    if held is None:
        if where != PRIMARY:
            tiers[engine_hash] = {PRIMARY, where}
    else:
        held.add(where)


def dump_translator(translator: BlockTranslator) -> dict:
    """Everything ``load_translator`` needs to continue where ``translator`` is (plain msgpack-able
    values): per block size its map engine hash -> index hash (integer columns, ``int_columns``)
    and the residencies of the blocks not on the GPU alone, and its folded pages. A translator that
    follows the same engine events from there gives the same changes as this one would."""
    return {
        "index_size": translator.index_size,
        "sizes": {size: pack_map(blocks.engine) for size, blocks in translator._sizes.items()},
        "tiers": {size: [[h, [list(r) for r in held]] for h, held in blocks.tiers.items()]
                  for size, blocks in translator._sizes.items() if blocks.tiers},
        "coarse": [dump_pages(c) for c in translator._coarse.values()],
    }


def load_translator(state: dict) -> BlockTranslator:
    """The translator ``dump_translator`` described (block counts recomputed). Raises ``ValueError``,
    ``KeyError`` or ``TypeError`` on a malformed state."""
    index_size = state["index_size"]
    translator = BlockTranslator(None if index_size is None else int(index_size))
    for size, engine in state["sizes"].items():
        blocks = translator._sizes[int(size)] = _Blocks()
        blocks.engine = unpack_map(engine)
        blocks.refs = dict(Counter(blocks.engine.values()))  # index hash -> engine hashes naming it
    for size, tiers in state.get("tiers", {}).items():  # (absent from an older agent's state)
        blocks = translator._sizes[int(size)]
        blocks.tiers = {int(h): {(str(m), int(g)) for m, g in held} for h, held in tiers}
    for pages in state["coarse"]:
        coarse = load_pages(pages)
        translator._coarse[coarse.page_size] = coarse
    return translator


def _chained(events: Iterable[KvEvent], folds: Callable[[int], bool]) -> Iterator[tuple[KvEvent, list[KvEvent]]]:
    """The events, with each run of ``BlockStored`` events of a folded page size that continue one
    another (each one's parent is the last page before it), and each run of ``BlockRemoved`` events,
    joined into one: (event, the events it stands for). SGLang sends one event per page."""
    run: list = []
    folded: dict[int, bool] = {}
    for event in events:
        cls = type(event)
        if run:
            last = run[-1]
            if cls is type(last) and (_continues(event, last) if cls is BlockStored else  # type: ignore[arg-type]
                                      event.medium == last.medium and event.group_idx == last.group_idx):
                run.append(event)
                continue
            yield _joined(run), run
            run = []
        if cls is BlockRemoved:
            run = [event]
        elif cls is BlockStored:
            size = event.block_size  # type: ignore[union-attr]
            fold = folded.get(size)
            if fold is None:
                fold = folded[size] = folds(size)
            if fold:
                run = [event]
            else:
                yield event, [event]
        else:
            yield event, [event]
    if run:
        yield _joined(run), run


def event_root(ev: BlockStored) -> int:
    """The index parent of a ``BlockStored`` whose first block has no parent: the root of the adapter
    that computed it (``adapter_root``: vLLM and SGLang name it in ``lora_name``), else the base
    model's, salted by the request's cache salt (``salted_root``; ``event_salt``). An engine that
    gives only the adapter's number (``lora_id``) gets a root no request's name gives: its blocks
    stay apart from the base model's, found by no request."""
    if ev.lora_name is not None:
        root = adapter_root(ev.lora_name)
    elif ev.lora_id is not None:
        root = adapter_root(f"\x00lora_id {ev.lora_id}")
    else:
        root = ROOT
    return salted_root(root, event_salt(ev))


def event_salt(ev: BlockStored) -> str | None:
    """The cache salt a sequence's first block was computed under: vLLM puts it in that block's extra
    keys, after the adapter's name (the keys' only strings; ``kv_wire`` puts SGLang's own
    ``cache_salt`` field there too)."""
    keys = ev.extra_keys
    if type(keys) is not list or not keys or type(keys[0]) is not list:
        return None
    strings = [k for k in keys[0] if type(k) is str]
    if ev.lora_name is not None and strings and strings[0] == ev.lora_name:
        strings = strings[1:]
    return strings[0] if strings else None


def keyed_hashes(ev: BlockStored, size: int, parent: int) -> list[int]:
    """The index hashes of a ``BlockStored`` whose blocks carry extra keys (vLLM's ``extra_keys``, one
    entry per block: the adapter's name, an image's identifier and offset, the cache salt, a prompt
    embedding's digest). From the first block whose KV depends on more than its tokens, adapter and
    salt (an entry that is not a string), the chain goes on from ``opaque``: the router hashes tokens
    alone, so it never matches that block or any after it, as the engine would not."""
    keys = ev.extra_keys
    tokens = ev.token_ids
    for i, key in enumerate(keys[:len(ev.block_hashes)]):
        if type(key) is list and any(type(item) is not str for item in key):
            head = block_hashes(tokens[:i * size], size, parent)
            return head + block_hashes(tokens[i * size:], size, opaque(head[-1] if head else parent))
    return block_hashes(tokens, size, parent)


def _continues(event: BlockStored, last: BlockStored) -> bool:
    """Whether ``event`` stores the pages right after ``last``'s, at the same page size."""
    return (event.parent_block_hash == last.block_hashes[-1] and event.block_size == last.block_size
            and event.medium == last.medium and event.group_idx == last.group_idx)


def _joined(run: list) -> KvEvent:
    if len(run) == 1:
        return run[0]
    first = run[0]
    if type(first) is BlockRemoved:
        return BlockRemoved([h for e in run for h in e.block_hashes], first.medium, first.group_idx)
    return BlockStored([h for e in run for h in e.block_hashes], first.parent_block_hash,
                       [t for e in run for t in e.token_ids], first.block_size, first.lora_id, first.medium,
                       first.lora_name, first.extra_keys, group_idx=first.group_idx)


def delta_relay(worker_id: str, dp_rank: int, seq: int, delta: BlockDelta, block_size: int | None,
                first_seq: int | None = None) -> KvRelay:
    """The ``KvRelay(kind="blocks")`` that carries ``delta``: engine batches ``first_seq``..``seq`` of
    rank ``dp_rank`` (``first_seq`` None: batch ``seq`` alone)."""
    return KvRelay(worker_id=worker_id, kind="blocks", dp_rank=dp_rank, seq=seq,
                   first_seq=None if first_seq == seq else first_seq, reset=delta.reset,
                   stored=_packed(delta.stored), removed=_packed(delta.removed), block_size=block_size)


#: Index hashes per ``state`` relay part: 256 kB packed, well under nats-server's 1 MB message limit.
STATE_PART_HASHES = 32_768


def state_relays(worker_id: str, dp_rank: int, seq: int, translator: BlockTranslator, block_size: int | None,
                 part_hashes: int = STATE_PART_HASHES) -> list[KvRelay]:
    """``KvRelay(kind="state")`` parts carrying every index hash the rank holds after engine batch
    ``seq``: the first replaces what the index holds (``reset``), the others add to it."""
    parts: list[dict[int, bytes]] = []
    for size, held in translator.held().items():
        hashes = list(held)
        for start in range(0, len(hashes), part_hashes):
            parts.append({size: pack_hashes(hashes[start:start + part_hashes])})
    return [KvRelay(worker_id=worker_id, kind="state", dp_rank=dp_rank, seq=seq, reset=i == 0, stored=part,
                    block_size=block_size)
            for i, part in enumerate(parts or [{}])]


def _packed(by_size: dict[int, set[int]]) -> dict[int, bytes]:
    return {size: pack_hashes(hashes) for size, hashes in by_size.items() if hashes}


def _moved(source: dict[int, set[int]], target: dict[int, set[int]], size: int, index_hash: int) -> None:
    """``index_hash`` ends in ``target`` (stored or removed), no longer in ``source``."""
    was = source.get(size)
    if was is not None:
        was.discard(index_hash)
    now = target.get(size)
    if now is None:
        now = target[size] = set()
    now.add(index_hash)
