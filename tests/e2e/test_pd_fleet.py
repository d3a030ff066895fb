"""Disaggregated serving on real processes: `infera up --prefill-workers 1 --decode-workers 1`.

One prefill and one decode mock engine (SGLang bootstrap protocol), each behind its worker-agent;
the KV of every prompt really crosses a TCP connection between the two engines."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from infera_common.models import BUNDLED_MODEL_NAME
from tests.e2e.fleet import Fleet, engine_pid, env_with, router_metrics_url, scrape
from tests.waiting import eventually

CHAT = {"model": BUNDLED_MODEL_NAME, "messages": [{"role": "user", "content": "Tell me about prefill."}],
        "max_tokens": 16}
#: KV bytes per second between the engines: slow enough that a long prompt is still crossing when
#: the test kills the decode engine (the bundled model's KV is 23,040 bytes per token)
BANDWIDTH = 4_000_000


@pytest.fixture(scope="module", params=[("sglang-bootstrap", 1, "nats"), ("sglang-bootstrap", 8, "nats"),
                                        ("vllm-mooncake", 1, "nats"), ("sglang-bootstrap", 1, "no-broker"),
                                        ("vllm-mooncake", 1, "no-broker")],
                ids=["sglang-dp1", "sglang-dp8", "vllm-dp1", "sglang-dp1-no-broker", "vllm-dp1-no-broker"])
def pd_fleet(tmp_path_factory, request):
    """1P1D; the same with 8 DP-attention ranks on each side; and with vLLM's Mooncake handshake; the
    first and the last also on the no-broker plane (the router's own HTTP calls carry both legs)."""
    protocol, dp, plane = request.param
    f = Fleet(tmp_path_factory.mktemp("pd-fleet"), workers=0, plane=plane,
              extra=["--prefill-workers", "1", "--decode-workers", "1", "--pd-protocol", protocol,
                     f"--engine-arg=--dp-size {dp}",
                     "--engine-arg=--speedup 20", f"--engine-arg=--kv-transfer-bandwidth {BANDWIDTH}"],
              env=env_with(INFERA_DISCOVERY_TTL="2", SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT="20",
                           SGLANG_DISAGGREGATION_WAITING_TIMEOUT="20")).start()
    f.dp_size, f.protocol = dp, protocol
    yield f
    f.stop()


def engines(fleet) -> dict[str, str]:
    return {w["role"]: w["url"] for w in fleet.workers_list()}


def router_leases(fleet) -> float:
    return scrape(router_metrics_url(fleet)).get("infera_router_active_leases", 0.0)




def test_workers_list_the_two_roles_with_their_protocol(pd_fleet):
    workers = {w["role"]: w for w in pd_fleet.workers_list()}
    assert set(workers) == {"prefill", "decode"}
    assert workers["prefill"]["pd"]["protocol"] == pd_fleet.protocol
    assert workers["prefill"]["pd"]["bootstrap_port"] > 0  # the port the engine bound, as it reported
    assert workers["prefill"]["dp_size"] == workers["decode"]["dp_size"] == pd_fleet.dp_size


@pytest.mark.parametrize("stream", [False, True])
async def test_a_chat_completion_goes_through_the_pair_and_its_kv_crosses(pd_fleet, stream):
    urls = engines(pd_fleet)
    sent0 = scrape(urls["prefill"]).get("mock:kv_transfer_sent_bytes_total", 0.0)
    got0 = scrape(urls["decode"]).get("mock:kv_transfer_received_bytes_total", 0.0)
    async with aiohttp.ClientSession() as s:
        async with s.post(pd_fleet.url + "/v1/chat/completions", json={**CHAT, "stream": stream}) as r:
            raw = await r.read()
            assert r.status == 200, raw
    if stream:
        events = [b[len("data: "):] for b in raw.decode().split("\n\n") if b]
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                       for e in events[:-1] if json.loads(e)["choices"])
        prompt_tokens = None
    else:
        data = json.loads(raw)
        text = data["choices"][0]["message"]["content"]
        prompt_tokens = data["usage"]["prompt_tokens"]
        assert data["usage"]["completion_tokens"] == 16
    assert text
    sent = scrape(urls["prefill"])["mock:kv_transfer_sent_bytes_total"] - sent0
    got = scrape(urls["decode"])["mock:kv_transfer_received_bytes_total"] - got0
    assert sent == got > 0
    if prompt_tokens is not None:
        assert sent == prompt_tokens * 23040  # prompt tokens x the model's KV bytes per token
    await eventually(lambda: router_leases(pd_fleet) == 0)


@pytest.mark.parametrize(("path", "extra", "what"), [
    ("/v1/chat/completions", {"n": 2}, "n=2"),
    ("/v1/completions", {"prompt": ["one", "two"]}, "a batch of 2 prompts"),
])
async def test_a_request_for_several_sequences_is_refused_with_what_to_do(pd_fleet, path, extra, what):
    body = {**CHAT, **extra}
    if path == "/v1/completions":
        body.pop("messages")
    async with aiohttp.ClientSession() as s, s.post(pd_fleet.url + path, json=body) as r:
        answer = await r.json()
    assert r.status == 400, answer
    assert what in answer["error"]["message"] and "one request per sequence" in answer["error"]["message"]
    await eventually(lambda: router_leases(pd_fleet) == 0)


async def test_killing_the_decode_engine_mid_request_aborts_the_prefill_leg(pd_fleet):
    """(vLLM: the prefill has answered before the decode pulls; the client still gets an error and no
    lease is left.)"""
    urls = engines(pd_fleet)
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "word " * 600}], "max_tokens": 64}
    cancelled0 = scrape(router_metrics_url(pd_fleet)).get("infera_router_pd_legs_cancelled_total", 0.0)

    async def ask():
        async with aiohttp.ClientSession() as s:
            async with s.post(pd_fleet.url + "/v1/chat/completions", json=long_chat) as r:
                return r.status, await r.read()

    got0 = scrape(urls["decode"]).get("mock:kv_transfer_received_bytes_total", 0.0)
    request = asyncio.create_task(ask())
    # the prompt's KV (about 14 MB at 4 MB/s) is crossing: kill the decode engine now
    await eventually(lambda: scrape(urls["decode"]).get("mock:kv_transfer_received_bytes_total", 0.0) > got0)
    vllm = pd_fleet.protocol == "vllm-mooncake"
    if not vllm:  # SGLang's prefill leg runs until its KV is sent; vLLM's has answered before the pull
        assert scrape(urls["prefill"]).get("sglang:num_prefill_inflight_queue_reqs", 0.0) == 1
    os.kill(engine_pid(urls["decode"]), signal.SIGKILL)
    status, body = await asyncio.wait_for(request, 30)
    assert status >= 500, body
    if vllm:  # nothing of the prefill leg is left to stop: the accounting must still be zero
        await eventually(lambda: router_leases(pd_fleet) == 0, timeout=20)
        return
    await eventually(lambda: not any(v for k, v in scrape(urls["prefill"]).items()
                                     if k.startswith("sglang:num_") and k.endswith("_reqs")), timeout=20)
    await eventually(lambda: router_leases(pd_fleet) == 0, timeout=20)
    metrics = scrape(router_metrics_url(pd_fleet))
    assert metrics.get("infera_router_pd_legs_cancelled_total", 0.0) > cancelled0


@pytest.fixture(scope="module", params=[("vllm-mooncake", "nats"), ("vllm-mooncake", "no-broker"),
                                        ("sglang-bootstrap", "nats"), ("sglang-bootstrap", "no-broker")],
                ids=["vllm", "vllm-no-broker", "sglang", "sglang-no-broker"])
def slow_pd(tmp_path_factory, request):
    """1P1D at speedup 1, behind a frontend whose --route-timeout is 0.5 s and --upstream-timeout 3 s:
    a 30k-token prefill takes ~1 s, a 1,000-token answer ~5.5 s."""
    protocol, plane = request.param
    f = Fleet(tmp_path_factory.mktemp("slow-pd"), workers=0, plane=plane,
              extra=["--prefill-workers", "1", "--decode-workers", "1", "--pd-protocol", protocol,
                     "--engine-arg=--speedup 1", "--engine-arg=--context-length 65536"],
              env=env_with(INFERA_DISCOVERY_TTL="2", INFERA_ROUTE_TIMEOUT="0.5", INFERA_UPSTREAM_TIMEOUT="3")).start()
    f.protocol = protocol
    yield f
    f.stop()


async def test_a_prefill_longer_than_the_route_timeout_is_served(slow_pd):
    # with vLLM's handshake the router names the decode worker only after the prefill: it tells the
    # frontend meanwhile that it is at work (before, the frontend answered 503 "router unavailable"
    # after --route-timeout); SGLang's pair is named at once
    ids = [100 + (i * 7919) % 40000 for i in range(30000)]
    body = {"model": BUNDLED_MODEL_NAME, "prompt": ids, "max_tokens": 4}
    async with aiohttp.ClientSession() as s:
        async with s.post(slow_pd.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            usage = (await r.json())["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (30000, 4)


async def test_a_non_streaming_answer_of_a_pair_longer_than_the_upstream_timeout_arrives_whole(slow_pd):
    # the decode worker says every second that its engine still works on the request (a hung one
    # would be found: vLLM's by the stall check, SGLang's by its generating /health); before, the
    # frontend gave up after --upstream-timeout (504) and tried another pair, where the same happened
    body = {"model": BUNDLED_MODEL_NAME, "prompt": "Tell me a long story", "max_tokens": 1000}
    started = time.monotonic()
    async with aiohttp.ClientSession() as s:
        async with s.post(slow_pd.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            usage = (await r.json())["usage"]
    assert usage["completion_tokens"] == 1000
    assert time.monotonic() - started > 3  # (it did outlast the timeout)


@pytest.fixture(scope="module", params=["nats", "no-broker"])
def two_prefills(tmp_path_factory, request):
    """2P1D with vLLM's handshake at speedup 1: a 30k-token prefill takes about a second."""
    f = Fleet(tmp_path_factory.mktemp("two-prefills"), workers=0, plane=request.param,
              extra=["--prefill-workers", "2", "--decode-workers", "1", "--pd-protocol", "vllm-mooncake",
                     "--engine-arg=--speedup 1", "--engine-arg=--context-length 65536"],
              env=env_with(INFERA_DISCOVERY_TTL="2")).start()
    yield f
    f.stop()


async def test_a_prefill_engine_that_dies_during_its_prefill_is_replaced_by_the_other_prefill(two_prefills):
    """Nothing was handed over to the decode yet: the router sends the prefill to the model's other
    prefill worker, and the client gets its answer (it got a 502 'prefill worker … failed')."""
    prefills = [w["url"] for w in two_prefills.workers_list() if w["role"] == "prefill"]
    assert len(prefills) == 2
    body = {"model": BUNDLED_MODEL_NAME, "prompt": [100 + (i * 7919) % 40000 for i in range(30000)], "max_tokens": 4}

    async def ask():
        async with aiohttp.ClientSession() as s:
            async with s.post(two_prefills.url + "/v1/completions", json=body) as r:
                return r.status, await r.read()

    request = asyncio.create_task(ask())
    busy: list[str] = []
    deadline = time.monotonic() + 10
    while not busy and time.monotonic() < deadline:
        busy = [u for u in prefills if scrape(u).get("vllm:num_requests_running", 0.0) >= 1]
        await asyncio.sleep(0.02)
    assert busy, "no prefill engine took the request"
    os.kill(engine_pid(busy[0]), signal.SIGKILL)
    status, raw = await asyncio.wait_for(request, 60)
    assert status == 200, raw
    assert json.loads(raw)["usage"]["prompt_tokens"] == 30000
