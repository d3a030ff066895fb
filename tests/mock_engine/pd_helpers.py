"""Helpers for the disaggregation tests: mock engines as real processes, and small HTTP probes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from infera.procs import free_port, stop_process
from tests.waiting import eventually

MODEL = str(Path(__file__).resolve().parents[2] / "libs" / "infera_common" / "models" / "SmolLM2-135M-Instruct")
CHAT = [{"role": "user", "content": "1+1=?"}]  # 35 prompt tokens with the bundled chat template


@dataclass
class EngineProc:
    proc: subprocess.Popen
    url: str
    log: Path
    bootstrap_port: int | None = None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("INFERA_", "SGLANG_DISAGGREGATION_", "VLLM_MOONCAKE_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def spawn_engine_proc(args: list[str], log: Path, env: dict[str, str],
                      bootstrap_port: int | None = None) -> EngineProc:
    """`python -m infera_mock_engine --model-path MODEL --port <free> *args` (not waited for)."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "infera_mock_engine", "--model-path", MODEL, "--port",
                                 str(port), *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    return EngineProc(proc, f"http://127.0.0.1:{port}", log, bootstrap_port)


def wait_healthy(*engines: EngineProc, timeout: float = 20.0) -> None:
    """Until every engine's /health is 200; stops them all and raises (with the log) otherwise."""
    deadline = time.monotonic() + timeout
    pending = list(engines)
    while pending:
        e = pending[0]
        if e.proc.poll() is not None:
            stop_all(*engines)
            raise RuntimeError(f"engine exited with {e.proc.returncode}:\n{e.log_text()}")
        try:
            with urllib.request.urlopen(e.url + "/health", timeout=2) as r:
                if r.status == 200:
                    pending.pop(0)
                    continue
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            stop_all(*engines)
            raise TimeoutError(f"engine not healthy after {timeout}s:\n{e.log_text()}")
        time.sleep(0.05)


def stop_all(*engines: EngineProc) -> None:
    for e in engines:  # signal every engine first, so they shut down together
        if e.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(e.proc.pid, signal.SIGTERM)
    for e in engines:
        stop_process(e.proc)


async def server_info(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/server_info") as r:
        assert r.status == 200
        return await r.json()


async def disagg(session: aiohttp.ClientSession, url: str) -> dict:
    return (await server_info(session, url))["disaggregation"]


wait_for = eventually


async def post_json(session: aiohttp.ClientSession, url: str, body: dict,
                    headers: dict | None = None) -> tuple[int, dict]:
    async with session.post(url, json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def post_sse(session: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None) -> tuple[int, list]:
    """A streaming POST: (status, events) with JSON payloads decoded and `[DONE]` kept as the string."""
    async with session.post(url, json=body, headers=headers) as r:
        raw = await r.text()
        if not r.headers.get("Content-Type", "").startswith("text/event-stream"):
            return r.status, [json.loads(raw)]
    events = []
    for frame in raw.split("\n\n"):
        if frame.startswith("data: "):
            payload = frame[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return r.status, events


def stream_text(events: list) -> str:
    return "".join((e["choices"][0].get("delta") or {}).get("content") or ""
                   for e in events if isinstance(e, dict) and e.get("choices"))
