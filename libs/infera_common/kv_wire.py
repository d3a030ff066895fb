"""The engines' KV-event wire format, decoded (pure, no I/O).

A ZMQ PUB message is multipart ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian integer,
``payload`` a msgpack event batch. Both engine generations are accepted:

- batch as an array ``[ts, events, dp_rank?]`` (SGLang and vLLM: msgspec ``array_like``), or as a
  map ``{"ts", "events", "data_parallel_rank"}`` (no engine was seen sending it; read all the same);
- each event as a map tagged ``"type"`` or as a positional array whose first element is the tag:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
  extra_keys, group_idx, ...]``, ``["BlockRemoved", block_hashes, medium, group_idx]``, ``["AllBlocksCleared"]``.

``medium`` (vLLM: ``"GPU"``, ``"CPU"``, ``"STORAGE"``; absent on older engines: the GPU) and ``group_idx``
(the KV cache group of a hybrid model; absent: 0) say where the engine stored or dropped the blocks: a
block is held while any (medium, group) holds it (``kv_translate``). vLLM's offloading connector,
unless told to describe its blocks, stores a tier's block as a placeholder: ``block_size`` 0, no
token ids, the block's engine hash alone; it is read as such (``BlockStored.placeholder``).

Engine block hashes are opaque (vLLM unsigned 64-bit, SGLang signed): they are kept only as keys
for ``BlockRemoved``; the index hashes ``token_ids`` itself (``block_hash.py``).
A malformed event raises ``KvWireError``; a caller counts and drops it. Token ids are checked for
being a list of the right length here; each id's type and range (``0..2**32-1``) is checked where
they are hashed (``block_hashes`` raises), so ingest reads every token once.

This is ingest's hot path, and SGLang at its default page of one token sends one event per token.
A batch in SGLang's layout (array batch, positional events) is decoded and type-checked in one pass
by msgspec, straight into the event types, which are msgspec structs in that layout; any other
layout, or a batch with anything msgspec refuses, is read field by field as before, so that a
malformed event costs only itself. Either way no per-token work is done here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgpack
import msgspec

#: The sequence number of the replay socket's end-of-replay marker.
END_SEQ = -1
#: Seconds a replay may take before what arrived is used and the rest counted lost.
REPLAY_TIMEOUT = 3.0


class KvWireError(ValueError):
    """Bytes that are not a well-formed KV event (batch)."""


# Positional, tagged by class name (``["BlockStored", ...]``); fields after ``group_idx`` ignored.
class BlockStored(msgspec.Struct, array_like=True, tag=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: Annotated[int, msgspec.Meta(ge=0)]  # 0: a placeholder (no token ids)
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None  # the adapter that computed the blocks (vLLM; lora_id is its older number)
    extra_keys: Any = None  # vLLM: one entry per block, what its hash took besides tokens (kv_translate.keyed_hashes)
    group_idx: int | None = None

    @property
    def placeholder(self) -> bool:
        """A tier's note that it holds these engine blocks, without their tokens."""
        return self.block_size == 0


class BlockRemoved(msgspec.Struct, array_like=True, tag=True, gc=False):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, array_like=True, tag=True, gc=False):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[KvEvent]
    dp_rank: int | None = None


_decode_array_batch = msgspec.msgpack.Decoder(_ArrayBatch).decode


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[KvEvent]
    dp_rank: int | None = None
    #: events of the batch that could not be read (counted, not fatal)
    malformed: list[str] = field(default_factory=list)


def replay_reply(frames: list[bytes]) -> tuple[int, bytes]:
    """(seq, payload) of one message a DEALER receives from an engine's replay ROUTER.

    SGLang answers ``[b"", seq, payload]``; vLLM (0.32) ``[b"", topic, seq, payload]``, its end
    marker ``[b"", b"", END_SEQ, b""]``. Either way the seq and the payload are the last two frames.
    """
    if len(frames) not in (3, 4) or frames[0]:
        raise KvWireError(f"replay reply of {len(frames)} frames, expected [b'', (topic,) seq, payload]")
    return decode_seq(frames[-2]), frames[-1]


def decode_seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise KvWireError(f"sequence frame is {len(raw)} bytes, expected 8")
    return int.from_bytes(raw, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one msgpack batch; a malformed event is reported in ``malformed``, not raised."""
    raw = read_batch(payload)
    malformed: list[str] = []
    return EventBatch(raw.ts, list(raw.decoded(malformed)), raw.dp_rank, malformed)


@dataclass(slots=True)
class RawBatch:
    """A batch whose envelope is read and checked: ``decoded`` gives its events, decoding them one
    at a time when they were not decoded whole (so that a consumer can let other work run between
    them)."""

    ts: float
    events: list
    dp_rank: int | None
    ready: bool = False  # ``events`` are decoded and checked already

    def decoded(self, malformed: list[str]) -> Iterator[KvEvent]:
        """The events in order, each decoded as it is reached; a malformed one is appended to
        ``malformed`` and skipped."""
        if self.ready:
            yield from self.events
            return
        for event in self.events:
            try:
                yield decode_event(event)
            except KvWireError as exc:
                malformed.append(str(exc))


def _read_whole(payload: bytes) -> RawBatch | None:
    """SGLang's layout decoded in one pass; None when the batch is in another layout or anything
    in it is not well-formed (the caller then reads it event by event)."""
    try:
        batch = _decode_array_batch(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    for event in batch.events:
        if type(event) is BlockStored and len(event.token_ids) != len(event.block_hashes) * event.block_size:
            return None
    return RawBatch(batch.ts, batch.events, batch.dp_rank, ready=True)


def read_batch(payload: bytes) -> RawBatch:
    """Unpack one msgpack batch and check its envelope; ``KvWireError`` if that is malformed."""
    whole = _read_whole(payload)
    if whole is not None:
        return whole
    raw = unpack(payload, "batch")
    if type(raw) is dict:
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif type(raw) is list and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise KvWireError("batch is neither [ts, events, dp_rank] nor a map with 'events'")
    if type(events) is not list:
        raise KvWireError("batch 'events' is not a list")
    if type(ts) is not float and type(ts) is not int:
        raise KvWireError("batch 'ts' is not a number")
    if rank is not None and type(rank) is not int:
        raise KvWireError("batch dp rank is not an integer")
    return RawBatch(float(ts), events, rank)


_unpackb = msgpack.unpackb


def unpack(data: bytes, what: str = "message") -> object:
    """msgpack bytes to Python objects (int map keys allowed); ``KvWireError`` (a ``ValueError``) if not msgpack."""
    try:
        return _unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise KvWireError(f"{what} is not msgpack: {exc}") from exc


def decode_event(event: object) -> KvEvent:
    if type(event) is dict:
        tag = event.get("type")
        get = event.get
        if tag == "BlockStored":
            return _stored(get("block_hashes"), get("parent_block_hash"), get("token_ids"), get("block_size"),
                           get("lora_id"), get("medium"), get("lora_name"), get("extra_keys"), get("group_idx"),
                           get("cache_salt"))
        if tag == "BlockRemoved":
            return _removed(get("block_hashes"), get("medium"), get("group_idx"))
    elif type(event) is list and event and type(event[0]) is str:
        tag = event[0]
        if tag == "BlockStored":  # [tag, block_hashes, parent, token_ids, block_size, lora_id, medium,
            #                        lora_name, extra_keys, group_idx, ...]
            return _stored(*(event[1:10] + [None] * 9)[:9])
        if tag == "BlockRemoved":  # [tag, block_hashes, medium, group_idx]
            fields = (event[1:4] + [None] * 3)[:3]
            return _removed(*fields)
    else:
        raise KvWireError(f"event is neither a tagged map nor a tagged array: {type(event).__name__}")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KvWireError(f"unknown event type {tag!r}")


def _stored(hashes: object, parent: object, tokens: object, size: object, lora: object, medium: object,
            lora_name: object, extra_keys: object, group: object, salt: object = None) -> BlockStored:
    hashes = _int_list(hashes, "block_hashes")
    if type(salt) is str and extra_keys is None and hashes:  # SGLang's own field: read as vLLM sends it,
        extra_keys = [[salt]] + [None] * (len(hashes) - 1)  # the first block's extra key (``event_salt``)
    if type(tokens) is not list:
        raise KvWireError("token_ids is not a list of integers")
    if type(size) is not int or size < 0:
        raise KvWireError(f"BlockStored block_size {size!r} is not a positive integer (or 0 for a placeholder)")
    if len(tokens) != len(hashes) * size:
        raise KvWireError(f"BlockStored carries {len(tokens)} token ids for {len(hashes)} blocks of {size}")
    if parent is not None and type(parent) is not int:
        raise KvWireError("BlockStored parent_block_hash is not an integer")
    return BlockStored(hashes, parent, tokens, size, lora if type(lora) is int else None,
                       medium if type(medium) is str else None, lora_name if type(lora_name) is str else None,
                       extra_keys,
                       group if type(group) is int else None)


def _removed(hashes: object, medium: object, group: object) -> BlockRemoved:
    return BlockRemoved(_int_list(hashes, "block_hashes"), medium if type(medium) is str else None,
                        group if type(group) is int else None)


def _int_list(value: object, name: str) -> list[int]:
    if type(value) is not list:
        raise KvWireError(f"{name} is not a list of integers")
    for v in value:
        if type(v) is not int:  # bool is not an int here
            raise KvWireError(f"{name} is not a list of integers")
    return value
