"""--api-key: the mock engine refuses what each real engine refuses without the key, and only that."""

from __future__ import annotations

import pytest

from infera_mock_engine.main import parse_args

KEY = "sk-mock-123"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def status(client, method: str, path: str, headers: dict | None = None, body: dict | None = None) -> int:
    async with client.session.request(method, path, json=body, headers=headers) as r:
        if r.status == 401:
            assert await r.json() == {"error": "Unauthorized"}
        return r.status


@pytest.mark.parametrize("flavor", ["sglang", "vllm"])
async def test_requests_need_the_key_and_probes_do_not(start_engine, flavor):
    client = await start_engine("--engine-flavor", flavor, "--api-key", KEY, "--speedup", "20")
    good = {"Authorization": f"Bearer {KEY}"}
    for headers in (None, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY}):
        assert await status(client, "POST", "/v1/chat/completions", headers, CHAT) == 401
        assert await status(client, "GET", "/v1/models", headers) == 401
    assert await status(client, "POST", "/v1/chat/completions", good, CHAT) == 200
    assert await status(client, "POST", "/v1/chat/completions", {"Authorization": f"bearer {KEY}"}, CHAT) == 200
    for path in ("/health", "/metrics"):  # liveness probes and Prometheus carry no secret
        assert await status(client, "GET", path) == 200
    # what each engine leaves open beyond those: SGLang every /health* path, vLLM only its listed ones
    assert await status(client, "GET", "/health_generate") == (200 if flavor == "sglang" else 401)
    assert await status(client, "GET", "/load") == (401 if flavor == "sglang" else 200)
    async with client.session.get("/server_info", headers=good) as r:
        info = await r.json()
    assert info["api_key_set"] is True and KEY not in str(info)


def test_vllm_takes_the_key_from_its_environment_too(model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    vllm, _ = parse_args(["--model-path", str(model_dir), "--engine-flavor", "vllm"])
    sglang, _ = parse_args(["--model-path", str(model_dir)])
    assert vllm.api_key == KEY and sglang.api_key is None
    assert parse_args(["--model-path", str(model_dir), "--api-key", "other"])[0].api_key == "other"
