"""Chained block hashes of a token sequence: the key of the KV prefix index (pure, no I/O).

Full blocks only. Block ``i``'s hash is XXH3-64 of its token ids (each a little-endian unsigned
32-bit integer) seeded with its parent's hash (``ROOT`` for a sequence's first block), so equal
hashes mean equal prefixes. The KV-event translation (``kv_translate``) computes these from the
``token_ids`` in engine events; the router computes the same from a request's tokens at each
worker's block size. Engine hashes
(which differ between engines) are never used as index keys. The hash is Infera's own: stable
across processes, hosts and Python versions, never compared with an engine's.

``block_hashes`` is the one implementation: it converts the tokens to a C array once (a token id
outside ``0..2**32-1``, or not an integer, raises ``OverflowError``/``TypeError``) and hashes each
block's bytes in C, so hashing costs about as much as reading the tokens.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence

from xxhash import xxh3_64_intdigest

#: The parent of a sequence's first block (computed by the base model).
ROOT = 0

_TOKEN = "I" if array("I").itemsize == 4 else "L"  # a C unsigned 32-bit integer
assert array(_TOKEN).itemsize == 4, "no 32-bit unsigned array type on this platform"
assert array("Q").itemsize == 8, "no 64-bit unsigned array type on this platform"
_SWAP = sys.byteorder != "little"


def token_array(token_ids: Sequence[int]) -> array:
    """``token_ids`` as a C array of unsigned 32-bit integers, converted in one C pass.

    Raises ``TypeError`` for an element that is not an integer, ``OverflowError`` for one outside
    ``0..2**32-1``. An array of this type is returned as it is.
    """
    if isinstance(token_ids, array) and token_ids.typecode == _TOKEN:
        return token_ids
    return array(_TOKEN, token_ids)


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as bytes: each a little-endian unsigned 32-bit integer (``unpack_tokens`` reverses)."""
    return _pack(_TOKEN, token_ids)


def unpack_tokens(data: bytes) -> array:
    """The token ids ``pack_tokens`` wrote; ``ValueError`` if ``data`` is not whole 4-byte words."""
    return _unpack(_TOKEN, data, "token ids")


def pack_hashes(hashes: Iterable[int]) -> bytes:
    """Block hashes as bytes: each a little-endian unsigned 64-bit integer (``unpack_hashes`` reverses)."""
    return _pack("Q", hashes)


def unpack_hashes(data: bytes) -> array:
    """The block hashes ``pack_hashes`` wrote; ``ValueError`` if ``data`` is not whole 8-byte words."""
    return _unpack("Q", data, "block hashes")


def _pack(typecode: str, values: Iterable[int]) -> bytes:
    if isinstance(values, array) and values.typecode == typecode and not _SWAP:
        return values.tobytes()  # already the packed layout (e.g. ``token_array``'s): one copy, no conversion
    words = array(typecode, values)
    if _SWAP:  # pragma: no cover - big-endian hosts
        words.byteswap()
    return words.tobytes()


def _unpack(typecode: str, data: bytes, what: str) -> array:
    words = array(typecode)
    if len(data) % words.itemsize:
        raise ValueError(f"packed {what} must be whole {words.itemsize}-byte words, got {len(data)} bytes")
    words.frombytes(data)
    if _SWAP:  # pragma: no cover - big-endian hosts
        words.byteswap()
    return words


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """Hashes of every full block of ``token_ids`` (a trailing partial block has none)."""
    if block_size <= 0:
        raise ValueError(f"block size must be positive, got {block_size}")
    n = len(token_ids) // block_size
    if not n:
        return []
    full = n * block_size
    if isinstance(token_ids, array) and token_ids.typecode == _TOKEN and not _SWAP:
        data = memoryview(token_ids)[:full].cast("B")  # already the hashed layout: no copy
    else:
        words = array(_TOKEN, token_ids if full == len(token_ids) else token_ids[:full])
        if _SWAP:  # pragma: no cover - big-endian hosts
            words.byteswap()
        data = words.tobytes()
    step = block_size * 4
    out = [0] * n
    start = 0
    for i in range(n):
        end = start + step
        parent = out[i] = xxh3_64_intdigest(data[start:end], parent)
        start = end
    return out


def adapter_root(adapter: str | None) -> int:
    """The parent of a sequence's first block when a LoRA adapter computed it (``ROOT`` for None: the
    base model). An adapter's KV differs from the base model's for the same tokens (vLLM hashes the
    adapter into every block), so its chains start from a root of their own and never match the
    base model's, nor another adapter's; the name alone identifies it, as a request names it."""
    if adapter is None:
        return ROOT
    return xxh3_64_intdigest(b"infera-lora\x00" + adapter.encode("utf-8", "surrogatepass"))


def salted_root(root: int, salt: str | None) -> int:
    """The root of a chain computed under a cache salt (vLLM's and SGLang's ``cache_salt`` request
    field: a tenant's prefix cache, which requests without the same salt never reuse), from the
    root it would have had unsalted (``ROOT`` or an adapter's)."""
    if salt is None:
        return root
    return xxh3_64_intdigest(b"infera-salt\x00" + salt.encode("utf-8", "surrogatepass"), root)


def opaque(parent: int) -> int:
    """The parent of a block whose KV depends on more than its tokens, its adapter and its salt (an
    image, prompt embeddings: vLLM's extra keys), and of every block after it: a chain no request's
    tokens give, so the index never claims those blocks for one."""
    return xxh3_64_intdigest(b"infera-opaque", parent)


def chain(parent: int, block_tokens: Sequence[int]) -> int:
    """The hash of one block given its parent's hash (``block_hashes`` of one full block)."""
    return block_hashes(block_tokens, len(block_tokens), parent)[0]
