"""Metrics under each engine's names, queueing under load, KV usage, speedup, cold start, info endpoints."""

import asyncio
import time

import pytest

from .conftest import metric_value, wait_until

LONG = 4000
CHAT = {"messages": [{"role": "user", "content": "1+1=?"}]}


async def test_sglang_metric_names_and_counters(engine):
    await engine.post("/v1/chat/completions", {**CHAT, "max_tokens": 3})
    text = await engine.metrics()
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                 "sglang:cache_hit_rate", "sglang:num_used_tokens"):
        assert metric_value(text, name) == 0
    assert metric_value(text, "sglang:prompt_tokens_total") == 35
    assert metric_value(text, "sglang:generation_tokens_total") == 3
    model = engine.server.engine.config.served_model_name
    assert f'sglang:num_running_reqs{{model_name="{model}"}} 0.0' in text
    assert "vllm:" not in text


async def test_vllm_metric_names_and_endpoints(start_engine):
    client = await start_engine("--engine-flavor", "vllm", "--speedup", "10", "--served-model-name", "smol",
                                "--num-kv-blocks", "300", "--block-size", "32")
    await client.post("/v1/completions", {"prompt": [1, 2, 3, 4], "max_tokens": 2})
    text = await client.metrics()
    # vLLM's cache configuration as an info gauge: the KV capacity a worker-agent registers
    assert ('vllm:cache_config_info{block_size="32",engine="0",kv_cache_size_tokens="9600",num_gpu_blocks="300"} 1.0'
            in text)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc"):
        assert metric_value(text, name) == 0
    assert metric_value(text, "vllm:prompt_tokens_total") == 4
    assert metric_value(text, "vllm:generation_tokens_total") == 2
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="smol"} 1.0' in text
    assert "sglang:" not in text
    status, models = await client.get_json("/v1/models")
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "smol" and models["data"][0]["owned_by"] == "vllm"
    assert models["data"][0]["max_model_len"] == 8192
    status, load = await client.get_json("/load")
    assert status == 200 and load == {"server_load": 0}


async def test_one_running_slot_makes_the_second_request_wait(start_engine):
    client = await start_engine("--max-running-requests", "1")
    first = asyncio.create_task(client.post("/generate", {"input_ids": [1], "rid": "first",
                                                          "sampling_params": {"max_new_tokens": LONG}}))
    second = asyncio.create_task(client.post("/generate", {"input_ids": [2], "rid": "second",
                                                           "sampling_params": {"max_new_tokens": 2}}))

    async def queued() -> bool:
        text = await client.metrics()
        return (metric_value(text, "sglang:num_running_reqs"), metric_value(text, "sglang:num_queue_reqs")) == (1, 1)

    await wait_until(queued)
    _, loads = await client.get_json("/v1/loads")
    assert loads["loads"][0]["num_running_reqs"] == 1 and loads["loads"][0]["num_waiting_reqs"] == 1
    assert loads["aggregate"]["total_reqs"] == 2
    assert not second.done()
    await client.post("/abort_request", {"rid": "first"})
    (_, b1), (_, b2) = await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert b1["meta_info"]["finish_reason"]["type"] == "abort"
    assert b2["meta_info"]["finish_reason"] == {"type": "length", "length": 2}


async def test_kv_usage_counts_blocks_of_running_sequences(start_engine):
    client = await start_engine("--num-kv-blocks", "100", "--page-size", "16")
    task = asyncio.create_task(client.post("/generate", {"input_ids": list(range(1, 41)), "rid": "kv",
                                                         "sampling_params": {"max_new_tokens": 1000}}))
    await wait_until(lambda: _gauge_at_least(client, "sglang:token_usage", 0.03))
    usage = await client.metric("sglang:token_usage")
    assert 0.03 <= usage <= 0.7  # ceil((40 + generated) / 16) blocks of 100
    assert await client.metric("sglang:num_used_tokens") == usage * 100 * 16
    await client.post("/abort_request", {"rid": "kv"})
    await task
    assert await client.metric("sglang:token_usage") == 0


async def test_a_request_larger_than_the_kv_cache_is_refused(start_engine):
    client = await start_engine("--num-kv-blocks", "2", "--page-size", "16")
    status, err = await client.post("/generate", {"input_ids": list(range(1, 30)),
                                                  "sampling_params": {"max_new_tokens": 10}})
    assert status == 400 and "KV blocks" in err["message"]


async def _gauge_at_least(client, name, value) -> bool:
    return await client.metric(name) >= value


async def _timed(client, n_tokens: int) -> float:
    t0 = time.monotonic()
    status, body = await client.post("/generate", {"input_ids": [1, 2, 3],
                                                   "sampling_params": {"max_new_tokens": n_tokens}})
    assert status == 200 and body["meta_info"]["completion_tokens"] == n_tokens
    return time.monotonic() - t0


async def test_speedup_shortens_the_modelled_time(start_engine):
    slow = await start_engine()
    fast = await start_engine("--speedup", "100")
    n = 60
    modelled = (16.50142 + 0.0456 + (n - 1) * 5.74) / 1000  # one prefill step + n-1 decode steps at u≈0
    t_slow = await _timed(slow, n)
    t_fast = await _timed(fast, n)
    assert t_slow >= modelled * 0.95  # sleeping never finishes early
    assert t_fast < t_slow / 3  # generous: 100x faster in the model


async def test_startup_delay_answers_503_until_ready(start_engine):
    client = await start_engine("--startup-delay", "1.5", "--speedup", "10")
    async with client.session.get("/health") as r:
        assert r.status == 503
    status, err = await client.post("/v1/chat/completions", {**CHAT, "max_tokens": 1})
    assert status == 503 and err["code"] == 503

    async def healthy() -> bool:
        async with client.session.get("/health") as r:
            return r.status == 200

    await wait_until(healthy, timeout=10)
    status, _ = await client.post("/v1/chat/completions", {**CHAT, "max_tokens": 1})
    assert status == 200


async def test_health_generate_runs_a_generation(engine):
    async with engine.session.get("/health_generate") as r:
        assert r.status == 200
    assert await engine.metric("sglang:generation_tokens_total") == 0  # health probes are not counted


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
async def test_model_info(engine, path):
    status, info = await engine.get_json(path)
    cfg = engine.server.engine.config
    assert status == 200 and info["model_path"] == cfg.model_path and info["tokenizer_path"] == cfg.tokenizer_path
    assert info["is_generation"] is True and info["model_type"] == "llama"


async def test_server_info_reports_resolved_args(start_engine):
    client = await start_engine("--page-size", "32", "--num-kv-blocks", "500", "--max-running-requests", "7",
                                "--speedup", "3", "--served-model-name", "smol", "--tp", "2",
                                "--disable-overlap-schedule")
    for path in ("/server_info", "/get_server_info"):
        status, info = await client.get_json(path)
        assert status == 200
        assert (info["page_size"], info["num_kv_blocks"], info["max_total_num_tokens"]) == (32, 500, 16000)
        assert (info["max_running_requests"], info["speedup"], info["engine_flavor"]) == (7, 3.0, "sglang")
        assert info["served_model_name"] == "smol" and info["context_length"] == 8192
        assert info["ignored_args"] == ["--tp", "2"] and info["disable_overlap_schedule"] is True
    status, models = await client.get_json("/v1/models")
    assert models["data"][0]["owned_by"] == "sglang" and models["data"][0]["max_model_len"] == 8192
