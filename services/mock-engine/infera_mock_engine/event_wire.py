"""KV events encoded as each engine puts them on the wire (pure).

A ZMQ message is multipart `[topic, seq, payload]`, seq an 8-byte big-endian counter from 0 per
publisher, payload one msgpack batch per scheduler step:

- vllm (0.32): an array `[ts, events, dp_rank]` (msgspec `array_like=True`); each event a map
  tagged "type" (its structs have `tag=True, omit_defaults=True`):
  `{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
  "lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"}` (extra keys
  one null per block, or `[adapter name]` under a LoRA adapter, plus the request's cache salt on a
  sequence's first block, group 0, "full_attention"), `{"type": "BlockRemoved", "block_hashes",
  "medium", "group_idx"}`, `{"type": "AllBlocksCleared"}`. One BlockStored per run of blocks a
  sequence stored in the step. (As a real vLLM 0.32 sent them, captured in session 26; the mock
  had sent a map batch, which no engine does.)
- sglang: an array `[ts, events, dp_rank]`; each event a positional array tagged by its first
  element (msgspec `array_like=True, tag=True`): `["BlockStored", block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium]`, `["BlockRemoved", block_hashes, medium]`,
  `["AllBlocksCleared"]`. One BlockStored per block (page), parent-chained, as SGLang's radix
  cache records them. A block a LoRA adapter computed, or a salted request, goes as SGLang 0.5.23
  sends every event, a tagged map without its None fields: `{"type": "BlockStored", ..., "lora_id":
  None, "medium", "cache_salt", "lora_name"}` (SGLang names the adapter; its number is always None).

Medium is "GPU"; lora_id None but under a vLLM LoRA adapter (its number, from 1). Replay end marker: seq -1 (8 bytes, signed) with an empty payload.
"""

from __future__ import annotations

from typing import Any

import msgpack

from infera_mock_engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def encode_batch(flavor: str, ts: float, events: list[KvEvent], dp_rank: int) -> bytes:
    if flavor == "vllm":
        return msgpack.packb([ts, [_vllm(e) for e in events], dp_rank])
    out: list[list[Any]] = []
    for e in events:
        out.extend(_sglang(e))
    return msgpack.packb([ts, out, dp_rank])


def _vllm(e: KvEvent) -> dict[str, Any]:
    if isinstance(e, BlockStored):
        lora = e.lora
        return {"type": "BlockStored", "block_hashes": e.block_hashes, "parent_block_hash": e.parent_block_hash,
                "token_ids": e.token_ids, "block_size": e.block_size, "lora_id": lora and lora.id, "medium": MEDIUM,
                "lora_name": lora and lora.name, "extra_keys": _vllm_extra_keys(e),
                "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    if isinstance(e, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": e.block_hashes, "medium": MEDIUM, "group_idx": 0}
    if isinstance(e, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {e!r}")


def _vllm_extra_keys(e: BlockStored) -> list[list[str] | None]:
    """vLLM 0.32's per-block extra keys, untagged: the adapter's name on every block, the cache salt on
    a sequence's first block only."""
    keys: list[list[str] | None] = []
    for i in range(len(e.block_hashes)):
        entry = [e.lora.name] if e.lora is not None else []
        if e.cache_salt is not None and i == 0 and e.parent_block_hash is None:
            entry.append(e.cache_salt)
        keys.append(entry or None)
    return keys


def _sglang(e: KvEvent) -> list[Any]:
    if isinstance(e, BlockStored):
        bs = e.block_size
        out: list[Any] = []
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            tokens = e.token_ids[i * bs:(i + 1) * bs]
            if e.lora is None and e.cache_salt is None:
                out.append(["BlockStored", [h], parent, tokens, bs, None, MEDIUM])
            else:  # SGLang 0.5.23's tagged map, None fields left out: lora_id None, the adapter by name
                event = {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
                         "token_ids": tokens, "block_size": bs, "lora_id": None, "medium": MEDIUM}
                if e.cache_salt is not None:
                    event["cache_salt"] = e.cache_salt
                if e.lora is not None:
                    event["lora_name"] = e.lora.name
                out.append(event)
            parent = h
        return out
    if isinstance(e, BlockRemoved):
        return [["BlockRemoved", e.block_hashes, MEDIUM]]
    if isinstance(e, AllBlocksCleared):
        return [["AllBlocksCleared"]]
    raise TypeError(f"not a KV event: {e!r}")
