"""vLLM-flavour disaggregation (Mooncake connector handshake) between two real mock engine processes,
driven the way vLLM's mooncake proxy drives a pair: /query the prefill's bootstrap server for its
engine ids, send the prefill `max_tokens: 1` with `do_remote_decode`, the decode `do_remote_prefill`
with the prefill's `remote_engine_id`/`remote_bootstrap_addr`, both with one `transfer_id`."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import aiohttp
import pytest

from infera.procs import free_port

from .conftest import metric_value
from .pd_helpers import (
    CHAT, child_env, disagg, post_json, post_sse, server_info, spawn_engine_proc, stop_all, stream_text, wait_for,
    wait_healthy,
)

PER_TOKEN = 23040
TIMEOUT = 30  # VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT in this module
MOONCAKE = '{"kv_connector":"MooncakeConnector","kv_role":"%s"}'


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A kv_producer with 2 DP ranks (slow: speedup 0.5, chunked prefill 512) and a kv_consumer."""
    logs = tmp_path_factory.mktemp("pd-vllm")
    bport = free_port()
    env = child_env(VLLM_MOONCAKE_BOOTSTRAP_PORT=str(bport), VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT=str(TIMEOUT))
    common = ["--engine-flavor", "vllm", "--served-model-name", "smol", "--block-size", "16"]
    prefill = spawn_engine_proc([*common, "--data-parallel-size", "2", "--speedup", "0.5",
                                 "--max-num-batched-tokens", "512",
                                 "--kv-transfer-config", MOONCAKE % "kv_producer"], logs / "prefill.log", env, bport)
    decode = spawn_engine_proc([*common, "--speedup", "20", "--kv-transfer-config", MOONCAKE % "kv_consumer"],
                               logs / "decode.log", child_env())
    wait_healthy(prefill, decode)
    yield prefill, decode
    stop_all(prefill, decode)


def bootstrap_addr(prefill) -> str:
    return f"http://127.0.0.1:{prefill.bootstrap_port}"


async def engine_ids(s: aiohttp.ClientSession, prefill) -> dict[int, str]:
    async with s.get(bootstrap_addr(prefill) + "/query") as r:
        assert r.status == 200
        return {int(rank): entry["engine_id"] for rank, entry in (await r.json()).items()}


def halves(body: dict, prefill, engine_id: str, transfer_id: str | None = None) -> tuple[dict, dict]:
    """The prefill and decode bodies vLLM's mooncake proxy makes of a client body."""
    transfer_id = transfer_id or f"xfer-{uuid.uuid4()}"
    p = {**body, "stream": False, "max_tokens": 1,
         "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}}
    p.pop("stream_options", None)
    d = {**body, "kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": True,
                                        "remote_bootstrap_addr": bootstrap_addr(prefill),
                                        "remote_engine_id": engine_id, "transfer_id": transfer_id}}
    return p, d


async def test_roles_engine_ids_and_bootstrap_port_are_reported(pair):
    prefill, decode = pair
    async with aiohttp.ClientSession() as s:
        ids = await engine_ids(s, prefill)
        p, d = await server_info(s, prefill.url), await server_info(s, decode.url)
        async with s.get(bootstrap_addr(prefill) + "/health") as r:
            assert await r.text() == "OK"
    assert sorted(ids) == [0, 1] and ids[0] != ids[1]
    assert p["disaggregation"]["mode"] == "prefill" and p["disaggregation"]["kv_role"] == "kv_producer"
    assert p["disaggregation"]["bootstrap_port"] == prefill.bootstrap_port
    assert p["disaggregation"]["engine_ids"] == [ids[0], ids[1]]
    assert p["kv_transfer_config"]["kv_connector"] == "MooncakeConnector"
    assert d["disaggregation"]["mode"] == "decode" and d["disaggregation"]["bootstrap_port"] is None


@pytest.mark.parametrize("stream", [False, True])
async def test_proxy_style_pair_moves_the_kv_of_the_pinned_rank(pair, stream):
    prefill, decode = pair
    messages = [{"role": "user", "content": f"What is {random.randrange(10**9)} + 1?"}]  # not cached anywhere yet
    body = {"model": "smol", "messages": messages, "max_tokens": 5, "temperature": 0, "stream": stream}
    async with aiohttp.ClientSession() as s:
        ids = await engine_ids(s, prefill)
        rank = random.randrange(2)
        pbody, dbody = halves(body, prefill, ids[rank])
        before = await disagg(s, prefill.url), await disagg(s, decode.url)
        cached0 = [x["num_cached_blocks"] for x in (await server_info(s, prefill.url))["internal_states"]]
        (ps, pres), (ds, events) = await asyncio.gather(
            post_json(s, prefill.url + "/v1/chat/completions", pbody, {"X-data-parallel-rank": str(rank)}),
            post_sse(s, decode.url + "/v1/chat/completions", dbody) if stream else
            post_json(s, decode.url + "/v1/chat/completions", dbody))
        after = await disagg(s, prefill.url), await disagg(s, decode.url)
        cached1 = [x["num_cached_blocks"] for x in (await server_info(s, prefill.url))["internal_states"]]
        received = metric_value(await (await s.get(decode.url + "/metrics")).text(),
                                "mock:kv_transfer_received_bytes_total")
    assert ps == 200 and ds == 200, (pres, events)
    assert "kv_transfer_params" in pres and pres["kv_transfer_params"] is None  # Mooncake returns none
    assert pres["usage"]["completion_tokens"] == 1
    first = pres["choices"][0]["message"]["content"]
    text = stream_text(events) if stream else events["choices"][0]["message"]["content"]
    assert text.startswith(first) and len(text) > len(first)
    kv_bytes = pres["usage"]["prompt_tokens"] * PER_TOKEN
    assert after[0]["kv_bytes_sent"] - before[0]["kv_bytes_sent"] == kv_bytes
    assert after[1]["kv_bytes_received"] - before[1]["kv_bytes_received"] == kv_bytes
    assert received >= kv_bytes
    assert cached1[rank] > cached0[rank] and cached1[1 - rank] == cached0[1 - rank]


async def test_a_decode_that_comes_first_waits_for_its_prefill(pair):
    prefill, decode = pair
    body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}
    async with aiohttp.ClientSession() as s:
        ids = await engine_ids(s, prefill)
        pbody, dbody = halves(body, prefill, ids[0])
        decoding = asyncio.create_task(post_json(s, decode.url + "/v1/completions", dbody))
        await wait_for(lambda: _queue(s, decode.url, "decode_transfer", 1))
        ps, _ = await post_json(s, prefill.url + "/v1/completions", pbody, {"X-data-parallel-rank": "0"})
        ds, dres = await decoding
    assert ps == 200 and ds == 200 and dres["usage"]["completion_tokens"] == 3


async def test_producer_client_gone_fails_the_pulling_decode_promptly(pair):
    prefill, decode = pair
    start = random.randrange(1000, 20000)
    body = {"model": "smol", "prompt": [start + i % 5000 for i in range(4000)], "max_tokens": 4}
    async with aiohttp.ClientSession() as s:
        ids = await engine_ids(s, prefill)
        pbody, dbody = halves(body, prefill, ids[1])
        decoding = asyncio.create_task(post_json(s, decode.url + "/v1/completions", dbody))
        await wait_for(lambda: _queue(s, decode.url, "decode_transfer", 1))
        prefilling = asyncio.create_task(post_json(s, prefill.url + "/v1/completions", pbody,
                                                   {"X-data-parallel-rank": "1"}))
        await wait_for(lambda: _running(s, prefill.url))
        prefilling.cancel()  # the proxy's prefill request goes away: vLLM aborts it, its KV is never sent
        t0 = time.monotonic()
        status, err = await decoding
        elapsed = time.monotonic() - t0
    assert status == 500 and err == {"error": {"message": "Internal server error", "type": "InternalServerError",
                                               "param": None, "code": 500}}
    assert elapsed < TIMEOUT / 3


async def test_an_unknown_engine_id_fails_the_decode_at_once(pair):
    prefill, decode = pair
    _, dbody = halves({"model": "smol", "messages": CHAT, "max_tokens": 2, "stream": True}, prefill, "no-such-engine")
    async with aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        status, events = await post_sse(s, decode.url + "/v1/chat/completions", dbody)
        elapsed = time.monotonic() - t0
        failures = (await disagg(s, decode.url))["failures"]
    assert status == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 500 and events[-2]["error"]["message"] == "Internal server error"
    assert {"side": "decode", "kind": "unknown_engine", "count": 1} in failures
    assert elapsed < TIMEOUT / 3


async def test_kv_transfer_params_the_role_cannot_serve_are_refused(pair):
    prefill, decode = pair
    body = {"model": "smol", "messages": CHAT, "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        pbody, dbody = halves(body, prefill, "e")
        status, err = await post_json(s, prefill.url + "/v1/chat/completions", dbody)  # a decode half to a producer
        assert status == 400 and "kv_producer" in err["error"]["message"]
        status, err = await post_json(s, decode.url + "/v1/chat/completions", pbody)
        assert status == 400 and "kv_consumer" in err["error"]["message"]
        no_id = {**pbody, "kv_transfer_params": {"do_remote_decode": True}}
        status, err = await post_json(s, prefill.url + "/v1/chat/completions", no_id)
        assert status == 400 and "transfer_id" in err["error"]["message"]
        received = (await disagg(s, decode.url))["kv_bytes_received"]
        status, ok = await post_json(s, decode.url + "/v1/chat/completions", body)  # no params: an ordinary request
        assert status == 200 and ok["usage"]["completion_tokens"] == 2
        assert (await disagg(s, decode.url))["kv_bytes_received"] == received


async def _queue(s, url: str, name: str, value: int) -> bool:
    return (await disagg(s, url))["queues"][name] == value


async def _running(s, url: str) -> bool:
    async with s.get(url + "/metrics") as r:
        return metric_value(await r.text(), "vllm:num_requests_running") >= 1
