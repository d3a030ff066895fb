"""A worker that says the engine still holds a request (``alive`` frames) keeps it from --upstream-timeout:
a non-streaming answer, or a stream's first token, may take longer than the timeout while the engine works."""

import asyncio
import json
import time

import aiohttp

from infera_common.schemas import Frame, encode
from tests.frontend.frontend_fakes import (
    MODEL, STREAM_TEXTS, chat_body, chunk_json, completion_json, url, wait_until, W1,
)

UPSTREAM = 0.5  # the frontend's --upstream-timeout in these tests
ROUTE = 0.5  # and its --route-timeout
WORKING = 4 * UPSTREAM  # how long the "engine" takes before its answer begins


async def post(fe, body):
    async with aiohttp.ClientSession() as s:
        async with s.post(url(fe, "/v1/chat/completions"), json=body) as r:
            return r.status, await r.read()


async def alive_for(f, req, seconds: float, seq: int) -> None:
    """What a worker-agent sends while its engine holds the request: an ``alive`` frame now and then."""
    loop = asyncio.get_running_loop()
    until = loop.time() + seconds
    while loop.time() < until:
        await asyncio.sleep(req.keepalive)
        await f.nc.publish(req.reply_subject, encode(Frame(kind="alive", seq=seq)))


async def slow_but_alive(f, req):
    if not req.stream:
        await alive_for(f, req, WORKING, 0)
        await f.frame(req, Frame(kind="head", status=200, body=completion_json(), final=True))
        return
    await f.frame(req, Frame(kind="head", status=200))
    await alive_for(f, req, WORKING, 1)
    for i, text in enumerate(STREAM_TEXTS, start=1):
        await f.frame(req, Frame(kind="data", seq=i, body=chunk_json(i - 1, text)))
    await f.frame(req, Frame(kind="end", seq=len(STREAM_TEXTS) + 1))


async def slow_and_silent(f, req):
    """The same engine time with nothing said meanwhile (an agent that predates alive frames)."""
    await asyncio.sleep(WORKING)
    await f.frame(req, Frame(kind="head", status=200, body=completion_json(), final=True))


async def a_lost_answer_then_alive(f, req):
    """The whole (non-streaming) answer is lost on the way; the worker's alive frames then say one
    frame was sent (an agent sends none once the answer is out: this checks the frontend's side)."""
    await f.frame(req, Frame(kind="head", status=200, body=completion_json(), final=True), lost=True)
    await alive_for(f, req, 30, 1)


async def test_a_long_non_streaming_answer_and_a_late_first_token_outlast_the_upstream_timeout(start_frontend, multi):
    fe = await start_frontend(upstream_timeout=UPSTREAM, request_max_retries=0)
    await wait_until(lambda: fe.models.is_known(MODEL))
    multi.scripts[W1] = slow_but_alive
    status, raw = await post(fe, chat_body())
    assert (status, raw) == (200, completion_json())
    status, raw = await post(fe, chat_body(stream=True))
    payloads = [e[len(b"data: "):] for e in raw.split(b"\n\n")[:-1]]
    assert status == 200 and payloads[-1] == b"[DONE]"
    assert [json.loads(p)["choices"][0]["delta"]["content"] for p in payloads[:-1]] == STREAM_TEXTS
    for req in multi.routed:  # asked three times per timeout, and given the request timeout as deadline
        assert req.keepalive == UPSTREAM / 3 and req.deadline > time.time() + 3000
    assert multi.cancels == []


async def test_without_alive_frames_the_same_wait_is_an_upstream_timeout(start_frontend, multi):
    fe = await start_frontend(upstream_timeout=UPSTREAM, request_max_retries=0)
    await wait_until(lambda: fe.models.is_known(MODEL))
    multi.scripts[W1] = slow_and_silent
    status, raw = await post(fe, chat_body())
    assert status == 504 and json.loads(raw)["error"]["type"] == "timeout_error"


async def test_an_alive_frame_shows_a_lost_frame_before_it(start_frontend, multi):
    fe = await start_frontend(upstream_timeout=3, request_max_retries=0)
    await wait_until(lambda: fe.models.is_known(MODEL))
    multi.scripts[W1] = a_lost_answer_then_alive
    # alive frames every second would keep the request from ever looking silent: the answer comes
    # back only because the first alive frame asked for the lost one again
    status, raw = await asyncio.wait_for(post(fe, chat_body()), 10)
    assert (status, raw) == (200, completion_json())
    assert [from_seq for _, from_seq in multi.replays] == [0]


async def test_a_request_kept_alive_is_not_taken_for_a_silent_one(start_frontend, multi):
    async def long_but_alive(f, req):
        await alive_for(f, req, 3.5, 0)  # past the 2 s after which a silent request's sender is asked
        await f.frame(req, Frame(kind="head", status=200, body=completion_json(), final=True))

    fe = await start_frontend(upstream_timeout=UPSTREAM, request_max_retries=0)
    await wait_until(lambda: fe.models.is_known(MODEL))
    multi.scripts[W1] = long_but_alive
    assert await post(fe, chat_body()) == (200, completion_json())
    assert multi.asked == []  # its sender spoke: no question whether it is still on the bus


async def test_a_router_waiting_on_a_prefill_is_given_the_upstream_timeout_not_the_route_timeout(start_frontend, multi):
    # vLLM's pairs: the router names the decode worker only once the prefill answered
    async def long_prefill(f, req):  # as the router does: an alive frame at once, then every keepalive
        for _ in range(4):
            await f.nc.publish(req.reply_subject, encode(Frame(kind="alive", seq=0)))
            await asyncio.sleep(ROUTE)

    fe = await start_frontend(route_timeout=ROUTE, upstream_timeout=30, request_max_retries=0)
    multi.before_reply = long_prefill
    assert await post(fe, chat_body()) == (200, completion_json())
    assert multi.routed[0].upstream_timeout == 30

    async def silent_router(f, req):
        await asyncio.sleep(4 * ROUTE)

    multi.before_reply = silent_router  # the route timeout is still what a router that says nothing gets
    status, raw = await post(fe, chat_body())
    assert status == 503 and "router" in json.loads(raw)["error"]["message"]
