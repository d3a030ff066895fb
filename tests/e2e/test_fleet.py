"""The whole path on real processes: client -> frontend -> router -> worker-agent -> mock engine, on the
NATS plane and on the no-broker plane (etcd, ``infera.server`` calling the engines over HTTP, ZMQ KV events)."""

from __future__ import annotations

import asyncio
import json
import shlex
import time
import urllib.request

import aiohttp
import openai
import pytest

from infera.client import InferaClient, InferaError
from infera_common.models import BUNDLED_MODEL_NAME
from tests.e2e.fleet import router_metrics_url, scrape

MODEL = BUNDLED_MODEL_NAME
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "1+1=?"}], "max_tokens": 12}


async def _post(fleet, path: str, body, headers=None):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    async with aiohttp.ClientSession() as s:
        async with s.post(fleet.url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}) as r:
            return r.status, r.headers.copy(), await r.read()


async def _sse(fleet, path: str, body):
    events = []
    async with aiohttp.ClientSession() as s:
        async with s.post(fleet.url + path, json=body) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            raw = await r.read()
    for block in raw.decode().split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            events.append(block[len("data: "):])
    return events


async def test_chat_non_streaming_counts_prompt_with_real_template(fleet):
    status, headers, body = await _post(fleet, "/v1/chat/completions", CHAT, {"X-Request-Id": "e2e-chat-1"})
    assert status == 200, body
    data = json.loads(body)
    assert headers["X-Request-Id"] == "e2e-chat-1"
    assert "e2e-chat-1" in data["id"]  # the engine saw the client's request id
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"]["content"]
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["prompt_tokens"] == 35  # SmolLM2's chat template around "1+1=?"
    assert data["usage"]["completion_tokens"] == 12


async def test_chat_streaming_sse_with_usage(fleet):
    events = await _sse(fleet, "/v1/chat/completions",
                        {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


async def test_completions_text_and_token_ids(fleet):
    status, _, body = await _post(fleet, "/v1/completions", {"model": MODEL, "prompt": "Hello, world", "max_tokens": 5})
    assert status == 200, body
    text_answer = json.loads(body)
    assert text_answer["usage"]["prompt_tokens"] == 3
    status, _, body = await _post(fleet, "/v1/completions",
                                  {"model": MODEL, "prompt": [19556, 28, 905], "max_tokens": 5})
    assert status == 200, body
    assert json.loads(body)["usage"]["prompt_tokens"] == 3
    events = await _sse(fleet, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True})
    assert events[-1] == "[DONE]" and len(events) >= 2


async def test_same_seed_same_text_through_the_fleet(fleet):
    body = {**CHAT, "temperature": 0.8, "seed": 7}
    answers = set()
    for _ in range(4):  # round-robin: lands on both engines
        status, _, raw = await _post(fleet, "/v1/chat/completions", body)
        assert status == 200
        answers.add(json.loads(raw)["choices"][0]["message"]["content"])
    assert len(answers) == 1


async def test_nats_client_chat_and_stream(fleet):
    if fleet.plane != "nats":
        pytest.skip("the NATS API needs a NATS server")
    client = InferaClient(fleet.nats_url)
    await client.connect()
    try:
        answer = await client.chat(CHAT)
        assert answer["usage"]["prompt_tokens"] == 35
        chunks = [c async for c in client.stream_chat({**CHAT, "stream": True})]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        with pytest.raises(InferaError) as err:
            await client.chat({**CHAT, "model": "no-such-model"})
        assert err.value.status == 404
        models = await client.models()
        assert [m["id"] for m in models["data"]] == [MODEL]
    finally:
        await client.close()


def test_official_openai_sdk(fleet):
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=6)
    assert answer.choices[0].message.content and answer.usage.completion_tokens == 6
    stream = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=6, stream=True,
                                            stream_options={"include_usage": True})
    pieces = list(stream)
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
    assert pieces[-1].usage.completion_tokens == 6
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-nothing", messages=CHAT["messages"])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=-3)


def test_batched_prompts_n_samples_and_logprobs_reach_the_client_as_the_engine_sent_them(fleet):
    """A completions batch (one choice per prompt), n samples and logprobs, asked through the official SDK:
    what the engine answers reaches the client whole, streamed or not, and the batch's summed
    prompt count matches the frontend's own (no token mismatch counted)."""
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0)
    mismatches = scrape(fleet.url).get("infera_frontend_token_mismatch_total", 0.0)
    batch = client.completions.create(model=MODEL, prompt=["The sky is", "Rivers flow to the"], max_tokens=4)
    assert sorted(c.index for c in batch.choices) == [0, 1] and all(c.text for c in batch.choices)
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=1).usage.prompt_tokens
               for p in ("The sky is", "Rivers flow to the")]
    assert batch.usage.prompt_tokens == sum(singles) and batch.usage.completion_tokens == 8
    streamed = list(client.completions.create(model=MODEL, prompt=[[19556, 28], [905, 28, 19556]], max_tokens=3,
                                              stream=True, stream_options={"include_usage": True}))
    assert {c.choices[0].index for c in streamed if c.choices} == {0, 1}
    assert streamed[-1].usage.prompt_tokens == 5
    answer = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=5, logprobs=True,
                                            top_logprobs=2)
    content = answer.choices[0].logprobs.content
    assert len(content) == 5 and "".join(t.token for t in content) == answer.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    pieces = list(client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=5, logprobs=True,
                                                 stream=True))
    streamed_lp = [t for p in pieces if p.choices and p.choices[0].logprobs for t in p.choices[0].logprobs.content]
    assert len(streamed_lp) == 5
    with pytest.raises(openai.BadRequestError):  # the engine's refusal passes through
        client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=2, top_logprobs=30,
                                       logprobs=True)
    samples = client.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=6, n=3,
                                             temperature=0.9, seed=5)
    assert sorted(c.index for c in samples.choices) == [0, 1, 2]
    assert len({c.message.content for c in samples.choices}) == 3  # three samples, not one thrice
    assert samples.usage.prompt_tokens == answer.usage.prompt_tokens and samples.usage.completion_tokens == 18
    assert scrape(fleet.url).get("infera_frontend_token_mismatch_total", 0.0) == mismatches


async def test_round_robin_sends_traffic_to_both_workers(rr_fleet):
    fleet = rr_fleet
    workers = fleet.workers_list()
    assert len(workers) == 2 and {w["status"] for w in workers} == {"active"}
    before = [scrape(w["url"]).get("sglang:prompt_tokens_total", 0.0) for w in workers]
    for _ in range(6):
        status, _, _ = await _post(fleet, "/v1/chat/completions", CHAT)
        assert status == 200
    after = [scrape(w["url"]).get("sglang:prompt_tokens_total", 0.0) for w in workers]
    assert all(a - b >= 35 * 2 for a, b in zip(after, before)), (before, after)



async def test_session_affinity_keeps_each_sessions_turns_on_one_worker(rr_fleet):
    """Round-robin spreads requests without a session; with X-Dynamo-Session-ID each session's turns
    all land on the worker of its first turn (the engines' prompt counters tell where they ran)."""
    fleet = rr_fleet
    workers = fleet.workers_list()

    def counts() -> list[float]:
        return [scrape(w["url"]).get("sglang:prompt_tokens_total", 0.0) for w in workers]

    for session in ("alpha", "beta", "gamma"):
        before = counts()
        for turn in range(4):
            status, _, raw = await _post(fleet, "/v1/chat/completions", CHAT, {"X-Dynamo-Session-ID": session})
            assert status == 200, raw
        moved = [a - b for a, b in zip(counts(), before)]
        assert sorted(m > 0 for m in moved) == [False, True], (session, moved)  # one worker took all four
    status, _, raw = await _post(fleet, "/v1/chat/completions", CHAT,
                                 {"X-Dynamo-Session-ID": "x" * 1025})
    assert status == 400 and b"1024" in raw

@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/v1/chat/completions", b"{not json", 400),
        ("/v1/chat/completions", {"model": MODEL}, 400),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
        ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404),
        ("/v1/chat/completions", {**CHAT, "max_tokens": -1}, 400),
        ("/v1/completions", {"model": MODEL}, 400),
        ("/v1/chat/completions", {**CHAT, "n": 0}, 400),
    ],
)
async def test_bad_input_gets_openai_error_and_services_stay_up(fleet, path, body, status):
    got, _, raw = await _post(fleet, path, body)
    assert got == status, raw
    err = json.loads(raw)["error"]
    assert err["message"] and err["type"]
    ok, _, _ = await _post(fleet, "/v1/chat/completions", CHAT)
    assert ok == 200


async def test_oversize_body_413(fleet):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (9 * 1024 * 1024)}]}
    got, _, raw = await _post(fleet, "/v1/chat/completions", big)
    assert got == 413, raw[:200]
    assert json.loads(raw)["error"]["message"]


def _running(workers) -> float:
    """The requests the engines run, summed over the fleet's workers (their own gauges)."""
    return sum(scrape(w["url"]).get("sglang:num_running_reqs", 0) for w in workers)


async def _until_running(workers, want: int, timeout: float = 3.0) -> float:
    deadline = time.monotonic() + timeout
    while (running := _running(workers)) != want and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return running


async def test_client_disconnect_mid_stream_aborts_engine_request(fleet):
    workers = fleet.workers_list()
    body = {**CHAT, "max_tokens": 4000, "stream": True}
    async with aiohttp.ClientSession() as s:
        resp = await s.post(fleet.url + "/v1/chat/completions", json=body)
        assert resp.status == 200
        await resp.content.readline()  # the stream has started
        assert _running(workers) >= 1
        resp.close()  # the client goes away
    deadline = time.monotonic() + 1.0  # the engine request is aborted within 1 s
    while time.monotonic() < deadline:
        running = _running(workers)
        if running == 0:
            break
        await asyncio.sleep(0.05)
    assert running == 0


async def test_requests_given_one_x_request_id_at_once_are_served_and_cancelled_apart(ll_fleet):
    """A client library that sends a fixed X-Request-Id, or a retry while the first try still runs:
    three streams at once under one id (two workers, so two share one) each get their answer, each
    sees its id echoed, and the one whose client leaves is the only one the engines stop. (The
    engines at speedup 2: the answers run for seconds, however late the test looks at them.)"""
    fleet = ll_fleet
    workers = fleet.workers_list()
    body = {**CHAT, "max_tokens": 4000, "stream": True}
    async with aiohttp.ClientSession() as s:
        streams = [await s.post(fleet.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "dup-1"})
                   for _ in range(3)]
        try:
            for resp in streams:
                assert resp.status == 200, await resp.text()
                assert resp.headers["X-Request-Id"] == "dup-1"
                assert (await resp.content.readline()).startswith(b"data: {")
            assert await _until_running(workers, 3) == 3
            streams[0].close()  # one client goes away
            assert await _until_running(workers, 2) == 2
            for resp in streams[1:]:  # the other two still stream their answers
                lines = [await resp.content.readline() for _ in range(4)]
                assert any(line.startswith(b"data: {") for line in lines), lines
        finally:
            for resp in streams:
                resp.close()
    assert await _until_running(workers, 0) == 0


async def test_engine_error_passes_through_and_no_lease_is_left_behind(fleet):
    # a token id past the vocabulary: only the engine knows its vocabulary, so the engine refuses it
    bad_id = {"model": MODEL, "prompt": [10**7], "max_tokens": 2}
    status, _, raw = await _post(fleet, "/v1/completions", bad_id)
    assert status == 400, raw
    assert "vocabulary" in json.loads(raw)["error"]["message"]
    # a mix of every path: completed, streamed, engine error, client gone mid-stream
    async with aiohttp.ClientSession() as s:
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/chat/completions", {**CHAT, "stream": True}),
                           ("/v1/completions", bad_id)):
            async with s.post(fleet.url + path, json=body) as r:
                await r.read()
        resp = await s.post(fleet.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 4000, "stream": True})
        await resp.content.readline()
        resp.close()
    metrics = router_metrics_url(fleet)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        leases = scrape(metrics).get("infera_router_active_leases", -1)
        if leases == 0:
            break
        await asyncio.sleep(0.1)
    assert leases == 0
    assert scrape(metrics).get("infera_router_lease_releases_total", 0) >= 5


async def test_long_agentic_prompt_over_a_mebibyte_on_the_bus_is_served(fleet):
    # ~200k token ids: the JSON body plus the routing token ids exceed nats-server's 1 MiB default
    ids = [(i * 7919) % 40000 + 100 for i in range(200_000)]
    # vLLM's truncate_prompt_tokens lets it past the frontend's context check; the mock engine does
    # not cut prompts, so it refuses the 200,000 tokens itself, in its own words: it got there
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "truncate_prompt_tokens": 4000}
    status, _, raw = await _post(fleet, "/v1/completions", body)
    assert status == 400, raw[:300]
    assert "the prompt has 200000 tokens" in json.loads(raw)["error"]["message"], raw[:300]


def test_a_request_longer_than_the_context_length_is_refused_by_the_frontend_in_openai_words(fleet):
    """The workers' records carry the engine's context length (8192 for the bundled model): a prompt
    that fills it, or a prompt plus max_tokens past it, is refused before any routing, with the
    code OpenAI clients look for."""
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="-", max_retries=0)
    long_text = " ".join(["hello"] * 9000)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_text}], max_tokens=4)
    err = caught.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages", err
    assert "maximum context length is 8192 tokens" in err["message"], err
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hello there", max_tokens=8191)  # 2 + 8191 tokens
    err = caught.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens", err
    assert "8192" in err["message"] and "8191 in the completion" in err["message"], err
    ok = client.completions.create(model=MODEL, prompt="hello there", max_tokens=3)  # within it: served
    assert ok.usage.completion_tokens == 3


async def test_kv_aware_routing_sends_a_follow_up_turn_to_the_engine_holding_its_prefix(fleet):
    """Multi-turn traffic: each follow-up lands where its conversation's KV cache is (cached_tokens)."""
    hits = []
    for conv in range(4):
        history = [(conv * 1000 + i) % 40000 + 100 for i in range(640)]  # 10 blocks of 64
        status, _, raw = await _post(fleet, "/v1/completions", {"model": MODEL, "prompt": history, "max_tokens": 2})
        assert status == 200, raw
        assert json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        await asyncio.sleep(0.5)  # the engine's KV events reach the index
        follow_up = history + [5000 + conv] * 70
        status, _, raw = await _post(fleet, "/v1/completions", {"model": MODEL, "prompt": follow_up, "max_tokens": 2})
        assert status == 200, raw
        hits.append(json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"])
    # round-robin would put every follow-up on the other engine (no hit); kv-aware finds the prefix
    assert all(h >= 576 for h in hits), hits


async def test_engine_events_reach_the_index_and_route_to_the_engine_that_cached(fleet):
    """Engine -> index (NATS plane: agent -> JetStream -> kv-indexer; no-broker: the server's index reads the
    engine's ZMQ publisher): a prompt sent straight to one engine is then routed there, from its cache."""
    from infera_common.block_hash import block_hashes

    workers = fleet.workers_list()
    target, other = workers[0], workers[1]
    block = target["kv_block_size"]
    assert block and other["kv_block_size"] == block
    prompt = [(i * 31) % 40000 + 100 for i in range(10 * block)]
    async with aiohttp.ClientSession() as s:  # straight to one engine, bypassing the router
        async with s.post(target["url"] + "/v1/completions",
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 1}) as r:
            assert r.status == 200
    if fleet.plane == "nats":  # ask the kv-indexer itself
        import nats

        from infera_common.schemas import OverlapQuery, OverlapReply, decode, encode
        from infera_common.subjects import KV_QUERY

        nc = await nats.connect(fleet.nats_url)
        try:
            query = encode(OverlapQuery(model=MODEL, hashes={block: block_hashes(prompt, block)}))
            depths: dict[str, int] = {}
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                reply = decode(OverlapReply, (await nc.request(KV_QUERY, query, timeout=2)).data)
                depths = {o.worker_id: o.blocks for o in reply.overlaps}
                if depths.get(target["worker_id"]) == 10:
                    break
                await asyncio.sleep(0.1)
        finally:
            await nc.close()
        assert depths.get(target["worker_id"]) == 10 and depths.get(other["worker_id"], 0) == 0
    await asyncio.sleep(0.5)  # the events reach the index
    for _ in range(3):  # through the fleet: every time on the engine that holds the prompt
        status, _, raw = await _post(fleet, "/v1/completions", {"model": MODEL, "prompt": prompt + [7], "max_tokens": 1})
        assert status == 200, raw
        assert json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] == 10 * block


async def test_least_loaded_weighs_a_request_by_its_samples(ll_fleet):
    """A request for 4 samples runs 4 sequences on its engine: the next three single requests all
    go to the other worker, which then runs 3 (counting requests, the second would tie at 1 against
    1 and the third go to the busy one)."""
    workers = ll_fleet.workers_list()
    body = {**CHAT, "max_tokens": 4000, "stream": True}

    def running() -> list[float]:
        return sorted(scrape(w["url"]).get("sglang:num_running_reqs", 0) for w in workers)

    async with aiohttp.ClientSession() as s:
        streams = []
        try:
            for extra in ({"n": 4}, {}, {}, {}):  # one at a time: each placed after the last one started
                resp = await s.post(ll_fleet.url + "/v1/chat/completions", json={**body, **extra})
                streams.append(resp)
                assert resp.status == 200, await resp.text()
                await resp.content.readline()  # its stream has started
            deadline = time.monotonic() + 3  # an engine's gauge may trail the stream's first line by a step
            while (now := running()) != [3, 4] and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert now == [3, 4]
        finally:
            for resp in streams:
                resp.close()


async def test_a_non_streaming_answer_longer_than_the_upstream_timeout_arrives_whole(slow_fleet):
    # the worker says every second that the engine still works on it; before, the frontend gave up
    # after --upstream-timeout (504), tried the other worker, and gave up there too
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 2500}
    started = time.monotonic()
    status, _, raw = await _post(slow_fleet, "/v1/completions", body)
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 2500
    assert time.monotonic() - started > 3  # (it did outlast the timeout)
    if slow_fleet.plane == "nats":  # a NATS client whose own timeout is shorter still than the answer
        async with InferaClient(slow_fleet.nats_url, timeout=2) as client:
            reply = await client.completions(body)
        assert reply["usage"]["completion_tokens"] == 2500


def test_the_curl_line_infera_up_prints_works_as_printed(fleet):
    """Users copy it: its URL and body (the model the workers serve) must give an answer."""
    [curl] = [line.strip() for line in fleet.banner.splitlines() if line.strip().startswith("curl ")]
    argv = shlex.split(curl)
    url, body = argv[1], json.loads(argv[argv.index("-d") + 1])
    assert body["model"] == fleet.workers_list()[0]["model"]
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200 and json.load(resp)["choices"][0]["message"]["content"]
