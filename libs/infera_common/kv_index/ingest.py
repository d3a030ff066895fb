"""One message of the KV event stream (or one batch read from ZMQ), decoded and applied to the index
(pure, no I/O).

A message is a msgpack ``KvRelay`` on ``kv_event_subject(worker_id)``: ``kind="blocks"`` (the
worker-agent's translation of one engine batch: index hashes stored and removed, applied as set
updates), ``"batch"`` (a raw engine batch, translated here), ``"cleared"``, or ``"state"`` (part of
everything a rank holds, sent when an index asked: ``KvResync``). Anything unreadable is
reported as ``malformed`` (``relay``: the envelope, torn packed hashes, or a subject that is not its
worker's; ``batch``: the engine batch inside) and changes nothing; bad events inside a readable
batch are counted in the outcome and the rest of the batch is applied.

This is the ingest hot path, so the envelope is read without pydantic when every field already has
its exact type (what the worker-agent sends); anything else goes through ``KvRelay``'s own
validation, which accepts and rejects exactly what it always did.
"""

from __future__ import annotations

from array import array
from collections.abc import Generator
from dataclasses import dataclass
from typing import Literal

from infera_common.block_hash import unpack_hashes
from infera_common.kv_wire import KvWireError, decode_batch, read_batch, unpack
from infera_common.schemas import KvRelay
from infera_common.subjects import kv_event_subject

from infera_common.kv_index.index import KvIndex, Outcome

#: Worker ids whose subject was already checked (bounded: cleared when it grows past this).
_SUBJECT_CACHE_MAX = 4096
_subjects: dict[str, str] = {}


@dataclass(slots=True)
class Relay:
    """A decoded ``KvRelay`` (the same fields), without pydantic's per-instance cost."""

    worker_id: str
    kind: str
    dp_rank: int | None
    seq: int
    payload: bytes
    block_size: int | None
    ts: float
    reset: bool = False
    stored: dict[int, array] | None = None  # kind "blocks": block size -> index hashes, unpacked
    removed: dict[int, array] | None = None
    first_seq: int | None = None  # kind "blocks": the first engine batch it carries (None: seq alone)


@dataclass(slots=True)
class Ingested:
    relay: Relay | None = None
    outcome: Outcome | None = None  # kind "batch" applied (or skipped as a duplicate)
    malformed: Literal["relay", "batch"] | None = None
    error: str = ""


def ingest(index: KvIndex, subject: str, data: bytes, now: float) -> Ingested:
    try:
        relay = decode_relay(data, now)
        if _subject(relay.worker_id) != subject:
            raise ValueError(f"relay of worker {relay.worker_id!r} arrived on {subject!r}")
    except ValueError as exc:
        return Ingested(malformed="relay", error=str(exc)[:300])
    kind = relay.kind
    if kind == "blocks":
        return Ingested(relay, index.apply_blocks(relay.worker_id, relay.dp_rank or 0, relay.seq, relay.reset,
                                                  relay.stored or {}, relay.removed or {}, now, relay.first_seq))
    if kind == "cleared":
        index.clear(relay.worker_id, relay.dp_rank, now)
        return Ingested(relay)
    if kind == "state":
        return Ingested(relay, index.apply_state(relay.worker_id, relay.dp_rank or 0, relay.seq, relay.reset,
                                                 relay.stored or {}, now))
    return _apply(index, relay, now)


def ingest_batch(index: KvIndex, worker_id: str, dp_rank: int, seq: int, payload: bytes,
                 now: float) -> Generator[None, None, Ingested]:
    """One batch read straight from the worker's ZMQ publisher of rank ``dp_rank``
    (``--kv-event-transport zmq``), decoded and applied as a relayed one, but in slices: the
    generator yields between them (``BlockTranslator.apply_in_slices``) and returns the result."""
    relay = Relay(worker_id, "batch", dp_rank, seq, payload, None, now)
    try:
        batch = read_batch(payload)
    except KvWireError as exc:
        return Ingested(relay, malformed="batch", error=str(exc)[:300])
    raw = index.open_batch(worker_id, batch.dp_rank if batch.dp_rank is not None else dp_rank, seq, now)
    unreadable: list[str] = []
    if raw.translator is not None:
        yield from raw.translator.apply_in_slices(batch.decoded(unreadable), raw.delta)
    return Ingested(relay, index.close_batch(raw, len(unreadable)))


def _apply(index: KvIndex, relay: Relay, now: float) -> Ingested:
    try:
        batch = decode_batch(relay.payload)
    except KvWireError as exc:
        return Ingested(relay, malformed="batch", error=str(exc)[:300])
    return Ingested(relay, index.apply_batch(relay.worker_id, relay.dp_rank, relay.seq, batch, now))


def decode_relay(data: bytes, now: float) -> Relay:
    """A ``KvRelay`` from its bytes, packed hashes unpacked (one without ``ts`` relayed at ``now``, wall
    clock); raises ``ValueError`` when malformed (as ``schemas.decode``, or packed hashes torn)."""
    raw = unpack(data, "relay")
    if type(raw) is dict:
        get = raw.get
        worker_id, kind, rank, seq = get("worker_id"), get("kind", "batch"), get("dp_rank"), get("seq", -1)
        payload, size, ts = get("payload", b""), get("block_size"), get("ts")
        reset, stored, removed, first = get("reset", False), get("stored"), get("removed"), get("first_seq")
        if ts is None and "ts" not in raw:
            ts = raw["ts"] = now  # (the lenient path below reads it too)
        if (type(worker_id) is str and kind in _KINDS and type(kind) is str
                and (rank is None or type(rank) is int) and type(seq) is int and type(payload) is bytes
                and (size is None or type(size) is int) and (type(ts) is float or type(ts) is int)
                and type(reset) is bool and (first is None or (type(first) is int and first <= seq))):
            stored, removed = _unpacked(stored), _unpacked(removed)
            if stored is not None and removed is not None:
                return Relay(worker_id, kind, rank, seq, payload, size, float(ts), reset, stored, removed, first)
    full = KvRelay.model_validate(raw)  # lenient coercions and the errors, exactly as the schema says
    return Relay(full.worker_id, full.kind, full.dp_rank, full.seq, full.payload, full.block_size, full.ts,
                 full.reset, _unpacked(full.stored), _unpacked(full.removed), full.first_seq)


_KINDS = ("blocks", "batch", "cleared", "state")


def _unpacked(packed: object) -> dict[int, array] | None:
    """Block size -> packed hashes (absent: none), unpacked; ``None`` unless exactly what ``KvRelay``
    accepts unchanged (a dict of int to bytes). ``ValueError`` when torn."""
    out: dict[int, array] = {}
    if packed is None:
        return out
    if type(packed) is not dict:
        return None
    for size, data in packed.items():
        if type(size) is not int or type(data) is not bytes:
            return None
        out[size] = unpack_hashes(data)
    return out


def _subject(worker_id: str) -> str:
    subject = _subjects.get(worker_id)
    if subject is None:
        subject = kv_event_subject(worker_id)  # raises ValueError for an id that is not a subject token
        if len(_subjects) >= _SUBJECT_CACHE_MAX:
            _subjects.clear()
        _subjects[worker_id] = subject
    return subject


