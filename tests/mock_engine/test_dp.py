"""Data-parallel ranks of an aggregated engine: each rank its own scheduler, KV cache and KV-event
publisher; requests pinned by routed_dp_rank (SGLang) or X-data-parallel-rank (vLLM), else round-robin."""

from __future__ import annotations

import random


async def _cached(client) -> list[int]:
    _, info = await client.get_json("/server_info")
    return [x["num_cached_blocks"] for x in info["internal_states"]]


async def _complete(client, headers: dict | None = None, **fields) -> None:
    body = {"prompt": f"dp {random.random()} " * 8, "max_tokens": 2, **fields}
    status, res = await client.post("/v1/completions", body, headers)
    assert status == 200, res


async def test_sglang_ranks_are_pinned_by_routed_dp_rank_and_otherwise_take_turns(start_engine):
    client = await start_engine("--dp-size", "2", "--page-size", "16", "--speedup", "50")
    before = await _cached(client)
    await _complete(client, routed_dp_rank=1)
    after = await _cached(client)
    assert after[1] > before[1] and after[0] == before[0]
    await _complete(client, data_parallel_rank=0)  # SGLang's older name
    again = await _cached(client)
    assert again[0] > after[0] and again[1] == after[1]
    for _ in range(2):  # unpinned: one each
        await _complete(client)
    last = await _cached(client)
    assert last[0] > again[0] and last[1] > again[1]
    _, loads = await client.get_json("/v1/loads")
    _, info = await client.get_json("/server_info")
    assert loads["dp_rank_count"] == 2 and info["dp_size"] == 2 and len(info["internal_states"]) == 2
    status, err = await client.post("/v1/completions", {"prompt": "x", "routed_dp_rank": 2})
    assert status == 400 and "routed_dp_rank=2" in err["message"]


async def test_vllm_ranks_publish_their_own_kv_events_and_follow_the_header(start_engine):
    client = await start_engine("--engine-flavor", "vllm", "--data-parallel-size", "2", "--block-size", "16",
                                "--kv-events-config",
                                '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:0"}')
    _, sources = await client.get_json("/kv_event_sources")
    assert list(sources) == ["0", "1"]
    assert sources["0"]["endpoint"] != sources["1"]["endpoint"]
    before = await _cached(client)
    await _complete(client, {"X-data-parallel-rank": "1"})
    after = await _cached(client)
    assert after[1] > before[1] and after[0] == before[0]
    assert await client.metric("vllm:prompt_tokens_total") > 0  # summed over the ranks
