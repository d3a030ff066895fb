"""Chained block hashes of a token sequence: the key of the KV prefix index (pure, no I/O).

Full blocks only. Block ``i``'s hash covers its parent's hash and its own tokens, so equal hashes
mean equal prefixes. The indexer computes these from the ``token_ids`` in engine events; the router
computes the same from a request's tokens at each worker's block size. Engine hashes (which differ
between engines) are never used as index keys.
"""

from __future__ import annotations

from array import array
from hashlib import blake2b

#: The parent of a sequence's first block.
ROOT = 0


def block_hashes(token_ids: list[int], block_size: int, parent: int = ROOT) -> list[int]:
    """Hashes of every full block of ``token_ids`` (a trailing partial block has none)."""
    if block_size <= 0:
        raise ValueError(f"block size must be positive, got {block_size}")
    out: list[int] = []
    full = len(token_ids) - len(token_ids) % block_size
    for start in range(0, full, block_size):
        parent = chain(parent, token_ids[start:start + block_size])
        out.append(parent)
    return out


def chain(parent: int, block_tokens: list[int]) -> int:
    """The hash of one block given its parent's hash: 64 bits of BLAKE2b (stable across processes)."""
    h = blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(array("I", block_tokens).tobytes())
    return int.from_bytes(h.digest(), "little")
