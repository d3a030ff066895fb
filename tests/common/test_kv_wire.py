"""KV-event bytes as each engine generation writes them decode to the same events."""

import msgpack
import pytest

from infera_common.kv_wire import (
    END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, KvWireError, RawBatch, decode_batch, decode_seq, encode_seq,
    read_batch, replay_reply,
)

TOKENS = list(range(100, 108))  # two blocks of 4


def _vllm_batch() -> bytes:
    # vLLM 0.32, as a real engine's publisher sent it (session 26 capture): an array batch (msgspec
    # array_like), map events tagged "type" with the fields of its structs, defaults omitted
    return msgpack.packb([
        1.5,
        [
            {"type": "BlockStored", "block_hashes": [2**64 - 1, 2**63], "parent_block_hash": None,
             "token_ids": TOKENS, "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None,
             "extra_keys": [None, None], "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
            {"type": "BlockRemoved", "block_hashes": [2**63], "medium": "GPU", "group_idx": 0},
            {"type": "AllBlocksCleared"},
        ],
        3,
    ])


def _map_batch() -> bytes:  # a map batch with map events: no engine was seen sending it; read all the same
    return msgpack.packb({
        "ts": 1.5,
        "events": [
            {"type": "BlockStored", "block_hashes": [2**64 - 1, 2**63], "parent_block_hash": None,
             "token_ids": TOKENS, "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None},
            {"type": "BlockRemoved", "block_hashes": [2**63], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
        "data_parallel_rank": 3,
    })


def _sglang_array_batch() -> bytes:  # SGLang: array batch, positional tagged events
    return msgpack.packb([
        1.5,
        [
            ["BlockStored", [-1, -(2**63)], None, TOKENS, 4, None, None],
            ["BlockRemoved", [-(2**63)], None],
            ["AllBlocksCleared"],
        ],
        3,
    ])


@pytest.mark.parametrize("payload", [_vllm_batch(), _map_batch(), _sglang_array_batch()])
def test_both_encodings_decode_to_the_same_events(payload):
    batch = decode_batch(payload)
    assert batch.ts == 1.5 and batch.dp_rank == 3 and batch.malformed == []
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.token_ids == TOKENS and stored.block_size == 4
    assert len(stored.block_hashes) == 2 and stored.parent_block_hash is None
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == stored.block_hashes[1:]
    assert isinstance(cleared, AllBlocksCleared)


def test_where_the_engine_holds_the_blocks_is_read_in_every_encoding_and_a_tiers_placeholder_is_no_error():
    """vLLM's CPU offloading (and SGLang's HiCache) name a medium, hybrid models a KV cache group; the
    offloading connector's placeholder stores carry no tokens (block_size 0)."""
    placeholder = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [],
                   "block_size": 0, "lora_id": None, "medium": "CPU", "lora_name": None, "group_idx": 1}
    tiered = {**placeholder, "token_ids": TOKENS[:4], "block_size": 4, "extra_keys": [None],
              "kv_cache_spec_kind": "full_attention", "kv_cache_spec_sliding_window": None, "locality": None}
    maps = decode_batch(msgpack.packb([0.5, [placeholder, tiered, {"type": "BlockRemoved", "block_hashes": [7],
                                                                     "medium": "CPU", "group_idx": 1}]]))
    arrays = decode_batch(msgpack.packb([0.5, [["BlockStored", [7], None, [], 0, None, "CPU", None, None, 1],
                                               ["BlockStored", [7], None, TOKENS[:4], 4, None, "CPU", None, [None], 1,
                                                "full_attention"],
                                               ["BlockRemoved", [7], "CPU", 1]]]))
    for batch in (maps, arrays):
        hold, stored, removed = batch.events
        assert batch.malformed == [] and hold.placeholder and not stored.placeholder
        assert [(e.medium, e.group_idx) for e in batch.events] == [("CPU", 1)] * 3
        assert stored.token_ids == TOKENS[:4] and removed.block_hashes == [7]


def test_malformed_event_is_reported_and_the_rest_kept():
    payload = msgpack.packb([0.0, [
        ["BlockStored", [1, 2], None, [1, 2, 3], 4, None, None],  # 3 tokens for 2 blocks of 4
        {"type": "Nonsense"},
        "garbage",
        ["BlockRemoved", [5], None],
    ]])
    batch = decode_batch(payload)
    assert [type(e).__name__ for e in batch.events] == ["BlockRemoved"]
    assert len(batch.malformed) == 3 and batch.dp_rank is None


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb(5), msgpack.packb({"ts": 1}), msgpack.packb([1.0, 7])])
def test_garbage_batch_raises_wire_error(payload):
    with pytest.raises(KvWireError):
        decode_batch(payload)


def test_seq_frames_round_trip_including_the_end_marker():
    assert decode_seq(encode_seq(41)) == 41
    assert decode_seq(encode_seq(-1)) == -1
    assert decode_seq((7).to_bytes(8, "big")) == 7  # vLLM writes unsigned big-endian
    with pytest.raises(KvWireError):
        decode_seq(b"\x00\x01")


@pytest.mark.parametrize("event", [
    {"type": "BlockStored", "block_hashes": [True], "parent_block_hash": None, "token_ids": [1, 2], "block_size": 2},
    {"type": "BlockStored", "block_hashes": ["1"], "parent_block_hash": None, "token_ids": [1, 2], "block_size": 2},
    {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": "ab", "block_size": 2},
    {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": "p", "token_ids": [1, 2], "block_size": 2},
    {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2], "block_size": 0},
    {"type": "BlockRemoved", "block_hashes": 5},
    ["BlockStored", [1], None, [1, 2]],  # no block size
])
def test_each_malformed_event_is_reported_alone(event):
    batch = decode_batch(msgpack.packb({"ts": 2, "events": [event, {"type": "AllBlocksCleared"}]}))
    assert len(batch.malformed) == 1 and [type(e) for e in batch.events] == [AllBlocksCleared]
    assert batch.ts == 2.0


def test_lenient_fields_fall_back_and_extra_or_missing_optional_fields_are_fine():
    batch = decode_batch(msgpack.packb([0, [["BlockStored", [7], 9, [1, 2], 2, "lora", 5, "name", "more"],
                                            ["BlockStored", [8], None, [3, 4], 2],
                                            ["BlockRemoved", [7]]]]))
    long, short, removed = batch.events
    assert (long.parent_block_hash, long.lora_id, long.medium) == (9, None, None)
    assert (short.block_hashes, short.token_ids, short.lora_id, short.medium) == ([8], [3, 4], None, None)
    assert (removed.block_hashes, removed.medium) == ([7], None) and batch.malformed == []


def test_replay_replies_are_read_in_both_engines_framings():
    assert replay_reply([b"", encode_seq(7), b"batch"]) == (7, b"batch")  # SGLang
    assert replay_reply([b"", b"kv", encode_seq(7), b"batch"]) == (7, b"batch")  # vLLM 0.32 repeats the topic
    assert replay_reply([b"", b"", encode_seq(END_SEQ), b""]) == (END_SEQ, b"")  # vLLM's end marker
    for bad in ([b"", encode_seq(7)], [b"x", encode_seq(7), b"batch"], [b"", b"", b"", encode_seq(7), b""]):
        with pytest.raises(KvWireError):
            replay_reply(bad)


def _one_by_one(payload: bytes) -> list:
    """The events as the field-by-field reader decodes them (the fallback of ``read_batch``)."""
    raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    malformed: list[str] = []
    return list(RawBatch(float(raw[0]), raw[1], raw[2] if len(raw) > 2 else None).decoded(malformed))


@pytest.mark.parametrize("batch", [
    [1.5, [["BlockStored", [i + 1], i or None, [100 + i], 1, None, "GPU"] for i in range(50)] + [["BlockRemoved", [50]]], 2],
    [1.5, [["BlockStored", [-1, -(2**63)], None, TOKENS, 4], ["AllBlocksCleared"]]],  # no rank, short events
    [7, [["BlockStored", [2**64 - 1], None, [1, 2], 2, 3, "CPU", "lora-name", "more"]], 0],
])
def test_sglangs_layout_is_read_in_one_pass_into_the_same_events(batch):
    payload = msgpack.packb(batch)
    raw = read_batch(payload)
    assert raw.ready  # msgspec read it whole
    assert list(raw.decoded([])) == _one_by_one(payload) and raw.dp_rank == (batch[2] if len(batch) > 2 else None)


@pytest.mark.parametrize("event", [
    ["BlockStored", [True], None, [1, 2], 2],  # a bool is not a hash
    ["BlockStored", [1], None, [1, 2, 3], 2],  # tokens for 1.5 blocks
    ["BlockStored", [1], None, [1, 2], 0],
    ["BlockStored", [1], None, [1, "2"], 2],  # a token id that is not an integer
    ["BlockStored", [1], None, [1, 2], 2, "lora"],  # a lenient field: read as None by the fallback
    ["Nonsense"],
])
def test_a_batch_msgspec_refuses_is_read_event_by_event(event):
    payload = msgpack.packb([0.0, [["BlockRemoved", [9]], event]])
    raw = read_batch(payload)
    assert not raw.ready
    assert [type(e) for e in raw.decoded([])][0] is BlockRemoved
