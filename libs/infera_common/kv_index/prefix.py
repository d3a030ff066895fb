"""One model's prefix index: chained block hash -> the targets holding that block (pure, no I/O).

A target is one ``(worker_id, dp_rank)``. Each target of the model gets a bit; per block size the
index maps a block hash to the bitmask of the targets holding it. An overlap query walks the
request's hashes in order, AND-ing the candidate mask with each block's mask and stopping as soon
as no candidate is left: a prefix match, one dict lookup and one integer AND per block, both done
in C (Python work is per distinct depth in the answer, not per block).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Mapping
from itertools import accumulate, islice, repeat, takewhile
from operator import and_, neg

Target = tuple[str, int]  # (worker_id, dp_rank)


class PrefixIndex:
    def __init__(self) -> None:
        self._masks: dict[int, dict[int, int]] = {}  # block size -> block hash -> target bitmask
        self._bits: dict[Target, int] = {}  # target -> its bit (a power of two)
        self._slots: list[Target | None] = []  # bit position -> target (None: free)
        self._order: list[Target] | None = None  # the targets, sorted (rebuilt after a change)
        self._free: list[int] = []  # bit positions given back by removed targets

    # --- targets ----------------------------------------------------------------------------
    def add_target(self, target: Target) -> int:
        bit = self._bits.get(target)
        if bit is None:
            position = self._free.pop() if self._free else self._take()
            bit = 1 << position
            self._bits[target] = bit
            self._slots[position] = target
            self._order = None
        return bit

    def _take(self) -> int:
        self._slots.append(None)
        return len(self._slots) - 1

    def remove_target(self, target: Target, held: Mapping[int, Iterable[int]]) -> None:
        """Forget ``target``; ``held`` maps block size -> the hashes it holds (all are cleared)."""
        bit = self._bits.pop(target, None)
        if bit is None:
            return
        for size, hashes in held.items():
            self.remove_all(size, hashes, bit)
        position = bit.bit_length() - 1
        self._slots[position] = None
        self._free.append(position)
        self._order = None

    def bit(self, target: Target) -> int | None:
        return self._bits.get(target)

    @property
    def targets(self) -> list[Target]:
        return list(self._bits)

    def ordered(self, depths: dict[Target, int]) -> list[tuple[str, int, int]]:
        """``overlap``'s answer as ``[(worker_id, dp_rank, depth)]`` sorted by target."""
        if len(depths) * 4 < len(self._bits):  # a few targets: sort them
            return [(t[0], t[1], depths[t]) for t in sorted(depths)]
        order = self._order
        if order is None:
            order = self._order = sorted(self._bits)
        return [(t[0], t[1], depths[t]) for t in order if t in depths]

    # --- blocks -----------------------------------------------------------------------------
    def add(self, block_size: int, block_hash: int, bit: int) -> None:
        masks = self._masks.get(block_size)
        if masks is None:
            masks = self._masks[block_size] = {}
        masks[block_hash] = masks.get(block_hash, 0) | bit

    def add_all(self, block_size: int, block_hashes: Iterable[int], bit: int) -> None:
        masks = self._masks.get(block_size)
        if masks is None:
            masks = self._masks[block_size] = {}
        get = masks.get
        for block_hash in block_hashes:
            masks[block_hash] = get(block_hash, 0) | bit

    def remove_all(self, block_size: int, block_hashes: Iterable[int], bit: int) -> None:
        masks = self._masks.get(block_size)
        if masks is None:
            return
        get, keep = masks.get, ~bit
        for block_hash in block_hashes:
            mask = get(block_hash, 0) & keep
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

        The walk runs in C: ``accumulate`` ANDs the blocks' masks into the running set of targets
        holding the whole prefix so far, stopping at the first empty one. That sequence only loses
        bits, so it is non-increasing (a bisection finds where each value's run ends) and the
        targets that leave after a run have that run's end as their depth. Python work is per
        distinct depth, not per block.
        """
        allowed = -1 if workers is None else self._mask_of(workers)
        depths: dict[Target, int] = {}
        one_size = len(hashes) == 1  # then a target leaves once: no max over block sizes
        for size, chain in hashes.items():
            masks = self._masks.get(size)
            if not masks or not chain:
                continue
            first = masks.get(chain[0], 0) & allowed
            if not first:
                continue
            rest = map(masks.get, islice(chain, 1, None), repeat(0))
            held = list(takewhile(bool, accumulate(rest, and_, initial=first)))
            end = len(held)  # held[i]: the targets holding blocks 0..i
            pos = 0
            while pos < end:
                mask = held[pos]
                pos = bisect_right(held, -mask, pos, end, key=neg)  # the end of its run
                leaving = self._targets_of(mask & ~held[pos] if pos < end else mask)
                if one_size:
                    depths.update(zip(leaving, repeat(pos)))
                else:
                    for target in leaving:
                        if pos > depths.get(target, 0):
                            depths[target] = pos
        return depths

    def _targets_of(self, mask: int) -> list[Target]:
        """The targets of the bits in ``mask``, read a byte of the mask at a time."""
        slots = self._slots
        if not mask & (mask - 1):
            return [slots[mask.bit_length() - 1]]  # type: ignore[list-item]
        positions: list[int] = []
        for i, byte in enumerate(mask.to_bytes((mask.bit_length() + 7) >> 3, "little")):
            if byte:
                key = i << 8 | byte
                found = _POSITIONS.get(key)
                if found is None:
                    found = _POSITIONS[key] = tuple(i * 8 + b for b in range(8) if byte >> b & 1)
                positions += found
        return list(map(slots.__getitem__, positions))  # type: ignore[arg-type]

    def _mask_of(self, workers: set[str]) -> int:
        mask = 0
        for (worker_id, _rank), bit in self._bits.items():
            if worker_id in workers:
                mask |= bit
        return mask


#: (byte index << 8 | byte value) -> the bit positions that byte of a mask sets, filled as met
_POSITIONS: dict[int, tuple[int, ...]] = {}
