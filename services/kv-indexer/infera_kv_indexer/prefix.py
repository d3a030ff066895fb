"""One model's prefix index: chained block hash -> the targets holding that block (pure, no I/O).

A target is one ``(worker_id, dp_rank)``. Each target of the model gets a bit; per block size the
index maps a block hash to the bitmask of the targets holding it. An overlap query walks the
request's hashes in order, AND-ing the candidate mask with each block's mask and stopping as soon
as no candidate is left: a prefix match, one dict lookup and one integer AND per block.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import islice

Target = tuple[str, int]  # (worker_id, dp_rank)


class PrefixIndex:
    def __init__(self) -> None:
        self._masks: dict[int, dict[int, int]] = {}  # block size -> block hash -> target bitmask
        self._bits: dict[Target, int] = {}  # target -> its bit (a power of two)
        self._targets: dict[int, Target] = {}  # bit -> target
        self._free: list[int] = []  # bit positions given back by removed targets
        self._next = 0

    # --- targets ----------------------------------------------------------------------------
    def add_target(self, target: Target) -> int:
        bit = self._bits.get(target)
        if bit is None:
            position = self._free.pop() if self._free else self._take()
            bit = 1 << position
            self._bits[target] = bit
            self._targets[bit] = target
        return bit

    def _take(self) -> int:
        self._next += 1
        return self._next - 1

    def remove_target(self, target: Target, held: Mapping[int, Iterable[int]]) -> None:
        """Forget ``target``; ``held`` maps block size -> the hashes it holds (all are cleared)."""
        bit = self._bits.pop(target, None)
        if bit is None:
            return
        for size, hashes in held.items():
            for h in hashes:
                self.remove(size, h, bit)
        del self._targets[bit]
        self._free.append(bit.bit_length() - 1)

    def bit(self, target: Target) -> int | None:
        return self._bits.get(target)

    @property
    def targets(self) -> list[Target]:
        return list(self._bits)

    # --- blocks -----------------------------------------------------------------------------
    def add(self, block_size: int, block_hash: int, bit: int) -> None:
        masks = self._masks.get(block_size)
        if masks is None:
            masks = self._masks[block_size] = {}
        masks[block_hash] = masks.get(block_hash, 0) | bit

    def remove(self, block_size: int, block_hash: int, bit: int) -> None:
        masks = self._masks.get(block_size)
        if masks is None:
            return
        mask = masks.get(block_hash, 0) & ~bit
        if mask:
            masks[block_hash] = mask
        else:
            masks.pop(block_hash, None)
            if not masks:
                del self._masks[block_size]

    def blocks(self, block_size: int) -> int:
        """Distinct block hashes held by any target at ``block_size``."""
        return len(self._masks.get(block_size, ()))

    # --- queries ----------------------------------------------------------------------------
    def overlap(self, hashes: dict[int, list[int]], workers: set[str] | None = None) -> dict[Target, int]:
        """Matched prefix depth per target (targets with depth 0 are absent).

        For each block size, the depth of a target is the number of leading hashes it holds,
        stopping at the first one it lacks. ``workers`` restricts the answer to those workers.
        """
        allowed = -1 if workers is None else self._mask_of(workers)
        depths: dict[Target, int] = {}
        for size, chain in hashes.items():
            masks = self._masks.get(size)
            if not masks or not chain:
                continue
            active = masks.get(chain[0], 0) & allowed
            if not active:
                continue
            get = masks.get
            depth = 1  # blocks every target in `active` holds
            for block_hash in islice(chain, 1, None):
                held = get(block_hash, 0) & active
                if held != active:
                    self._record(active ^ held, depth, depths)  # those stop here
                    active = held
                    if not active:
                        break
                depth += 1
            if active:
                self._record(active, depth, depths)
        return depths

    def _record(self, mask: int, depth: int, depths: dict[Target, int]) -> None:
        while mask:
            low = mask & -mask
            target = self._targets[low]
            if depth > depths.get(target, 0):
                depths[target] = depth
            mask ^= low

    def _mask_of(self, workers: set[str]) -> int:
        mask = 0
        for (worker_id, _rank), bit in self._bits.items():
            if worker_id in workers:
                mask |= bit
        return mask
