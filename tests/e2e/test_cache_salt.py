"""A request's ``cache_salt`` (vLLM and SGLang keep a salted prompt's KV cache apart: only requests
with the same salt reuse it) through the fleet: the index keys a salted prompt's blocks by its salt,
as each engine's events say it, and the router hashes a salted request under it, so a repeated
salted prompt finds its cache and no other request is told it is there."""

from __future__ import annotations

import time

import pytest

from infera_common.models import BUNDLED_MODEL_NAME
from infera_router.inflight_blocks import LINGER
from tests.e2e.fleet import PLANES, Fleet, env_with
from tests.e2e.runbook import http_json


def _cached(fleet: Fleet, content: str, salt: str | None) -> int:
    body = {"model": BUNDLED_MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    if salt is not None:
        body["cache_salt"] = salt
    status, answer = http_json(fleet.url + "/v1/chat/completions", body)
    assert status == 200, answer
    return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
@pytest.mark.parametrize("plane", list(PLANES))
def test_a_salted_prompt_is_routed_to_the_cache_its_salt_keeps(tmp_path, plane, flavor):
    fleet = Fleet(tmp_path, workers=2, plane=plane, env=env_with(),
                  extra=[f"--engine-arg=--engine-flavor {flavor} --speedup 20"]).start()
    try:
        prompts = [f"tenant question {n}, long enough to fill several KV blocks of the engine " * 20
                   for n in range(4)]
        assert [_cached(fleet, p, "tenant-a") for p in prompts] == [0] * 4
        time.sleep(LINGER + 0.5)  # past the router's memory of what it sent: the index alone
        # (by chance, load alone would find the cache for all four 1 time in 16)
        assert all(_cached(fleet, p, "tenant-a") > 0 for p in prompts)
        # the same tokens under another salt, or none, are computed again wherever they go
        assert _cached(fleet, prompts[0], "tenant-b") == 0
        assert _cached(fleet, prompts[1], None) == 0
    finally:
        fleet.stop()
