"""SIGTERM on a frontend (``Frontend.stop``): new requests are refused at once, answers under way
get ``--drain-timeout`` to finish, HTTP and NATS clients alike; what is still running then is cut
and its worker cancelled."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from infera.client import InferaClient, InferaError
from infera_common.schemas import Frame
from tests.frontend.frontend_fakes import MODEL, STREAM_TEXTS, chat_body, chunk_json, url, wait_until

PAUSE = 0.4  # between the slow stream's tokens


async def slow_stream(fleet, req) -> None:
    await fleet.frame(req, Frame(kind="head", status=200))
    for i, text in enumerate(STREAM_TEXTS):
        await fleet.frame(req, Frame(kind="data", seq=i + 1, body=chunk_json(i, text)))
        await asyncio.sleep(PAUSE)
    await fleet.frame(req, Frame(kind="end", seq=len(STREAM_TEXTS) + 1))


async def http_stream(fe) -> tuple[list[str], bool]:
    """The texts an HTTP client streamed, and whether it saw [DONE] (False: the stream was cut)."""
    texts, done = [], False
    async with aiohttp.ClientSession() as s, s.post(url(fe, "/v1/chat/completions"), json=chat_body(stream=True)) as r:
        try:
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: "):
                    texts.append(json.loads(line[6:])["choices"][0]["delta"]["content"])
        except aiohttp.ClientPayloadError:
            pass
    return texts, done


async def start(make_frontend, fleet, drain_timeout: float):
    fe = await make_frontend(drain_timeout=drain_timeout)
    await wait_until(lambda: fe.models.is_known(MODEL))
    fleet.script = slow_stream
    return fe


async def test_streams_under_way_finish_while_new_requests_are_refused(make_frontend, fleet, nats_server):
    fe = await start(make_frontend, fleet, drain_timeout=10)
    port = fe.port
    async with InferaClient(nats_server, timeout=5.0) as client:
        over_http = asyncio.create_task(http_stream(fe))
        over_nats = asyncio.create_task(_nats_texts(client))
        await wait_until(lambda: len(fleet.routed) == 2)
        stopping = asyncio.create_task(fe.stop())
        await asyncio.sleep(0.1)
        with pytest.raises(aiohttp.ClientConnectionError):  # the port is closed: a balancer tries another
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/health"):
                pass
        assert await over_http == (STREAM_TEXTS, True)  # whole, with its [DONE]
        assert await over_nats == STREAM_TEXTS
        await asyncio.wait_for(stopping, 5)  # and it stopped as soon as they were done
    assert fleet.cancels == []


async def test_what_outlasts_the_drain_timeout_is_cut_and_cancelled(make_frontend, fleet):
    fe = await start(make_frontend, fleet, drain_timeout=0.2)
    over_http = asyncio.create_task(http_stream(fe))
    await wait_until(lambda: len(fleet.routed) == 1)
    await asyncio.sleep(0.1)
    await asyncio.wait_for(fe.stop(), 3)
    texts, done = await over_http
    assert not done and len(texts) < len(STREAM_TEXTS)
    await wait_until(lambda: [rid for _, rid in fleet.cancels] == [fleet.routed[0].request_id])
    metrics = fe.metrics.registry
    assert metrics.get_sample_value("infera_frontend_cancels_sent_total", {"reason": "shutdown"}) == 1
    assert not metrics.get_sample_value("infera_frontend_client_disconnects_total", {"endpoint": "/v1/chat/completions"})


async def _nats_texts(client: InferaClient) -> list[str]:
    return [c["choices"][0]["delta"]["content"] async for c in client.stream_chat(chat_body())]


async def test_a_nats_client_cut_by_the_drain_timeout_is_told_at_once(make_frontend, fleet, nats_server):
    """A NATS client has no connection that closes: without a last message it would wait for its
    own timeout (60 s here)."""
    fe = await start(make_frontend, fleet, drain_timeout=0.2)
    async with InferaClient(nats_server, timeout=60.0) as client:
        got: list = []

        async def read() -> None:
            async for chunk in client.stream_chat(chat_body()):
                got.append(chunk["choices"][0]["delta"]["content"])

        reading = asyncio.create_task(read())
        await wait_until(lambda: got)
        await asyncio.wait_for(fe.stop(), 3)
        with pytest.raises(InferaError) as err:
            await asyncio.wait_for(reading, 3)
    assert err.value.status == 503 and "shutting down" in str(err.value)
    assert len(got) < len(STREAM_TEXTS)
