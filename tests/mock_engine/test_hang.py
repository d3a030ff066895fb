"""A simulated GPU hang: the process and its HTTP server live on, no scheduler step ends.

What each engine's /health says about it decides who can notice: SGLang's /health runs a one-token
generation and fails after SGLANG_HEALTH_CHECK_TIMEOUT; vLLM's answers 200 while the engine core
process lives.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from infera.procs import free_port, stop_process, wait_port

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


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_sigusr1_hangs_the_gpu_and_sigusr2_ends_it(model_dir, tmp_path, subprocess_env):
    port = free_port()
    env = {**subprocess_env, "SGLANG_HEALTH_CHECK_TIMEOUT": "0.5"}
    log_path = tmp_path / "engine.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "infera_mock_engine", "--model-path", str(model_dir),
                                 "--port", str(port), "--speedup", "10"], stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    try:
        wait_port("127.0.0.1", port, 10, proc)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 15
        while _get(base + "/health") != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while _get(base + "/health") != 503:
            assert time.monotonic() < deadline, "the hang never showed"
        assert _get(base + "/v1/models") == 200  # HTTP itself answers
        os.kill(proc.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 10
        while _get(base + "/health") != 200:
            assert time.monotonic() < deadline, "the engine never came back"
    finally:
        assert stop_process(proc) == 0
    text = log_path.read_text()
    assert "simulated GPU hang (SIGUSR1)" in text and "simulated GPU hang over (SIGUSR2)" in text
