"""Fixtures for the mock engine: an in-process engine on a free 127.0.0.1 port, and small HTTP helpers."""

from __future__ import annotations

import json
import re

import aiohttp
import pytest

from infera_mock_engine.main import parse_args
from infera_mock_engine.server import RunningServer, start_server
from tests.waiting import eventually


class EngineClient:
    """An aiohttp session bound to one running mock engine."""

    def __init__(self, server: RunningServer, session: aiohttp.ClientSession) -> None:
        self.server = server
        self.session = session
        self.url = server.url

    async def post(self, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
        async with self.session.post(path, json=body, headers=headers) as r:
            return r.status, await r.json(content_type=None)

    async def get_json(self, path: str) -> tuple[int, dict | list]:
        async with self.session.get(path) as r:
            return r.status, await r.json(content_type=None)

    async def sse(self, path: str, body: dict, headers: dict | None = None) -> tuple[str, list]:
        """POST a streaming request; returns (raw body, decoded events with [DONE] as the string)."""
        async with self.session.post(path, json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            raw = await r.text()
        return raw, parse_sse(raw)

    async def metrics(self) -> str:
        async with self.session.get("/metrics") as r:
            assert r.status == 200
            return await r.text()

    async def metric(self, name: str) -> float:
        return metric_value(await self.metrics(), name)


def parse_sse(raw: str) -> list:
    """Strictly `data: <payload>\\n\\n` frames; JSON payloads decoded, `[DONE]` kept as a string."""
    assert raw.endswith("\n\n"), raw[-50:]
    events = []
    for frame in raw[:-2].split("\n\n"):
        assert frame.startswith("data: "), frame
        payload = frame[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def metric_value(text: str, name: str) -> float:
    """Value of the first sample of metric `name` (any labels)."""
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} not in metrics:\n{text}"
    return float(m.group(1))


wait_until = eventually


@pytest.fixture
async def start_engine(model_dir):
    """`await start_engine(*flags)` → EngineClient for a fresh in-process engine; all closed after the test."""
    started: list[tuple[RunningServer, aiohttp.ClientSession]] = []

    async def _start(*flags: str) -> EngineClient:
        config, _ = parse_args(["--model-path", str(model_dir), "--port", "0", *flags])
        server = await start_server(config)
        session = aiohttp.ClientSession(server.url)
        started.append((server, session))
        return EngineClient(server, session)

    yield _start
    for server, session in started:
        await session.close()
        await server.close()


@pytest.fixture
async def engine(start_engine) -> EngineClient:
    """An SGLang-flavoured engine, 10x faster than the modelled GPU."""
    return await start_engine("--speedup", "10")


KV_PAGE = 16  # the KV-event tests' page size


async def post_raw(client, path: str) -> tuple[int, str]:
    async with client.session.post(path) as r:
        return r.status, await r.text()


@pytest.fixture
async def kv_engine(start_engine):
    async def _start(flavor: str, *flags: str):
        client = await start_engine("--engine-flavor", flavor, "--page-size", str(KV_PAGE), "--num-kv-blocks", "8",
                                    "--speedup", "100", "--served-model-name", "smol", *flags)
        client.post_raw = lambda path: post_raw(client, path)
        return client
    return _start
