"""Paged KV-cache block accounting (pure, no I/O).

Each sequence holds ceil(tokens / page_size) blocks for the tokens it has in the cache (prompt
plus generated). This module is the seam for a real paged prefix cache: `lookup_prefix` answers
how many prompt tokens are already cached (always 0 for now) and `reserve`/`release` are where
blocks will be hashed, shared, evicted (LRU) and reported as KV events.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def blocks_for(tokens: int, page_size: int) -> int:
    """Blocks needed to hold `tokens` tokens: ceil(tokens / page_size)."""
    if tokens <= 0:
        return 0
    return -(-tokens // page_size)


class KvBlockManager:
    """Counts blocks per sequence against a fixed pool of `num_blocks` blocks of `page_size` tokens."""

    def __init__(self, num_blocks: int, page_size: int) -> None:
        if num_blocks <= 0 or page_size <= 0:
            raise ValueError("num_blocks and page_size must be positive")
        self.num_blocks = num_blocks
        self.page_size = page_size
        self._held: dict[Hashable, int] = {}
        self._used = 0

    @property
    def used_blocks(self) -> int:
        return self._used

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self._used

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self._used / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.page_size

    def held(self, seq_id: Hashable) -> int:
        return self._held.get(seq_id, 0)

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.page_size)

    def fits_at_all(self, tokens: int) -> bool:
        """Whether a sequence of `tokens` tokens could ever be held (with the cache otherwise empty)."""
        return self.blocks_for(tokens) <= self.num_blocks

    def lookup_prefix(self, token_ids: Sequence[int]) -> int:
        """Prompt tokens already in the cache. No prefix cache yet: always 0."""
        return 0

    def can_reserve(self, seq_id: Hashable, tokens: int) -> bool:
        return self.blocks_for(tokens) - self.held(seq_id) <= self.free_blocks

    def reserve(self, seq_id: Hashable, tokens: int) -> bool:
        """Grow `seq_id`'s holding to cover `tokens` tokens. False (and no change) if blocks run out."""
        extra = self.blocks_for(tokens) - self.held(seq_id)
        if extra <= 0:
            return True
        if extra > self.free_blocks:
            return False
        self._held[seq_id] = self.held(seq_id) + extra
        self._used += extra
        return True

    def release(self, seq_id: Hashable) -> int:
        """Free every block `seq_id` holds; returns how many."""
        n = self._held.pop(seq_id, 0)
        self._used -= n
        return n
