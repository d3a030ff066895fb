"""KV-event bytes as each engine generation writes them decode to the same events."""

import msgpack
import pytest

from infera_common.block_hash import block_hashes, chain
from infera_common.kv_wire import (
    AllBlocksCleared, BlockRemoved, BlockStored, KvWireError, decode_batch, decode_seq, encode_seq,
)

TOKENS = list(range(100, 108))  # two blocks of 4


def _vllm_map_batch() -> bytes:  # vLLM now: map batch, map events tagged "type"
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


def _sglang_array_batch() -> bytes:  # SGLang / older vLLM: array batch, positional tagged events
    return msgpack.packb([
        1.5,
        [
            ["BlockStored", [-1, -(2**63)], None, TOKENS, 4, None, None],
            ["BlockRemoved", [-(2**63)], None],
            ["AllBlocksCleared"],
        ],
        3,
    ])


@pytest.mark.parametrize("payload", [_vllm_map_batch(), _sglang_array_batch()])
def test_both_encodings_decode_to_the_same_events(payload):
    batch = decode_batch(payload)
    assert batch.ts == 1.5 and batch.dp_rank == 3 and batch.malformed == []
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.token_ids == TOKENS and stored.block_size == 4
    assert len(stored.block_hashes) == 2 and stored.parent_block_hash is None
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == stored.block_hashes[1:]
    assert isinstance(cleared, AllBlocksCleared)


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


def test_block_hashes_chain_full_blocks_only():
    hashes = block_hashes(list(range(10)), 4)
    assert len(hashes) == 2  # the partial third block has no hash
    assert hashes[0] == chain(0, [0, 1, 2, 3]) and hashes[1] == chain(hashes[0], [4, 5, 6, 7])
    # same block tokens under a different parent: a different hash (prefix identity)
    assert block_hashes([4, 5, 6, 7], 4)[0] != hashes[1]
    # a stored event's token ids give the hashes the router computes from the prompt
    assert block_hashes(list(range(8)), 4) == hashes
    assert block_hashes(list(range(8)), 8) != hashes[1:]
