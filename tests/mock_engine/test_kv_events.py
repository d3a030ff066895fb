"""KV events on real ZMQ sockets, decoded with Infera's own decoder (infera_common.kv_wire)."""

from __future__ import annotations

import asyncio
import json

import msgpack
import pytest
import zmq
import zmq.asyncio

from infera.procs import free_port
from infera_common.kv_wire import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, decode_seq
from infera_mock_engine.kv_publisher import PublisherError

from .conftest import KV_PAGE, metric_value

PAGE = KV_PAGE
PROMPT_A = list(range(1000, 1060))  # 60 tokens: 3 full blocks
PROMPT_B = list(range(2000, 2100))  # 100 tokens: 7 blocks with its first output token


def kv_config(**extra) -> str:
    return json.dumps({"publisher": "zmq", "enable_kv_cache_events": True, "endpoint": "tcp://*:0",
                       "replay_endpoint": "tcp://*:0", "topic": "kv", **extra})


def local(endpoint: str) -> str:
    """A bound wildcard endpoint as a client dials it."""
    return endpoint.replace("0.0.0.0", "127.0.0.1").replace("*", "127.0.0.1")


class Subscriber:
    """A ZMQ SUB socket collecting (topic, seq, payload) messages."""

    def __init__(self, endpoint: str, bind: bool = False) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        if bind:
            self.sock.bind(endpoint)
        else:
            self.sock.connect(endpoint)

    async def recv(self, timeout: float = 5.0) -> tuple[bytes, int, bytes]:
        topic, seq, payload = await asyncio.wait_for(self.sock.recv_multipart(), timeout)
        return topic, decode_seq(seq), payload

    async def sync(self, client) -> None:
        """Wait until the subscription is live (flushing the idle engine publishes a batch), then drain."""
        for _ in range(100):
            status, _ = await client.post_raw("/flush_cache")
            assert status == 200
            try:
                await self.recv(timeout=0.1)
                break
            except asyncio.TimeoutError:
                continue
        else:
            raise AssertionError("the subscriber never received anything")
        while True:
            try:
                await self.recv(timeout=0.3)
            except asyncio.TimeoutError:
                return

    async def collect(self, quiet: float = 0.3) -> list[tuple[bytes, int, bytes]]:
        """Every message until none came for `quiet` seconds (the first may take up to 5 s)."""
        out = [await self.recv(timeout=5.0)]
        while True:
            try:
                out.append(await self.recv(timeout=quiet))
            except asyncio.TimeoutError:
                return out

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


async def complete(client, prompt: list[int]) -> dict:
    status, body = await client.post("/v1/completions", {"model": "smol", "prompt": prompt, "max_tokens": 4})
    assert status == 200, body
    return body


@pytest.mark.parametrize("flavor", ["sglang", "vllm"])
async def test_events_of_reuse_eviction_and_flush_reach_a_subscriber_in_the_flavours_encoding(kv_engine, flavor):
    client = await kv_engine(flavor, "--kv-events-config", kv_config())
    status, sources = await client.get_json("/kv_event_sources")
    assert status == 200 and isinstance(sources, dict) and list(sources) == ["0"]  # vLLM 0.32: by DP rank
    source = sources["0"]
    assert source["topic"] == "kv" and source["enable_kv_cache_events"] is True and source["publisher"] == "zmq"
    assert source["endpoint"].startswith("tcp://") and not source["endpoint"].endswith(":0")
    _, info = await client.get_json("/server_info")
    kv = info["kv_events"]
    assert info["page_size"] == PAGE and info["block_size"] == PAGE and kv["block_size"] == PAGE
    assert kv["endpoint"] == source["endpoint"] and kv["replay_endpoint"] == source["replay_endpoint"]
    assert kv["endpoint_port_base"] == int(source["endpoint"].rsplit(":", 1)[1]) and kv["endpoint_host"] == "*"

    sub = Subscriber(local(source["endpoint"]))
    try:
        await sub.sync(client)
        first = await complete(client, PROMPT_A)
        again = await complete(client, PROMPT_A)
        await complete(client, PROMPT_B)  # needs 7 of the 8 blocks: evicts A's cached tail
        assert (await client.post_raw("/flush_cache"))[0] == 200
        messages = await sub.collect()
    finally:
        sub.close()

    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 48  # 3 full blocks of A
    assert {topic for topic, _, _ in messages} == {b"kv"}
    seqs = [seq for _, seq, _ in messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive, one batch per step

    events = []
    for _, _, payload in messages:
        raw = msgpack.unpackb(payload, strict_map_key=False)
        batch = decode_batch(payload)
        assert batch.malformed == [] and batch.dp_rank == 0
        if flavor == "vllm":  # as vLLM 0.32 sends them: an array batch of map events
            assert isinstance(raw, list) and raw[2] == 0
            assert all(isinstance(e, dict) and "type" in e for e in raw[1])
            assert all(e["group_idx"] == 0 for e in raw[1] if e["type"] != "AllBlocksCleared")
        else:
            assert isinstance(raw, list) and raw[2] == 0
            assert all(isinstance(e, list) and isinstance(e[0], str) for e in raw[1])
        events.extend(batch.events)

    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert isinstance(events[-1], AllBlocksCleared)
    a_blocks = [e for e in stored if e.token_ids[:PAGE] == PROMPT_A[:PAGE] or e.token_ids[0] in PROMPT_A[PAGE:]]
    a_hashes = [h for e in a_blocks for h in e.block_hashes]
    a_tokens = [t for e in a_blocks for t in e.token_ids]
    assert a_tokens == PROMPT_A[:48] and len(a_hashes) == 3  # stored once: the repeat reused them
    assert a_blocks[0].parent_block_hash is None
    if flavor == "sglang":  # one event per block, each chained to the one before
        assert [len(e.block_hashes) for e in a_blocks] == [1, 1, 1]
        assert [e.parent_block_hash for e in a_blocks[1:]] == a_hashes[:2]
    else:  # one event per run of blocks
        assert len(a_blocks) == 1
    assert all(len(e.token_ids) == len(e.block_hashes) * e.block_size and e.block_size == PAGE for e in stored)
    assert all(e.medium == "GPU" and e.lora_id is None for e in stored)
    assert removed == [a_hashes[2], a_hashes[1]]  # A's tail first; B took the 5 empty blocks first
    every_hash = [h for e in stored for h in e.block_hashes]
    if flavor == "sglang":
        assert all(-(2**63) <= h < 2**63 for h in every_hash)
    else:
        assert all(0 <= h < 2**64 for h in every_hash)

    text = await client.metrics()
    if flavor == "vllm":
        assert metric_value(text, "vllm:prefix_cache_hits_total") == 48
        assert metric_value(text, "vllm:prefix_cache_queries_total") == 60 + 60 + 100
    else:
        assert metric_value(text, "sglang:cached_tokens_total") == 48


async def test_hashes_are_signed_in_the_sglang_flavour(kv_engine):
    client = await kv_engine("sglang", "--kv-events-config", kv_config(), "--num-kv-blocks", "64")
    _, sources = await client.get_json("/kv_event_sources")
    sub = Subscriber(local(sources["0"]["endpoint"]))
    try:
        await sub.sync(client)
        await complete(client, list(range(3000, 3000 + 40 * PAGE + 1)))  # 40 full blocks
        hashes = [h for _, _, p in await sub.collect() for e in decode_batch(p).events
                  if isinstance(e, BlockStored) for h in e.block_hashes]
    finally:
        sub.close()
    assert len(hashes) == 40 and any(h < 0 for h in hashes)  # all 40 non-negative: chance 2**-40


async def test_replay_returns_buffered_batches_from_a_start_seq_then_the_end_marker(kv_engine):
    client = await kv_engine("vllm", "--kv-events-config", kv_config(buffer_steps=3))
    _, sources = await client.get_json("/kv_event_sources")
    sub = Subscriber(local(sources["0"]["endpoint"]))
    try:
        await sub.sync(client)
        for i in range(3):
            await complete(client, list(range(4000 + 100 * i, 4000 + 100 * i + 40)))
        live = {seq: payload for _, seq, payload in await sub.collect()}
    finally:
        sub.close()
    last = max(live)
    assert last >= 3

    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(local(sources["0"]["replay_endpoint"]))

    async def replay(start: int) -> list[tuple[int, bytes]]:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:  # vLLM 0.32's framing: [b"", topic, seq, payload]; its end marker [b"", b"", -1, b""]
            empty, topic, seq, payload = await asyncio.wait_for(dealer.recv_multipart(), 5)
            assert empty == b""
            if decode_seq(seq) == END_SEQ:
                assert (topic, payload) == (b"", b"")
                return got
            assert topic == sources["0"]["topic"].encode()
            got.append((decode_seq(seq), payload))

    try:
        tail = await replay(last - 1)
        assert tail == [(last - 1, live[last - 1]), (last, live[last])]  # the very bytes published
        everything = await replay(0)
        assert [s for s, _ in everything] == [last - 2, last - 1, last]  # only the last buffer_steps batches
        assert await replay(last + 1) == []  # nothing newer: just the end marker
    finally:
        dealer.close(linger=0)
        ctx.term()


async def test_a_host_port_endpoint_connects_to_a_bound_subscriber(kv_engine):
    port = free_port()
    sub = Subscriber(f"tcp://127.0.0.1:{port}", bind=True)
    try:
        client = await kv_engine("sglang", "--kv-events-config", json.dumps(
            {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"}))
        _, info = await client.get_json("/server_info")
        assert info["kv_events"]["mode"] == "connect"
        assert info["kv_events"]["endpoint"] == f"tcp://127.0.0.1:{port}"
        await sub.sync(client)
        await complete(client, PROMPT_A)
        events = [e for _, _, p in await sub.collect() for e in decode_batch(p).events]
    finally:
        sub.close()
    assert [t for e in events if isinstance(e, BlockStored) for t in e.token_ids] == PROMPT_A[:48]


@pytest.mark.parametrize("flavor,config", [
    ("vllm", {"publisher": "zmq", "endpoint": "tcp://*:0"}),  # vLLM needs enable_kv_cache_events
    ("sglang", {"enable_kv_cache_events": True, "endpoint": "tcp://*:0"}),  # SGLang needs publisher zmq
    ("vllm", {"enable_kv_cache_events": True, "publisher": "null"}),
])
async def test_configs_the_engine_would_not_publish_with_publish_nothing(kv_engine, flavor, config):
    client = await kv_engine(flavor, "--kv-events-config", json.dumps(config))
    assert (await client.get_json("/kv_event_sources"))[1] == {}
    assert (await client.get_json("/server_info"))[1]["kv_events"] is None


async def test_a_busy_events_port_stops_the_engine_with_a_clear_error(start_engine):
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    taken.setsockopt(zmq.LINGER, 0)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(PublisherError, match=f"cannot bind the KV events endpoint 'tcp://\\*:{port}'"):
            await start_engine("--kv-events-config", json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{port}"}))
    finally:
        taken.close()
        ctx.term()


async def test_flush_and_reset_are_refused_while_a_request_holds_blocks(kv_engine):
    client = await kv_engine("vllm", "--kv-events-config", kv_config(), "--speedup", "1")
    scheduler = client.server.engine.scheduler
    _, sources = await client.get_json("/kv_event_sources")
    sub = Subscriber(local(sources["0"]["endpoint"]))
    try:
        await sub.sync(client)
        task = asyncio.create_task(client.post("/v1/completions", {"prompt": list(range(5000, 5020)),
                                                                   "max_tokens": 100}))  # ~1 s at speedup 1
        for _ in range(500):
            if scheduler.num_running:
                break
            await asyncio.sleep(0.01)
        status, text = await client.post_raw("/flush_cache")
        assert status == 400 and "not be performed" in text  # SGLang: refused while requests run
        assert (await client.post_raw("/reset_prefix_cache"))[0] == 200  # vLLM answers 200 regardless...
        assert scheduler.num_running == 1 and scheduler.stats.preemptions == 0
        assert (await client.post_raw("/reset_prefix_cache?reset_running_requests=true"))[0] == 200
        assert scheduler.stats.preemptions == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        events = [e for _, _, p in await sub.collect() for e in decode_batch(p).events]
    finally:
        sub.close()
    cleared = [e for e in events if isinstance(e, AllBlocksCleared)]
    assert len(cleared) == 1  # ... but only the reset that preempted the running request cleared the cache


async def test_engines_hash_the_same_blocks_differently(kv_engine, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    one = await kv_engine("vllm")
    two = await kv_engine("vllm")
    for client in (one, two):
        await complete(client, PROMPT_A)
    first, second = one.server.engine.kv.cached_hashes(), two.server.engine.kv.cached_hashes()
    assert len(first) == len(second) == 3 and not first & second


async def test_sglang_generate_reports_the_reused_prefix_in_meta_info(kv_engine):
    client = await kv_engine("sglang")
    metas = []
    for _ in range(2):
        status, body = await client.post("/generate", {"input_ids": PROMPT_A, "sampling_params": {"max_new_tokens": 2}})
        assert status == 200
        metas.append(body["meta_info"])
    assert [m["cached_tokens"] for m in metas] == [0, 48] and metas[1]["prompt_tokens"] == 60
    _, info = await client.get_json("/server_info")
    state = info["internal_states"][0]
    assert state["num_cached_blocks"] == 3 and state["num_used_tokens"] == 0  # cached, not in use
    assert state["cache_hit_rate"] == pytest.approx(48 / 120)
