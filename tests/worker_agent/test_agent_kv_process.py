"""KV events end to end: the agent over the real mock engine, relaying into JetStream."""

import asyncio

import aiohttp
import nats.js.errors
import pytest
from nats.js.api import DeliverPolicy

from infera_common.block_hash import block_hashes, unpack_hashes
from infera_common.schemas import KvRelay, decode
from infera_common.subjects import KV_EVENT_STREAM, kv_event_subject

from .test_agent_process import agents, bus, eventually  # noqa: F401  (fixtures)

PAGE = 16
PROMPT = list(range(1000, 1000 + 3 * PAGE))  # three full blocks


class KvStream:
    def __init__(self) -> None:
        self.relays: list[KvRelay] = []

    async def follow(self, js, worker_id: str) -> "KvStream":
        async def on_msg(msg):
            self.relays.append(decode(KvRelay, msg.data))

        self.sub = await js.subscribe(kv_event_subject(worker_id), cb=on_msg, ordered_consumer=True,
                                      deliver_policy=DeliverPolicy.ALL)
        return self

    def stored_hashes(self) -> set[int]:
        """The index hashes the relays say the engine holds."""
        held: set[int] = set()
        for r in self.relays:
            if r.kind == "blocks":
                if r.reset:
                    held.clear()
                for packed in r.removed.values():
                    held.difference_update(unpack_hashes(packed))
                for packed in r.stored.values():
                    held.update(unpack_hashes(packed))
        return held


async def complete(url: str, prompt: list[int]) -> None:
    body = {"model": "smol", "prompt": prompt, "max_tokens": 2}
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def stream_exists(js) -> bool:
    try:
        await js.stream_info(KV_EVENT_STREAM)
        return True
    except nats.js.errors.NotFoundError:  # any other error fails the test
        return False


@pytest.mark.parametrize("flavor,page,agent_args,index", [
    ("sglang", 4, [], 16),  # a page under 16 is folded into index blocks of 16 by default
    ("sglang", 4, ["--kv-index-block-size", "4"], 4),  # ... or indexed as it is when asked, with a warning
    ("sglang", 1, ["--kv-index-block-size", "8"], 8),
    ("vllm", PAGE, [], PAGE),
])
async def test_engine_kv_events_are_relayed_after_a_cleared(bus, agents, flavor, page, agent_args, index):
    worker = f"kv-{flavor}-{page}-{index}"
    agent = agents(worker, agent_args, ["--served-model-name", "smol", "--page-size", str(page),
                                        "--engine-flavor", flavor])
    record = await bus.active(worker)
    assert record.kv_block_size == page and record.index_block_size == index
    assert len(record.kv_events_endpoints) == 1
    assert record.kv_events_endpoints[0].startswith("tcp://127.0.0.1:")
    assert not record.kv_events_endpoints[0].endswith(":0")
    small = agent.event("kv_block_size_small")  # an index block under 16 is named, with the flag to change
    assert (small is not None) is (index < 16)
    if small is not None:
        assert small["index_block_size"] == index and "--kv-index-block-size" in small["hint"]
        assert f"{16384 // index:,} hashes" in small["hint"]
    folded = agent.event("kv_pages_folded")
    assert (folded is not None) is (index > page)

    prompt = list(range(1000, 1000 + 3 * index + page))  # three full index blocks and a page more
    stream = await KvStream().follow(bus.js, worker)
    await complete(record.url, prompt)
    # the prompt's full index blocks, hashed from the engine's token ids; nothing at the page size, and
    # not the partial block at the end (its pages and the two generated tokens' are held by the engine)
    want = set(block_hashes(prompt, index))
    assert await eventually(lambda: want == stream.stored_hashes(), 20), (want, stream.relays)
    first = stream.relays[0]
    assert first.kind == "cleared" and first.dp_rank is None and first.worker_id == worker
    batches = [r for r in stream.relays if r.kind == "blocks"]
    assert [r.seq for r in batches] == list(range(len(batches)))  # in order, none lost or repeated
    assert all(r.dp_rank == 0 and r.block_size == index for r in batches)


async def test_no_enable_kv_events_passes_no_config_and_relays_nothing(bus, agents):
    agent = agents("kv-off", ["--no-enable-kv-events"], ["--served-model-name", "smol", "--page-size", str(PAGE)])
    record = await bus.active("kv-off")
    assert "--kv-events-config" not in agent.event("agent_starting")["argv"]
    assert record.kv_events_endpoints == []
    assert record.kv_block_size == PAGE
    await complete(record.url, PROMPT)
    async with aiohttp.ClientSession() as s, s.get(f"{record.url}/server_info") as resp:
        assert (await resp.json())["kv_events"] is None
    await asyncio.sleep(0.5)
    if await stream_exists(bus.js):
        stream = await KvStream().follow(bus.js, "kv-off")
        await asyncio.sleep(0.5)
        assert [r for r in stream.relays if r.kind != "cleared"] == []
