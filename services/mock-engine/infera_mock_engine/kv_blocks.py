"""Block arithmetic shared by the KV cache and request validation (pure)."""

from __future__ import annotations


def blocks_for(tokens: int, page_size: int) -> int:
    """Blocks needed to hold `tokens` tokens: ceil(tokens / page_size)."""
    if tokens <= 0:
        return 0
    return -(-tokens // page_size)
