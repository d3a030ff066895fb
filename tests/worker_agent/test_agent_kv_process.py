"""KV events end to end: the agent over the real mock engine, relaying into JetStream."""

import asyncio

import aiohttp
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
    except Exception:
        return False


@pytest.mark.parametrize("flavor,page", [("sglang", 4), ("vllm", PAGE)])
async def test_engine_kv_events_are_relayed_after_a_cleared(bus, agents, flavor, page):
    agent = agents(f"kv-{flavor}", [], ["--served-model-name", "smol", "--page-size", str(page),
                                        "--engine-flavor", flavor])
    record = await bus.active(f"kv-{flavor}")
    assert record.kv_block_size == page
    assert len(record.kv_events_endpoints) == 1
    assert record.kv_events_endpoints[0].startswith("tcp://127.0.0.1:")
    assert not record.kv_events_endpoints[0].endswith(":0")
    small = agent.event("kv_block_size_small")  # a page under 16 is named, with the flag to change
    assert (small is not None) is (page < 16)
    if small is not None:
        assert small["block_size"] == page and "--page-size 16" in small["hint"] and "4,096 events" in small["hint"]

    prompt = list(range(1000, 1000 + 3 * page))  # three full blocks
    stream = await KvStream().follow(bus.js, f"kv-{flavor}")
    await complete(record.url, prompt)
    want = set(block_hashes(prompt, page))  # the prompt's three blocks, hashed from the engine's token ids
    assert await eventually(lambda: want <= stream.stored_hashes(), 20), stream.relays
    first = stream.relays[0]
    assert first.kind == "cleared" and first.dp_rank is None and first.worker_id == f"kv-{flavor}"
    batches = [r for r in stream.relays if r.kind == "blocks"]
    assert [r.seq for r in batches] == list(range(len(batches)))  # in order, none lost or repeated
    assert all(r.dp_rank == 0 and r.block_size == page for r in batches)


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
