"""A simulated GPU hang: the process and its HTTP server live on, no scheduler step ends.

What each engine's /health says about it decides who can notice: SGLang's /health runs a one-token
generation and fails after SGLANG_HEALTH_CHECK_TIMEOUT; vLLM's answers 200 while the engine core
process lives. The signals that start and end the hang in a process: test_subprocess.py.
"""

from __future__ import annotations

import asyncio
import time

CHAT = {"messages": [{"role": "user", "content": "1+1=?"}]}


async def _health(client) -> int:
    async with client.session.get("/health") as r:
        return r.status


async def test_sglang_health_generates_and_fails_while_the_gpu_hangs(start_engine, monkeypatch):
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "0.5")
    client = await start_engine("--speedup", "10")
    assert await _health(client) == 200
    client.server.engine.hang_gpu()
    stream = asyncio.create_task(client.post("/v1/chat/completions", {**CHAT, "max_tokens": 4}))
    t0 = time.monotonic()
    assert await _health(client) == 503
    assert time.monotonic() - t0 >= 0.5  # it waited for output the whole timeout
    assert not stream.done()  # the request waits with the GPU
    client.server.engine.resume_gpu()
    status, body = await asyncio.wait_for(stream, 10)
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    assert await _health(client) == 200


async def test_sglang_health_is_shallow_when_generation_is_switched_off(start_engine, monkeypatch):
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "0.5")
    monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
    client = await start_engine("--speedup", "10")
    client.server.engine.hang_gpu()
    assert await _health(client) == 200
    async with client.session.get("/health_generate") as r:  # the explicit probe still generates
        assert r.status == 503
    client.server.engine.resume_gpu()


async def test_vllm_health_stays_200_while_the_gpu_hangs(start_engine, monkeypatch):
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "0.5")
    client = await start_engine("--speedup", "10", "--engine-flavor", "vllm")
    client.server.engine.hang_gpu()
    stream = asyncio.create_task(client.post("/v1/completions", {"model": client.server.engine.config.served_model_name,
                                                                "prompt": "hi", "max_tokens": 2}))
    await asyncio.sleep(0.3)
    assert await _health(client) == 200 and not stream.done()
    client.server.engine.resume_gpu()
    status, _ = await asyncio.wait_for(stream, 10)
    assert status == 200


async def test_another_requests_output_passes_the_sglang_probe(start_engine, monkeypatch):
    """SGLang counts any output after the probe starts: a busy engine passes without the probe's own token."""
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "5")
    client = await start_engine("--max-running-requests", "1")  # the probe queues behind the busy request
    busy = asyncio.create_task(client.post("/v1/chat/completions", {**CHAT, "max_tokens": 2000}))
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    assert await _health(client) == 200  # the probe waits behind the running request; its tokens count
    assert time.monotonic() - t0 < 2
    assert not busy.done()
    busy.cancel()


async def test_a_chat_stream_gets_its_headers_at_once_and_its_role_chunk_only_with_the_first_output(start_engine):
    """SGLang's and vLLM's serving_chat send the `role` chunk inside their loop over the engine's
    outputs: a client (or the worker-agent, which reads the first data chunk as "prefill done")
    gets nothing of the body while the prompt waits for a GPU step."""
    for flavor in ("sglang", "vllm"):
        client = await start_engine("--speedup", "10", "--engine-flavor", flavor)
        client.server.engine.hang_gpu()
        body = {**CHAT, "max_tokens": 3, "stream": True, "model": client.server.engine.config.served_model_name}
        async with client.session.post("/v1/chat/completions", json=body) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            first = asyncio.create_task(r.content.readline())
            await asyncio.sleep(0.3)
            assert not first.done(), flavor  # no role chunk before the engine's first output
            client.server.engine.resume_gpu()
            line = await asyncio.wait_for(first, 10)
            assert b'"role":"assistant"' in line.replace(b" ", b""), line
            rest = await r.read()
        assert rest.rstrip().endswith(b"data: [DONE]")
