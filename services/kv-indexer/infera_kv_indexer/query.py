"""Overlap queries from bytes to bytes (pure, no I/O): the query handler's whole work.

``answer`` decodes an ``OverlapQuery``, walks the index and encodes the ``OverlapReply``, with no
pydantic model on the way: the query is read with exact type checks (the hashes checked in C), the
reply packed from plain values into exactly the bytes ``schemas.encode(OverlapReply(...))`` gives.
A query that fails the exact checks goes through ``OverlapQuery``'s own validation, so what is
accepted or rejected (``ValueError``) is the schema's decision.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

import msgpack

from infera_common.kv_wire import unpack
from infera_common.schemas import OverlapQuery, OverlapReply, encode

from infera_common.kv_index.held import HeldCache
from infera_common.kv_index.index import KvIndex

#: The reply to a malformed query, or when answering failed: nothing known.
EMPTY_REPLY = encode(OverlapReply())


def answer(index: KvIndex, data: bytes, holdings: HeldCache[bytes] | None = None) -> bytes:
    """The encoded ``OverlapReply`` to an encoded ``OverlapQuery``; ``ValueError`` when malformed.
    ``holdings``: the ``held`` sections to reuse (``held_sections``); None: listed afresh."""
    return reply_for(index, *decode_query(data), holdings)[0]


def held_sections(index: KvIndex, clock: Callable[[], float]) -> HeldCache[bytes]:
    """The reply's encoded ``held`` sections, each reused for ``kv_index.held.MAX_AGE`` seconds."""
    return HeldCache(index, encode_held, clock)


def reply_for(index: KvIndex, model: str, hashes: dict[int, list[int]], workers: list[str] | None,
              holdings: HeldCache[bytes] | None = None) -> tuple[bytes, list[tuple[str, int, int]], list[str]]:
    """The encoded reply to a decoded query, with the depths and unseen workers it carries."""
    overlaps, unseen = index.depths(model, hashes, workers)
    held = holdings.get(model, workers) if holdings is not None else encode_held(index.held(model, workers))
    return encode_reply(overlaps, unseen, held), overlaps, unseen


def decode_query(data: bytes) -> tuple[str, dict[int, list[int]], list[str] | None]:
    raw = unpack(data, "query")
    if type(raw) is dict:
        model, hashes, workers = raw.get("model"), raw.get("hashes"), raw.get("workers")
        if type(model) is str and type(hashes) is dict and _exact_hashes(hashes) and (
                workers is None or (type(workers) is list and all(type(w) is str for w in workers))):
            return model, hashes, workers
    query = OverlapQuery.model_validate(raw)
    return query.model, query.hashes, query.workers


def _exact_hashes(hashes: dict) -> bool:
    for size, chain in hashes.items():
        if type(size) is not int or type(chain) is not list:
            return False
        try:
            array("Q", chain)  # every hash an integer in 0..2**64-1, checked in C
        except (TypeError, OverflowError):
            return False
    return True


def encode_reply(overlaps: Sequence[tuple[str, int, int]], unseen: list[str], held: bytes) -> bytes:
    """Exactly ``encode(OverlapReply(...))``'s bytes: a map ``{"overlaps": [{"worker_id", "dp_rank",
    "blocks"}], "unseen": [...], "held": [...]}``, each target's map packed once and then reused;
    ``held`` is the last entry, already encoded (``encode_held``)."""
    return b"".join((_OVERLAPS, _entries(overlaps, _UINTS.__getitem__), _UNSEEN,
                     _packb(unseen, use_bin_type=True), held))


def encode_held(held: Sequence[tuple[str, int, int]]) -> bytes:
    """The reply's last entry, ``"held": [{"worker_id", "dp_rank", "blocks"}]``, encoded."""
    return _HELD + _entries(held, _packb)


def _entries(entries: Sequence[tuple[str, int, int]], pack_blocks: Callable[[int], bytes]) -> bytes:
    """A packed array of ``{"worker_id", "dp_rank", "blocks"}`` maps."""
    try:
        body = b"".join([_FRAGMENTS[(w, r)] + pack_blocks(b) for w, r, b in entries])
    except (KeyError, IndexError):  # a target not met yet, or a depth past the table
        _learn(entries)
        return _packb([{"worker_id": w, "dp_rank": r, "blocks": b} for w, r, b in entries], use_bin_type=True)
    n = len(entries)
    return (_FIXARRAY[n] if n < 16 else _packb([None] * n)[:-n]) + body  # the array header, then the maps


def _learn(overlaps: Sequence[tuple[str, int, int]]) -> None:
    if len(_FRAGMENTS) > _FRAGMENTS_MAX:
        _FRAGMENTS.clear()
    for w, r, _ in overlaps:
        if (w, r) not in _FRAGMENTS:  # the map with "blocks": 0, minus that 0 (one byte)
            _FRAGMENTS[(w, r)] = _packb({"worker_id": w, "dp_rank": r, "blocks": 0}, use_bin_type=True)[:-1]


_packb = msgpack.packb
#: (worker_id, dp_rank) -> the packed WorkerOverlap map up to its "blocks" value
_FRAGMENTS: dict[tuple[str, int], bytes] = {}
_FRAGMENTS_MAX = 65536
#: packed depths 0..8191 (a 512k-token prompt at block size 64); deeper ones take the slow path
_UINTS = [_packb(i) for i in range(8192)]
_FIXARRAY = [bytes([0x90 | n]) for n in range(16)]
_OVERLAPS = b"\x83" + _packb("overlaps")
_UNSEEN = _packb("unseen")
_HELD = _packb("held")
