"""A placed request whose sender left the bus (its worker-agent, or the router that runs it on
--request-transport http, died): the broker says "no responders" to the sender's FramesQuery
subject, and the frontend ends the request (retried on another worker while its client has
nothing) instead of waiting for --discovery-ttl or --upstream-timeout: at once when it has received
nothing, after a few seconds of "no responders" when its answer was under way."""

from __future__ import annotations

import asyncio

import pytest

from infera_common.nats_conn import flush_all
from infera_common.schemas import Frame
from infera_frontend import relay as relay_module
from tests.frontend.frontend_fakes import (
    STREAM_TEXTS, W1, W2, chat_body, chunk_json, completion_json, url, wait_until,
)

import aiohttp


@pytest.fixture(autouse=True)
def quick_watch(monkeypatch):
    """The same rules, on a shorter clock."""
    monkeypatch.setattr(relay_module, "SILENT_AFTER", 0.3)
    monkeypatch.setattr(relay_module, "UNHEARD_AFTER", 0.2)
    monkeypatch.setattr(relay_module, "SENDER_CHECK_EVERY", 0.1)
    monkeypatch.setattr(relay_module, "SENDER_GONE_AFTER", 0.5)
    monkeypatch.setattr(relay_module, "SENDER_QUESTION_TIMEOUT", 0.5)


async def post(fe, body) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url(fe, "/v1/chat/completions"), json=body) as r:
        return r.status, await r.read()


async def metric(fe, name: str, **labels) -> float:
    return fe.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("sender", ["worker", "router"])
async def test_a_request_whose_sender_left_the_bus_is_retried_on_another_worker(start_frontend, multi, sender):
    fe = await start_frontend(upstream_timeout=120)
    multi.frames_from = sender
    multi.scripts[W1] = lambda f, req: asyncio.sleep(0)  # placed, then nothing: its sender dies
    answer = asyncio.create_task(post(fe, chat_body()))
    await wait_until(lambda: multi.placed == [W1])
    await multi.query_subs[W1 if sender == "worker" else "r1"].unsubscribe()
    await flush_all(multi.nc)
    status, raw = await asyncio.wait_for(answer, 10)  # not the 120 s upstream timeout
    assert status == 200 and raw == completion_json() and multi.placed == [W1, W2]
    assert await metric(fe, "infera_frontend_senders_gone_total") == 1
    assert await metric(fe, "infera_frontend_retries_total", reason="sender_gone") == 1
    assert await metric(fe, "infera_frontend_frames_lost_total") == 0


async def test_a_request_that_received_nothing_is_retried_at_the_first_no_responders(
        start_frontend, multi, monkeypatch):
    """A killed agent's queued request: nothing of it ran, so it does not wait out the grace that a
    stream under way gets for a sender that may be reconnecting."""
    monkeypatch.setattr(relay_module, "SENDER_GONE_AFTER", 600.0)
    fe = await start_frontend(upstream_timeout=120)
    multi.scripts[W1] = lambda f, req: asyncio.sleep(0)
    answer = asyncio.create_task(post(fe, chat_body()))
    await wait_until(lambda: multi.placed == [W1])
    await multi.query_subs[W1].unsubscribe()
    await flush_all(multi.nc)
    status, raw = await asyncio.wait_for(answer, 10)  # not the 600 s grace
    assert status == 200 and raw == completion_json() and multi.placed == [W1, W2]
    assert await metric(fe, "infera_frontend_retries_total", reason="sender_gone") == 1


async def test_a_slow_sender_that_still_answers_keeps_its_request(start_frontend, multi):
    """A long prefill sends nothing for seconds: its sender answers the question, and the request
    waits on (several checks), then gets its answer from the same worker."""
    fe = await start_frontend(upstream_timeout=120)
    go = asyncio.Event()

    async def slow(f, req) -> None:
        await go.wait()
        await f.frame(req, Frame(kind="head", status=200))
        for i, text in enumerate(STREAM_TEXTS, start=1):
            await f.frame(req, Frame(kind="data", seq=i, body=chunk_json(i - 1, text)))
        await f.frame(req, Frame(kind="end", seq=len(STREAM_TEXTS) + 1))

    multi.scripts[W1] = slow
    answer = asyncio.create_task(post(fe, chat_body(stream=True)))
    await wait_until(lambda: len(multi.asked) >= 3)  # asked again and again, and answered
    go.set()
    status, raw = await asyncio.wait_for(answer, 10)
    assert status == 200 and b"[DONE]" in raw and multi.placed == [W1]
    assert await metric(fe, "infera_frontend_senders_gone_total") == 0


async def test_a_stream_under_way_whose_sender_left_ends_with_an_error_event(start_frontend, multi):
    fe = await start_frontend(upstream_timeout=120)

    async def one_token_then_silence(f, req) -> None:
        await f.frame(req, Frame(kind="head", status=200))
        await f.frame(req, Frame(kind="data", seq=1, body=chunk_json(0, STREAM_TEXTS[0])))

    multi.scripts[W1] = one_token_then_silence
    answer = asyncio.create_task(post(fe, chat_body(stream=True)))
    await wait_until(lambda: multi.placed == [W1])
    await multi.query_subs[W1].unsubscribe()
    status, raw = await asyncio.wait_for(answer, 10)
    assert status == 200 and b"its worker-agent left the message bus" in raw and raw.endswith(b"data: [DONE]\n\n")
    assert multi.placed == [W1]  # the client had a token: not retried


async def test_behind_a_router_that_predates_frames_from_a_silent_request_is_never_taken_for_lost(
        start_frontend, multi):
    """Such a router says nothing of who sends the frames (on --request-transport http it is the
    router itself, and the worker's agent is not subscribed): the frontend cannot tell a dead
    sender from a wrong guess, so it leaves the request to its timeouts, as before."""
    fe = await start_frontend(upstream_timeout=120)
    multi.frames_from = None
    go = asyncio.Event()

    async def late(f, req) -> None:
        await go.wait()
        await f.frame(req, Frame(kind="head", status=200, body=completion_json(), final=True))

    multi.scripts[W1] = late
    answer = asyncio.create_task(post(fe, chat_body()))
    await wait_until(lambda: multi.placed == [W1])
    await multi.query_subs[W1].unsubscribe()  # nobody answers on the worker's subject
    await asyncio.sleep(1.5)  # three times what ends a request whose known sender left
    go.set()
    status, raw = await asyncio.wait_for(answer, 10)
    assert status == 200 and raw == completion_json() and multi.placed == [W1]
    assert await metric(fe, "infera_frontend_senders_gone_total") == 0
