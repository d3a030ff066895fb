"""SGLang's default page of one token, on real processes: the worker-agents fold the engines' pages into
index blocks of 16 tokens (``--kv-index-block-size`` 0), the router hashes requests at 16, and KV-aware
routing finds the engine that holds a prompt, on both planes (on the no-broker plane the kv-indexer in
``infera.server`` folds the pages it reads from the engines' ZMQ publishers itself)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from infera_common.models import BUNDLED_MODEL_NAME
from tests.e2e.fleet import PLANES, Fleet, router_metrics_url, scrape

MODEL = BUNDLED_MODEL_NAME
INDEX_BLOCK = 16  # what the agent picks for a page under 16


@pytest.fixture(scope="module", params=list(PLANES))
def paged_fleet(tmp_path_factory, request):
    fleet = Fleet(tmp_path_factory.mktemp("pages"), workers=2, plane=request.param,
                  extra=["--engine-arg=--page-size 1"]).start()
    yield fleet
    fleet.stop()


async def complete(url: str, prompt: list[int]) -> dict:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions",
                                                    json={"model": MODEL, "prompt": prompt, "max_tokens": 1}) as r:
        assert r.status == 200, await r.text()
        return json.loads(await r.read())


async def test_pages_of_one_token_are_indexed_in_blocks_of_16_and_routed_to_the_engine_that_holds_them(paged_fleet):
    workers = paged_fleet.workers_list()
    assert [(w["kv_block_size"], w["kv_index_block_size"]) for w in workers] == [(1, INDEX_BLOCK)] * 2
    target = workers[0]
    prompt = [(i * 31) % 40000 + 100 for i in range(10 * INDEX_BLOCK + 5)]  # 10 index blocks and 5 tokens
    await complete(target["url"], prompt)  # straight to one engine, bypassing the router
    await asyncio.sleep(0.5)  # its 165 one-token pages reach the index
    metrics = router_metrics_url(paged_fleet)
    before = scrape(metrics).get("infera_router_kv_hit_blocks_sum", 0.0)
    for turn in range(3):  # through the fleet, every time to the engine holding the prompt
        answer = await complete(paged_fleet.url, prompt + [7 + turn])
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 10 * INDEX_BLOCK, answer["usage"]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the router saw the 10 blocks (of 16 tokens) cached, three times
        hits = scrape(metrics).get("infera_router_kv_hit_blocks_sum", 0.0) - before
        if hits >= 30:
            break
        await asyncio.sleep(0.1)
    assert hits == 30
