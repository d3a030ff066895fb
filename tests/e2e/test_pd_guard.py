"""Prefill guard release on real processes: when the prefill worker's routing load is released.

`hold` (default): the prefill lease is held until the decode finishes; `completion`: released as
soon as the router has drained the prefill's complete answer. Shown for unary and streamed
requests, over HTTP and over the NATS API, by sampling the router's lease gauge while a long decode
runs (mock engines at GPU-like speed: 300 tokens decode in about 2 s)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from infera.client import InferaClient
from infera_common.models import BUNDLED_MODEL_NAME
from tests.e2e.fleet import Fleet, env_with, router_metrics_url

CHAT = {"model": BUNDLED_MODEL_NAME, "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 300}


@pytest.fixture(scope="module", params=["hold", "completion"])
def guard_fleet(tmp_path_factory, request):
    f = Fleet(tmp_path_factory.mktemp(f"pd-{request.param}"), workers=0,
              extra=["--prefill-workers", "1", "--decode-workers", "1"],
              env=env_with(INFERA_PD_PREFILL_GUARD_RELEASE=request.param)).start()
    f.guard = request.param
    yield f
    f.stop()


async def prefill_leases(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('infera_router_active_leases{worker="prefill-1"}'))


async def http_unary(fleet):
    async with aiohttp.ClientSession() as s:
        async with s.post(fleet.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
            assert json.loads(await r.read())["usage"]["completion_tokens"] == 300


async def http_stream(fleet):
    async with aiohttp.ClientSession() as s:
        async with s.post(fleet.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            assert r.status == 200
            assert (await r.read()).rstrip().endswith(b"[DONE]")


async def nats_unary(fleet):
    async with InferaClient(fleet.nats_url) as client:
        assert (await client.chat(CHAT))["usage"]["completion_tokens"] == 300


async def nats_stream(fleet):
    async with InferaClient(fleet.nats_url) as client:
        chunks = [c async for c in client.stream_chat({**CHAT, "stream": True})]
        assert chunks


@pytest.mark.parametrize("send", [http_unary, http_stream, nats_unary, nats_stream])
async def test_prefill_load_is_held_or_released_by_the_guard_mode(guard_fleet, send):
    url = router_metrics_url(guard_fleet)
    samples: list[float] = []
    async with aiohttp.ClientSession() as s:
        request = asyncio.create_task(send(guard_fleet))
        while not request.done():
            samples.append(await prefill_leases(s, url))
            await asyncio.sleep(0.05)
        await request
        # the second half of the request, while the decode runs (the last samples may already see
        # the release that follows the final frame)
        late = samples[len(samples) // 2:-2]
        assert len(late) >= 5
        if guard_fleet.guard == "hold":
            assert set(late) == {1.0}, samples
        else:
            assert set(late) == {0.0}, samples
        for _ in range(50):  # and nothing is left once the decode is done
            if await prefill_leases(s, url) == 0:
                break
            await asyncio.sleep(0.1)
        assert await prefill_leases(s, url) == 0
