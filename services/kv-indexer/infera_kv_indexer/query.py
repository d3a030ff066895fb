"""Overlap queries from bytes to bytes (pure, no I/O): the query handler's whole work.

``answer`` decodes an ``OverlapQuery``, walks the index and encodes the ``OverlapReply``, with no
pydantic model on the way: the query is read with exact type checks (the hashes checked in C), the
reply packed from plain values into exactly the bytes ``schemas.encode(OverlapReply(...))`` gives.
A query that fails the exact checks goes through ``OverlapQuery``'s own validation, so what is
accepted or rejected (``ValueError``) is the schema's decision.
"""

from __future__ import annotations

from array import array

import msgpack

from infera_common.kv_wire import unpack
from infera_common.schemas import OverlapQuery, OverlapReply, encode

from infera_common.kv_index.index import KvIndex

#: The reply to a malformed query, or when answering failed: nothing known.
EMPTY_REPLY = encode(OverlapReply())


def answer(index: KvIndex, data: bytes) -> bytes:
    """The encoded ``OverlapReply`` to an encoded ``OverlapQuery``; ``ValueError`` when malformed."""
    model, hashes, workers = decode_query(data)
    overlaps, unseen = index.depths(model, hashes, workers)
    return encode_reply(overlaps, unseen)


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


def encode_reply(overlaps: list[tuple[str, int, int]], unseen: list[str]) -> bytes:
    """Exactly ``encode(OverlapReply(...))``'s bytes: a map ``{"overlaps": [{"worker_id", "dp_rank",
    "blocks"}], "unseen": [...]}``, each overlap's map packed once per target and then reused."""
    try:
        body = b"".join([_FRAGMENTS[(w, r)] + _UINTS[b] for w, r, b in overlaps])
    except (KeyError, IndexError):  # a target not met yet, or a depth past the table
        _learn(overlaps)
        return _packb({"overlaps": [{"worker_id": w, "dp_rank": r, "blocks": b} for w, r, b in overlaps],
                       "unseen": unseen}, use_bin_type=True)
    n = len(overlaps)
    head = _FIXARRAY[n] if n < 16 else _packb([None] * n)[:-n]  # the array header only
    return b"".join((_OVERLAPS, head, body, _UNSEEN, _packb(unseen, use_bin_type=True)))


def _learn(overlaps: list[tuple[str, int, int]]) -> None:
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
_OVERLAPS = b"\x82" + _packb("overlaps")
_UNSEEN = _packb("unseen")
