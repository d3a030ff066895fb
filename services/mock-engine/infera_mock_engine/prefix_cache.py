"""Paged KV cache with prefix reuse and LRU eviction (pure: no I/O, no clock).

A fixed pool of `num_blocks` blocks of `block_size` tokens. A sequence holds a list of blocks;
its FULL, computed blocks are cached under a chained key (the previous block's key + the block's
tokens), so a later sequence whose prompt starts with the same chain of blocks reuses them instead
of recomputing (at least one prompt token is always recomputed, as in vLLM and SGLang: the last
position's logits are needed).

Reference counts: a block is referenced by every sequence holding it and is never evicted while
referenced. When a sequence ends its cached blocks stay in the cache, unreferenced and evictable;
blocks that hold nothing reusable (partial, uncached) are simply free.

Eviction order is the logical LRU order of the free queue (an ordered dict, no clock): a freed
sequence's blocks are appended tail-first, so the tail of a cached chain is evicted before its head;
a reused block leaves the queue and comes back at the MRU end when released again. Free blocks
holding nothing are always taken before any cached block is evicted.

Usage (`used_blocks`, `usage`) counts referenced blocks only; cached-but-unreferenced blocks count
as free — as vLLM (`1 - free/total`, its free queue holds evictable cached blocks) and SGLang
(`total - (available + evictable)`) report KV usage. `cached_blocks`/`evictable_blocks` say how
much of the free space still holds a cached prefix.

Every change of the cached set is recorded as an event (`kv_events.py`) for `take_events`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from infera_mock_engine.block_hasher import BlockHasher
from infera_mock_engine.kv_blocks import blocks_for
from infera_mock_engine.kv_events import Adapter, AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


@dataclass
class _Held:
    """One sequence's blocks, in order; `keys[i]` is the chain key of block i for the cached prefix;
    `lora` the adapter that computes them, `salt` its request's cache salt, and `root` the key its
    chain starts from (None: the base model's, unsalted)."""

    blocks: list[int]
    keys: list[bytes] = field(default_factory=list)
    lora: Adapter | None = None
    salt: str | None = None
    root: bytes | None = None


class PrefixCache:
    def __init__(self, num_blocks: int, block_size: int, hasher: BlockHasher | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hasher = hasher or BlockHasher()
        self._ref = [0] * num_blocks
        self._key: list[bytes | None] = [None] * num_blocks
        self._ext = [0] * num_blocks
        self._by_key: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self._held: dict[Hashable, _Held] = {}
        self._events: list[KvEvent] = []

    # ---- accounting ----------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.block_size

    @property
    def used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - len(self._free)

    @property
    def free_blocks(self) -> int:
        """Blocks not referenced: empty ones plus evictable cached ones."""
        return len(self._free)

    @property
    def cached_blocks(self) -> int:
        """Blocks holding a cached prefix block (referenced or not)."""
        return len(self._by_key)

    @property
    def evictable_blocks(self) -> int:
        return sum(1 for b in self._by_key.values() if self._ref[b] == 0)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced, 0..1."""
        return self.used_blocks / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def held(self, seq_id: Hashable) -> int:
        h = self._held.get(seq_id)
        return len(h.blocks) if h else 0

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.block_size)

    def fits_at_all(self, tokens: int) -> bool:
        """Whether a sequence of `tokens` tokens could ever be held (with the cache otherwise empty)."""
        return self.blocks_for(tokens) <= self.num_blocks

    def cached_hashes(self) -> set[int]:
        """The engine hashes of every cached block (what the published events add up to)."""
        return {self._ext[b] for b in self._by_key.values()}

    def verify(self) -> None:
        """Check the invariants (for tests): raises AssertionError naming the broken one."""
        refs = [0] * self.num_blocks
        for held in self._held.values():
            for b in held.blocks:
                refs[b] += 1
        assert refs == self._ref, "reference counts do not match the sequences' blocks"
        assert all(r >= 0 for r in self._ref), "negative reference count"
        assert all((self._ref[b] == 0) == (b in self._free) for b in range(self.num_blocks)), \
            "the free queue is not exactly the unreferenced blocks"
        assert self.used_blocks + self.free_blocks == self.num_blocks, "used + free != capacity"
        assert all(self._key[b] == k for k, b in self._by_key.items()), "cache map out of sync"
        assert sum(k is not None for k in self._key) == len(self._by_key), "stray block keys"

    def take_events(self) -> list[KvEvent]:
        """The events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    # ---- lookups -------------------------------------------------------------
    def _root(self, lora: Adapter | None, salt: str | None = None) -> bytes | None:
        return self.hasher.root(None if lora is None else lora.cache_key or lora.name, salt)

    def _prefix_hits(self, token_ids: Sequence[int], root: bytes | None = None) -> tuple[list[int], list[bytes]]:
        bs = self.block_size
        blocks: list[int] = []
        keys: list[bytes] = []
        parent = root
        for i in range(max(0, len(token_ids) - 1) // bs):  # the last token is always recomputed
            key = self.hasher.digest(parent, token_ids[i * bs:(i + 1) * bs])
            block = self._by_key.get(key)
            if block is None:
                break
            blocks.append(block)
            keys.append(key)
            parent = key
        return blocks, keys

    def match(self, token_ids: Sequence[int], lora: Adapter | None = None, salt: str | None = None) -> int:
        """Prompt tokens a new sequence with these tokens (computed by ``lora``, under ``salt``) would
        reuse now (no change to the cache)."""
        return len(self._prefix_hits(token_ids, self._root(lora, salt))[0]) * self.block_size

    # ---- sequences -----------------------------------------------------------
    def admit(self, seq_id: Hashable, token_ids: Sequence[int], tokens: int, lora: Adapter | None = None,
              salt: str | None = None) -> int | None:
        """Give a new sequence blocks for `tokens` tokens, reusing the cached prefix of `token_ids`
        (one the same LoRA adapter, or the base model, computed: `lora`, under the same cache salt).

        Returns the number of reused (cached) tokens, or None — and no change — if there are not
        enough free blocks."""
        if seq_id in self._held:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        root = self._root(lora, salt)
        hits, keys = self._prefix_hits(token_ids, root)
        need = max(0, self.blocks_for(tokens) - len(hits))
        if need > len(self._free) - sum(1 for b in hits if self._ref[b] == 0):
            return None
        for b in hits:
            self._reference(b)
        self._held[seq_id] = _Held(hits + [self._take_free() for _ in range(need)], keys, lora, salt, root)
        return len(hits) * self.block_size

    def grow(self, seq_id: Hashable, tokens: int) -> bool:
        """Extend a sequence's blocks to cover `tokens` tokens. False (and no change) if blocks run out."""
        held = self._held[seq_id]
        need = self.blocks_for(tokens) - len(held.blocks)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        held.blocks.extend(self._take_free() for _ in range(need))
        return True

    def commit(self, seq_id: Hashable, token_ids: Sequence[int], computed: int) -> None:
        """Cache the sequence's full blocks among its first `computed` tokens of `token_ids`.

        A block whose chain is already cached (another sequence computed the same prefix at the same
        time) is shared instead: the sequence moves to the cached block and its copy is freed."""
        held = self._held.get(seq_id)
        if held is None:
            return
        bs = self.block_size
        full = min(computed, len(token_ids)) // bs
        full = min(full, len(held.blocks))
        if full <= len(held.keys):
            return
        run: list[int] = []  # consecutive newly cached blocks -> one BlockStored
        run_start = len(held.keys)
        parent = held.keys[-1] if held.keys else held.root
        for i in range(len(held.keys), full):
            key = self.hasher.digest(parent, token_ids[i * bs:(i + 1) * bs])
            mine = held.blocks[i]
            cached = self._by_key.get(key)
            if cached is not None and cached != mine:
                self._flush_run(held, run, run_start, token_ids)
                run, run_start = [], i + 1
                self._reference(cached)
                self._unreference(mine)
                held.blocks[i] = cached
            elif cached is None:
                self._key[mine] = key
                self._ext[mine] = self.hasher.external(key)
                self._by_key[key] = mine
                run.append(mine)
            held.keys.append(key)
            parent = key
        self._flush_run(held, run, run_start, token_ids)

    def release(self, seq_id: Hashable) -> int:
        """The sequence ends: drop its references (cached blocks stay, evictable). Returns its block count."""
        held = self._held.pop(seq_id, None)
        if held is None:
            return 0
        for b in reversed(held.blocks):  # tail first into the queue: the tail is evicted first
            self._unreference(b)
        return len(held.blocks)

    def clear(self) -> bool:
        """Drop every cached block (AllBlocksCleared). Refused (False) while any block is referenced."""
        if self.used_blocks:
            return False
        for b in self._by_key.values():
            self._key[b] = None
        self._by_key.clear()
        self._free = OrderedDict.fromkeys(range(self.num_blocks))
        self._events.append(AllBlocksCleared())
        return True

    # ---- internals -----------------------------------------------------------
    def _flush_run(self, held: _Held, run: list[int], start: int, token_ids: Sequence[int]) -> None:
        if not run:
            return
        bs = self.block_size
        parent = self._ext_of_key(held.keys[start - 1]) if start > 0 else None
        self._events.append(BlockStored(
            block_hashes=[self._ext[b] for b in run],
            parent_block_hash=parent,
            token_ids=list(token_ids[start * bs:(start + len(run)) * bs]),
            block_size=bs,
            lora=held.lora,
            cache_salt=held.salt,
        ))

    def _ext_of_key(self, key: bytes) -> int:
        return self.hasher.external(key)

    def _reference(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._free[block]
        self._ref[block] += 1

    def _unreference(self, block: int) -> None:
        if self._ref[block] <= 0:
            raise AssertionError(f"block {block} released more often than referenced")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._free[block] = None
            if self._key[block] is None:  # holds nothing reusable: reuse it first
                self._free.move_to_end(block, last=False)

    def _take_free(self) -> int:
        """The LRU free block; a cached one is evicted (BlockRemoved)."""
        block, _ = self._free.popitem(last=False)
        key = self._key[block]
        if key is not None:
            del self._by_key[key]
            self._key[block] = None
            self._events.append(BlockRemoved([self._ext[block]]))
        self._ref[block] = 1
        return block
