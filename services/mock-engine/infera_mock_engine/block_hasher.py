"""The engine's own block hashes: chained, keyed by a per-process seed (pure apart from `random_seed`).

Like vLLM (whose chain starts from a random NONE_HASH unless PYTHONHASHSEED is set), the values
differ between engine processes, so a consumer cannot rely on them: Infera recomputes its own
hashes from the `token_ids` the events carry. vLLM reports unsigned 64-bit hashes, SGLang signed.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence


def random_seed(text: str | None = None) -> bytes:
    """A 32-byte chain seed: derived from `text` (vLLM uses PYTHONHASHSEED this way), else random."""
    if text is None:
        return os.urandom(32)
    return hashlib.sha256(text.encode()).digest()


class BlockHasher:
    """`digest` is the cache's chain key (16 bytes); `external` the 64-bit value put in events."""

    def __init__(self, seed: bytes = b"", signed: bool = False) -> None:
        self.seed = seed[:64]  # BLAKE2b key limit
        self.signed = signed
        self._keyed = hashlib.blake2b(digest_size=16, key=self.seed)  # copied per block: keyed once
        self._packers: dict[int, struct.Struct] = {}

    def digest(self, parent: bytes | None, tokens: Sequence[int]) -> bytes:
        """BLAKE2b-128 (keyed by the seed) of the parent key then the tokens as native int64s."""
        h = self._keyed.copy()
        if parent:
            h.update(parent)
        h.update(self._packer(len(tokens)).pack(*tokens))
        return h.digest()

    def root(self, adapter: str | None, salt: str | None = None) -> bytes | None:
        """The key the chains a LoRA adapter computes, or a request's cache salt, start from (None:
        the base model's, unsalted): their blocks never share a key with the same tokens computed
        otherwise."""
        if adapter is None and salt is None:
            return None
        h = self._keyed.copy()
        if adapter is not None:
            h.update(b"lora\x00" + adapter.encode() + b"\x00")
        if salt is not None:
            h.update(b"salt\x00" + salt.encode())
        return h.digest()

    def _packer(self, n: int) -> struct.Struct:
        """n native int64s (the bytes of array("q", tokens), packed 3x faster)."""
        packer = self._packers.get(n)
        if packer is None:
            packer = self._packers[n] = struct.Struct(f"={n}q")
        return packer

    def external(self, digest: bytes) -> int:
        return int.from_bytes(digest[:8], "big", signed=self.signed)
