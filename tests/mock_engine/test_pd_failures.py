"""Disaggregation failures with short timeouts (in-process engines; the KV still moves over TCP between
them): rooms that never arrive, KV nobody pulls, unreachable prefills, the recompute policy, the
bandwidth cap."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp

from .conftest import metric_value
from .pd_helpers import CHAT, disagg, post_json, post_sse

TIMEOUT = 1.0


def room_fields(prefill_client) -> dict:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill_client.server.engine.pd.bootstrap_port,
            "bootstrap_room": random.randrange(2**63)}


async def test_sglang_rooms_that_never_meet_fail_after_the_timeouts_on_each_side(start_engine, monkeypatch):
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", str(TIMEOUT))
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", str(TIMEOUT))
    prefill = await start_engine("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0",
                                 "--speedup", "20")
    decode = await start_engine("--disaggregation-mode", "decode", "--speedup", "20")
    body = {"messages": CHAT, "max_tokens": 3}
    async with aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        (d1, err), (d2, events), (p1, perr) = await asyncio.gather(
            post_json(s, decode.url + "/v1/chat/completions", {**body, **room_fields(prefill)}),
            post_sse(s, decode.url + "/v1/chat/completions", {**body, "stream": True, **room_fields(prefill)}),
            post_json(s, prefill.url + "/v1/chat/completions", {**body, **room_fields(prefill)}))
        elapsed = time.monotonic() - t0
        decode_metrics, prefill_metrics = await decode.metrics(), await prefill.metrics()
        prefill_info = await disagg(s, prefill.url)
    # the decode waited SGLANG_DISAGGREGATION_WAITING_TIMEOUT for a room the prefill never got
    assert d1 == 500 and err["object"] == "error" and err["code"] == 500
    assert err["message"].startswith("Decode transfer failed for request rank=0 decode_req.req.rid=")
    assert "timed out after" in err["message"] and "KVPoll.WaitingForInput" in err["message"]
    assert d2 == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "INTERNAL_SERVER_ERROR" and "KVPoll.WaitingForInput" in events[-2]["error"][
        "message"]
    # the prefill waited SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT for a decode that never came
    assert p1 == 500 and perr["message"].startswith("Prefill bootstrap failed for request rank=0 req.rid=")
    assert "KVPoll.Bootstrapping" in perr["message"]
    assert TIMEOUT <= elapsed < TIMEOUT + 10
    assert metric_value(decode_metrics, "sglang:num_transfer_failed_reqs_total") == 2
    assert metric_value(prefill_metrics, "sglang:num_bootstrap_failed_reqs_total") == 1
    assert {"side": "prefill", "kind": "bootstrap_timeout", "count": 1} in prefill_info["failures"]


async def test_sglang_decode_fails_at_once_when_the_bootstrap_server_is_unreachable(start_engine):
    from infera.procs import free_port

    decode = await start_engine("--disaggregation-mode", "decode")
    body = {"messages": CHAT, "bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(), "bootstrap_room": 7}
    async with aiohttp.ClientSession() as s:
        status, err = await post_json(s, decode.url + "/v1/chat/completions", body)
    assert status == 500 and "Could not fetch prefill parallel info from bootstrap_addr: 127.0.0.1:" in err["message"]


async def test_vllm_unpulled_kv_expires_and_a_decode_without_its_prefill_times_out(start_engine, monkeypatch):
    monkeypatch.setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", "0")
    monkeypatch.setenv("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", str(TIMEOUT))
    flags = ["--engine-flavor", "vllm", "--speedup", "20", "--kv-transfer-config"]
    prefill = await start_engine(*flags, '{"kv_connector":"MooncakeConnector","kv_role":"kv_producer"}')
    decode = await start_engine(*flags, '{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer"}')
    pd = prefill.server.engine.pd
    engine_id = pd.cfg.engine_id
    addr = f"http://127.0.0.1:{pd.bootstrap_port}"
    async with aiohttp.ClientSession() as s:
        # a prefill nobody pulls: answered at once, its KV is dropped after the abort timeout
        status, res = await post_json(s, prefill.url + "/v1/completions", {
            "prompt": "hello", "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "lonely"}})
        assert status == 200 and res["kv_transfer_params"] is None
        assert (await disagg(s, prefill.url))["rooms_in_flight"] == 1
        t0 = time.monotonic()
        status, err = await post_json(s, decode.url + "/v1/completions", {
            "prompt": "hello", "max_tokens": 2,
            "kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": "never",
                                   "remote_engine_id": engine_id, "remote_bootstrap_addr": addr}})
        elapsed = time.monotonic() - t0
        await asyncio.sleep(0.1)
        info = await disagg(s, prefill.url)
    assert status == 500 and err["error"]["message"] == "Internal server error"
    assert TIMEOUT <= elapsed < TIMEOUT + 10
    assert info["rooms_in_flight"] == 0
    assert {"side": "prefill", "kind": "expired", "count": 1} in info["failures"]


async def test_vllm_recompute_policy_serves_the_request_after_a_failed_load(start_engine):
    decode = await start_engine("--engine-flavor", "vllm", "--kv-transfer-config",
                                '{"kv_connector":"MooncakeConnector","kv_role":"kv_both",'
                                '"kv_load_failure_policy":"recompute"}')
    pd = decode.server.engine.pd
    async with aiohttp.ClientSession() as s:
        status, res = await post_json(s, decode.url + "/v1/chat/completions", {
            "messages": CHAT, "max_tokens": 2,
            "kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": "t",
                                   "remote_engine_id": "gone", "remote_bootstrap_addr": f"127.0.0.1:{pd.bootstrap_port}"}})
        info = await disagg(s, decode.url)
    assert status == 200 and res["usage"]["completion_tokens"] == 2
    assert info["kv_bytes_received"] == 0 and {"side": "decode", "kind": "unknown_engine", "count": 1} in info["failures"]


async def test_the_bandwidth_cap_paces_the_transfer(start_engine):
    prefill = await start_engine("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0",
                                 "--speedup", "50", "--kv-transfer-bandwidth", "2000000", "--kv-bytes-per-token", "23040")
    decode = await start_engine("--disaggregation-mode", "decode", "--speedup", "50")
    body = {"messages": CHAT, "max_tokens": 1, **room_fields(prefill)}
    async with aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        (ps, _), (ds, _) = await asyncio.gather(post_json(s, prefill.url + "/v1/chat/completions", body),
                                                post_json(s, decode.url + "/v1/chat/completions", body))
        elapsed = time.monotonic() - t0
    assert ps == ds == 200
    assert elapsed >= 35 * 23040 / 2_000_000 * 0.9  # 806,400 bytes at 2 MB/s cannot arrive sooner
