"""The engines' KV-event wire format, decoded (pure, no I/O).

A ZMQ PUB message is multipart ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian integer,
``payload`` a msgpack event batch. Both engine generations are accepted:

- batch as an array ``[ts, events, dp_rank?]`` (SGLang; vLLM before its map encoding) or as a map
  ``{"ts", "events", "data_parallel_rank"}`` (vLLM now);
- each event as a map tagged ``"type"`` or as a positional array whose first element is the tag:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]``,
  ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``.

Engine block hashes are opaque (vLLM unsigned 64-bit, SGLang signed): they are kept only as keys
for ``BlockRemoved``; the index hashes ``token_ids`` itself (``block_hash.py``).
A malformed event raises ``KvWireError``; a caller counts and drops it.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import msgpack

#: The sequence number of the replay socket's end-of-replay marker.
END_SEQ = -1


class KvWireError(ValueError):
    """Bytes that are not a well-formed KV event (batch)."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: list[KvEvent]
    dp_rank: int | None = None
    #: events of the batch that could not be read (counted, not fatal)
    malformed: list[str] = field(default_factory=list)


def decode_seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise KvWireError(f"sequence frame is {len(raw)} bytes, expected 8")
    return int.from_bytes(raw, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one msgpack batch; a malformed event is reported in ``malformed``, not raised."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise KvWireError(f"batch is not msgpack: {exc}") from exc
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, (list, tuple)) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise KvWireError("batch is neither [ts, events, dp_rank] nor a map with 'events'")
    if not isinstance(events, list):
        raise KvWireError("batch 'events' is not a list")
    if not isinstance(ts, (int, float)):
        raise KvWireError("batch 'ts' is not a number")
    if rank is not None and not isinstance(rank, int):
        raise KvWireError("batch dp rank is not an integer")
    decoded: list[KvEvent] = []
    malformed: list[str] = []
    for event in events:
        try:
            decoded.append(decode_event(event))
        except KvWireError as exc:
            malformed.append(str(exc))
    return EventBatch(float(ts), decoded, rank, malformed)


_POSITIONAL = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def decode_event(event: object) -> KvEvent:
    if isinstance(event, dict):
        tag = event.get("type")
        fields = event
    elif isinstance(event, (list, tuple)) and event and isinstance(event[0], str):
        tag = event[0]
        names = _POSITIONAL.get(tag, ())
        fields = dict(zip(names, event[1:]))
    else:
        raise KvWireError(f"event is neither a tagged map nor a tagged array: {type(event).__name__}")
    if tag == "BlockStored":
        hashes = _int_list(fields.get("block_hashes"), "block_hashes")
        tokens = _token_list(fields.get("token_ids"))
        size = fields.get("block_size")
        if not isinstance(size, int) or size <= 0:
            raise KvWireError(f"BlockStored block_size {size!r} is not a positive integer")
        if len(tokens) != len(hashes) * size:
            raise KvWireError(
                f"BlockStored carries {len(tokens)} token ids for {len(hashes)} blocks of {size}"
            )
        parent = fields.get("parent_block_hash")
        if parent is not None and not isinstance(parent, int):
            raise KvWireError("BlockStored parent_block_hash is not an integer")
        lora = fields.get("lora_id")
        return BlockStored(hashes, parent, tokens, size, lora if isinstance(lora, int) else None,
                           _opt_str(fields.get("medium")))
    if tag == "BlockRemoved":
        return BlockRemoved(_int_list(fields.get("block_hashes"), "block_hashes"), _opt_str(fields.get("medium")))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KvWireError(f"unknown event type {tag!r}")


def _int_list(value: object, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise KvWireError(f"{name} is not a list of integers")
    return value


def _token_list(value: object) -> list[int]:
    """Token ids, checked in C (``array``) rather than per element: this is ingest's hot path."""
    if not isinstance(value, list):
        raise KvWireError("token_ids is not a list of integers")
    try:
        array("q", value)
    except (TypeError, OverflowError):
        raise KvWireError("token_ids is not a list of integers") from None
    return value


def _opt_str(value: object) -> str | None:
    return value if isinstance(value, str) else None
