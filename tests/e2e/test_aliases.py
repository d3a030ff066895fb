"""An engine serving one model under several names (vLLM's ``--served-model-name a b``): each name
is listed, routed and answered, and the names share one KV cache in routing as they do in the engine."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from infera_router.inflight_blocks import LINGER
from tests.e2e.fleet import PLANES, Fleet, env_with


def chat(url: str, model: str, content: str) -> dict:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2}).encode()
    ask = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(ask, timeout=30) as resp:
        return json.load(resp)


@pytest.mark.parametrize("plane", list(PLANES))
def test_every_served_name_is_listed_and_routed_to_the_cache_it_shares(tmp_path, plane):
    fleet = Fleet(tmp_path, workers=2, plane=plane, env=env_with(),
                  extra=["--engine-arg=--speedup 20 --served-model-name smol smol-latest"]).start()
    try:
        listed = [m["id"] for m in fleet.get_json("/v1/models")["data"]]
        assert listed == ["smol", "smol-latest"]
        records = fleet.workers_list()
        assert [(r["model"], r["aliases"]) for r in records] == [("smol", ["smol-latest"])] * 2
        prompts = [f"question {n} that two requests share, asked under two names " * 30 for n in range(4)]
        firsts = [chat(fleet.url, "smol", prompt) for prompt in prompts]
        time.sleep(LINGER + 0.5)  # past the router's own memory of the prompts it sent: the index alone
        for n, (prompt, first) in enumerate(zip(prompts, firsts)):
            # (by chance, load alone would find the cache for all four 1 time in 16)
            again = chat(fleet.url, "smol-latest", prompt)  # the same engine cache, found through the alias
            assert first["usage"]["prompt_tokens"] == again["usage"]["prompt_tokens"]
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, n
    finally:
        fleet.stop()
