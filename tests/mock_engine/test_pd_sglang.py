"""SGLang prefill/decode disaggregation between two real mock engine processes: the bootstrap room
protocol, the KV bytes crossing between them, aborts on either side, DP rank selection."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest

from infera.procs import free_port

from .conftest import metric_value
from .pd_helpers import (
    CHAT, child_env, disagg, post_json, post_sse, server_info, spawn_engine_proc, stop_all, stream_text, wait_for, wait_healthy,
)

PER_TOKEN = 23040  # SmolLM2-135M: 2 x 30 layers x 3 KV heads x 64 dims x 2 bytes
TIMEOUT = 30  # both SGLang timeouts in this module: "promptly" below means well under this
LONG = 4000  # prompt tokens: 8 chunked-prefill steps of 512 on the slow prefill engine (~0.4 s)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A prefill engine (2 DP ranks, slow: speedup 0.5, chunked prefill 512) and a decode engine (2 DP ranks)."""
    logs = tmp_path_factory.mktemp("pd-sglang")
    env = child_env(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=str(TIMEOUT),
                    SGLANG_DISAGGREGATION_WAITING_TIMEOUT=str(TIMEOUT))
    bport = free_port()
    prefill = spawn_engine_proc(["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bport),
                                 "--dp-size", "2", "--page-size", "16", "--speedup", "0.5",
                                 "--max-num-batched-tokens", "512"], logs / "prefill.log", env, bport)
    decode = spawn_engine_proc(["--disaggregation-mode", "decode", "--dp-size", "2", "--page-size", "16",
                                "--speedup", "20"], logs / "decode.log", env)
    wait_healthy(prefill, decode)
    yield prefill, decode
    stop_all(prefill, decode)


def pd_fields(prefill, room: int | None = None) -> dict:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": random.randrange(2**63) if room is None else room}


def long_prompt() -> list[int]:
    start = random.randrange(1000, 20000)
    return [start + i % 5000 for i in range(LONG)]


async def transfer_counters(session, prefill, decode) -> tuple[int, int]:
    return (await disagg(session, prefill.url))["kv_bytes_sent"], (await disagg(session, decode.url))["kv_bytes_received"]


async def test_roles_and_bootstrap_port_are_reported_for_registration(pair):
    prefill, decode = pair
    async with aiohttp.ClientSession() as s:
        p, d = await server_info(s, prefill.url), await server_info(s, decode.url)
        async with s.get(f"http://127.0.0.1:{prefill.bootstrap_port}/health") as r:
            assert r.status == 200 and await r.text() == "OK"
        async with s.get(f"http://127.0.0.1:{prefill.bootstrap_port}/route?engine_rank=-1&target_dp_group=-1") as r:
            assert (await r.json())["prefill_dp_size"] == 2
    assert p["disaggregation_mode"] == "prefill" and p["disaggregation_bootstrap_port"] == prefill.bootstrap_port
    assert p["disaggregation"]["protocol"] == "sglang-bootstrap" and p["dp_size"] == 2
    assert d["disaggregation_mode"] == "decode" and d["disaggregation"]["bootstrap_port"] is None
    assert p["disaggregation"]["kv_bytes_per_token"] == PER_TOKEN


async def test_chat_through_the_pair_moves_the_prompt_kv_and_matches_an_aggregated_engine(pair, start_engine):
    prefill, decode = pair
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, **pd_fields(prefill)}
    aggregated = await start_engine("--page-size", "16", "--speedup", "20")
    async with aiohttp.ClientSession() as s:
        sent0, got0 = await transfer_counters(s, prefill, decode)
        (ps, pbody), (ds, dbody) = await asyncio.gather(
            post_json(s, prefill.url + "/v1/chat/completions", body),
            post_json(s, decode.url + "/v1/chat/completions", body))
        sent1, got1 = await transfer_counters(s, prefill, decode)
        sent_metric = metric_value(await (await s.get(prefill.url + "/metrics")).text(),
                                   "mock:kv_transfer_sent_bytes_total")
        _, alone = await aggregated.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "temperature": 0})
    assert ps == 200 and ds == 200, (pbody, dbody)
    # the prefill answers with its one token; the decode continues from it with the KV it received
    assert pbody["usage"] == {**pbody["usage"], "prompt_tokens": 35, "completion_tokens": 1}
    assert pbody["choices"][0]["finish_reason"] == "length"
    assert dbody["usage"]["prompt_tokens"] == 35 and dbody["usage"]["completion_tokens"] == 6
    text = dbody["choices"][0]["message"]["content"]
    assert text.startswith(pbody["choices"][0]["message"]["content"])
    assert text == alone["choices"][0]["message"]["content"]
    assert sent1 - sent0 == got1 - got0 == 35 * PER_TOKEN
    assert sent_metric >= 35 * PER_TOKEN


async def test_streaming_decode_and_a_streaming_prefill_both_complete(pair):
    prefill, decode = pair
    body = {"messages": CHAT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
            **pd_fields(prefill)}
    async with aiohttp.ClientSession() as s:
        sent0, got0 = await transfer_counters(s, prefill, decode)
        (ps, pev), (ds, dev) = await asyncio.gather(post_sse(s, prefill.url + "/v1/chat/completions", body),
                                                    post_sse(s, decode.url + "/v1/chat/completions", body))
        sent1, got1 = await transfer_counters(s, prefill, decode)
    assert ps == ds == 200 and pev[-1] == dev[-1] == "[DONE]"
    assert dev[-2]["usage"]["completion_tokens"] == 4 and pev[-2]["usage"]["completion_tokens"] == 1
    assert stream_text(dev).startswith(stream_text(pev)) and len(stream_text(dev)) > len(stream_text(pev))
    assert sent1 - sent0 == got1 - got0 == 35 * PER_TOKEN


async def test_native_generate_through_the_pair(pair):
    prefill, decode = pair
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            **pd_fields(prefill)}
    async with aiohttp.ClientSession() as s:
        (ps, pbody), (ds, dbody) = await asyncio.gather(post_json(s, prefill.url + "/generate", body),
                                                        post_json(s, decode.url + "/generate", body))
    assert ps == ds == 200
    assert pbody["meta_info"]["completion_tokens"] == 1 and dbody["meta_info"]["completion_tokens"] == 3
    assert dbody["output_ids"][0] == pbody["output_ids"][0]


async def test_a_request_without_bootstrap_fields_is_refused_by_both_roles(pair):
    prefill, decode = pair
    async with aiohttp.ClientSession() as s:
        for url in (prefill.url, decode.url):
            status, err = await post_json(s, url + "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})
            assert status == 400 and "bootstrap_room" in err["message"], err
        status, err = await post_json(s, decode.url + "/v1/chat/completions",
                                      {"messages": CHAT, "bootstrap_host": "127.0.0.1", "bootstrap_room": -1})
        assert status == 400


async def test_prefill_aborted_while_computing_fails_the_waiting_decode_promptly(pair):
    prefill, decode = pair
    body = {"input_ids": long_prompt(), "sampling_params": {"max_new_tokens": 4}, "stream": True, **pd_fields(prefill)}
    async with aiohttp.ClientSession() as s:
        decoding = asyncio.create_task(post_sse(s, decode.url + "/generate", body))
        await wait_for(lambda: _queue(s, decode.url, "decode_transfer", 1))  # the decode is connected, waiting
        prefilling = asyncio.create_task(post_json(s, prefill.url + "/generate", {**body, "stream": False,
                                                                                 "rid": "p-abort-1"}))
        await wait_for(lambda: _running(s, prefill.url))
        t0 = time.monotonic()
        assert (await post_json(s, prefill.url + "/abort_request", {"rid": "p-abort-1"}))[0] == 200
        status, events = await decoding
        elapsed = time.monotonic() - t0
        pstatus, pbody = await prefilling
    assert pstatus == 200 and pbody["meta_info"]["finish_reason"]["type"] == "abort"
    assert status == 200 and events[-1] == "[DONE]"
    reason = events[-2]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 500
    assert reason["message"].startswith("Decode transfer failed for request rank=0")
    assert "Failed to get kvcache from prefill instance" in reason["message"]
    assert elapsed < TIMEOUT / 3


async def test_prefill_aborted_before_its_decode_came_fails_the_decode_at_once(pair):
    prefill, decode = pair
    body = {"messages": CHAT, "max_tokens": 3, **pd_fields(prefill)}
    async with aiohttp.ClientSession() as s:
        waiting = asyncio.create_task(post_json(s, prefill.url + "/v1/chat/completions", {**body, "rid": "p-abort-2"}))
        await wait_for(lambda: _queue(s, prefill.url, "prefill_bootstrap", 1))
        await post_json(s, prefill.url + "/abort_request", {"rid": "p-abort-2"})
        pstatus, pbody = await waiting
        t0 = time.monotonic()
        status, err = await post_json(s, decode.url + "/v1/chat/completions", body)
        elapsed = time.monotonic() - t0
    assert pstatus == 200 and pbody["choices"][0]["finish_reason"] == "abort"
    assert status == 500 and err["object"] == "error" and err["code"] == 500 and err["type"] == "500"
    assert f"decode_req.req.bootstrap_room={body['bootstrap_room']}" in err["message"]
    assert elapsed < TIMEOUT / 3


async def test_decode_client_gone_while_prefill_computes_fails_the_prefill_promptly(pair):
    prefill, decode = pair
    body = {"input_ids": long_prompt(), "sampling_params": {"max_new_tokens": 4}, "stream": True, **pd_fields(prefill)}
    async with aiohttp.ClientSession() as s:
        decoding = asyncio.create_task(post_sse(s, decode.url + "/generate", body))
        await wait_for(lambda: _queue(s, decode.url, "decode_transfer", 1))
        prefilling = asyncio.create_task(post_json(s, prefill.url + "/generate", {**body, "stream": False}))
        await wait_for(lambda: _running(s, prefill.url))
        decoding.cancel()  # the decode's client goes away: its KV pull is closed
        t0 = time.monotonic()
        status, err = await prefilling
        elapsed = time.monotonic() - t0
        await wait_for(lambda: _queue(s, decode.url, "decode_transfer", 0))
    assert status == 500 and err["message"].startswith("Prefill transfer failed for request rank=0")
    assert "Decode instance could be dead" in err["message"]
    assert elapsed < TIMEOUT / 3


async def test_decode_aborted_before_its_prefill_came_fails_the_prefill_at_once(pair):
    prefill, decode = pair
    body = {"messages": CHAT, "max_tokens": 3, **pd_fields(prefill)}
    async with aiohttp.ClientSession() as s:
        failed_before = (await disagg(s, prefill.url))["rooms_failed"]
        decoding = asyncio.create_task(post_json(s, decode.url + "/v1/chat/completions", {**body, "rid": "d-abort"}))
        await wait_for(lambda: _queue(s, decode.url, "decode_transfer", 1))
        await post_json(s, decode.url + "/abort_request", {"rid": "d-abort"})
        dstatus, dbody = await decoding
        # the decode's KV pull closing reaches the prefill engine on its own time: the prefill request
        # this test is about comes after that (one that comes before it fails in transfer, the test above)
        await wait_for(lambda: _rooms_failed_since(s, prefill.url, failed_before))
        t0 = time.monotonic()
        status, err = await post_json(s, prefill.url + "/v1/chat/completions", body)
        elapsed = time.monotonic() - t0
    assert dstatus == 200 and dbody["choices"][0]["finish_reason"] == "abort"
    assert status == 500 and err["message"].startswith("Prefill bootstrap failed for request rank=0")
    assert elapsed < TIMEOUT / 3


async def test_dp_rank_follows_the_room_or_the_pins(pair):
    prefill, decode = pair
    async with aiohttp.ClientSession() as s:

        async def run(room: int, prefill_extra: dict, decode_extra: dict) -> tuple[list[int], list[int]]:
            before = await _cached_per_rank(s, prefill.url), await _cached_per_rank(s, decode.url)
            body = {"prompt": f"rank test {random.random()} " * 8, "max_tokens": 2, "temperature": 0,
                    **pd_fields(prefill, room)}
            (ps, pb), (ds, db) = await asyncio.gather(
                post_json(s, prefill.url + "/v1/completions", {**body, **prefill_extra}),
                post_json(s, decode.url + "/v1/completions", {**body, **decode_extra}))
            assert ps == ds == 200, (pb, db)
            after = await _cached_per_rank(s, prefill.url), await _cached_per_rank(s, decode.url)
            return ([a - b for a, b in zip(after[0], before[0])], [a - b for a, b in zip(after[1], before[1])])

        even, odd = 2 * random.randrange(2**61), 2 * random.randrange(2**61) + 1
        p, d = await run(even, {}, {})  # room % dp_size on both sides
        assert p[0] > 0 and p[1] == 0 and d[0] > 0 and d[1] == 0
        p, d = await run(odd, {}, {})
        assert p[1] > 0 and p[0] == 0 and d[1] > 0 and d[0] == 0
        # pinned: the prefill runs on rank 1 and the decode (on rank 0) is told where the KV is
        p, d = await run(even, {"routed_dp_rank": 1}, {"disagg_prefill_dp_rank": 1, "routed_dp_rank": 0})
        assert p[1] > 0 and p[0] == 0 and d[0] > 0 and d[1] == 0
        status, err = await post_json(s, prefill.url + "/v1/completions",
                                      {"prompt": "x", "routed_dp_rank": 2, **pd_fields(prefill)})
        assert status == 400 and "dp_size=2" in err["message"]
        loads = await (await s.get(prefill.url + "/v1/loads")).json()
        assert loads["dp_rank_count"] == 2 and [x["dp_rank"] for x in loads["loads"]] == [0, 1]


async def _queue(s, url: str, name: str, value: int) -> bool:
    return (await disagg(s, url))["queues"][name] == value


async def _rooms_failed_since(s, url: str, before: int) -> bool:
    return (await disagg(s, url))["rooms_failed"] > before


async def _running(s, url: str) -> bool:
    async with s.get(url + "/metrics") as r:
        return metric_value(await r.text(), "sglang:num_running_reqs") >= 1


async def _cached_per_rank(s, url: str) -> list[int]:
    return [x["num_cached_blocks"] for x in (await server_info(s, url))["internal_states"]]


def test_a_busy_bootstrap_port_fails_the_prefill_process_with_exit_1(tmp_path):
    import socket
    import subprocess
    import sys

    from .pd_helpers import MODEL

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "infera_mock_engine", "--model-path", MODEL, "--port",
                              str(free_port()), "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                              str(busy)], capture_output=True, text=True, env=child_env(), timeout=30)
    assert res.returncode == 1 and f"cannot listen on the bootstrap port 127.0.0.1:{busy}" in res.stderr
