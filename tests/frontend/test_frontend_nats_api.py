"""The OpenAI API on NATS request/reply, raw and through infera.client.InferaClient."""

import asyncio
import json

import nats.errors
import pytest

from infera.client import InferaClient, InferaError
from infera_common.nats_api import HEADER_ALIVE_EVERY, HEADER_KIND, HEADER_REQUEST_ID, HEADER_STATUS
from infera_common.nats_conn import connect, flush_all
from infera_common.schemas import Endpoint, Frame, encode
from infera_common.subjects import API_CHAT_COMPLETIONS, API_MODELS
from tests.frontend.frontend_fakes import (
    MODEL,
    STREAM_TEXTS,
    chat_body,
    completion_json,
    script_ok,
    script_silent,
    script_stall_after_first_chunk,
    wait_until,
)


@pytest.fixture
async def client(frontend, nats_server):
    c = InferaClient(nats_server, timeout=5.0)
    await c.connect()
    yield c
    await c.close()


async def test_raw_nats_request_gets_body_and_status_header(frontend, fleet, nats_server):
    nc = await connect(nats_server, "raw-client")
    try:
        raw = json.dumps({**chat_body(), "extra_field": True}).encode()
        msg = await nc.request(API_CHAT_COMPLETIONS, raw, timeout=5, headers={HEADER_REQUEST_ID: "nats-req-1"})
        assert msg.data == completion_json()
        assert msg.headers[HEADER_STATUS] == "200" and msg.headers[HEADER_REQUEST_ID] == "nats-req-1"
        [req] = fleet.routed
        assert req.request_id.startswith("nats-req-1-") and req.body == raw and req.prompt_tokens == 35
        # header names compare without case, as over HTTP (the id was dropped and a new one made)
        msg = await nc.request(API_CHAT_COMPLETIONS, raw, timeout=5, headers={"x-request-id": "lower-1"})
        assert msg.headers[HEADER_REQUEST_ID] == "lower-1" and fleet.routed[-1].request_id.startswith("lower-1-")

        msg = await nc.request(API_CHAT_COMPLETIONS, b"{oops", timeout=5)
        assert msg.headers[HEADER_STATUS] == "400" and msg.headers[HEADER_KIND] == "error"
        assert json.loads(msg.data)["error"]["type"] == "invalid_request_error"

        msg = await nc.request(API_MODELS, b"", timeout=5)
        assert [m["id"] for m in json.loads(msg.data)["data"]] == [MODEL]

        msg = await nc.request(API_CHAT_COMPLETIONS, b'{"model": "\xff\xfe"}', timeout=5)
        assert "not valid UTF-8 (byte 0xff at offset 11)" in json.loads(msg.data)["error"]["message"]
    finally:
        await nc.close()


async def test_a_request_whose_reply_subject_is_an_api_subject_is_dropped_not_answered(frontend, fleet, nats_server):
    """Its answers would arrive as new requests to the API (each alive message too)."""
    nc = await connect(nats_server, "loop-client")
    try:
        before = len(fleet.routed)
        await nc.publish(API_CHAT_COMPLETIONS, json.dumps(chat_body()).encode(), reply=API_MODELS)
        await nc.publish(API_MODELS, b"", reply="wild.*")
        await flush_all(nc)
        refused = frontend.metrics.nats_api_refused
        await wait_until(lambda: refused.labels("api_subject")._value.get() == 1
                         and refused.labels("invalid")._value.get() == 1)
        assert len(fleet.routed) == before
        msg = await nc.request(API_CHAT_COMPLETIONS, json.dumps(chat_body()).encode(), timeout=5)
        assert msg.headers[HEADER_STATUS] == "200"
    finally:
        await nc.close()


async def test_client_chat_and_stream(client, fleet):
    reply = await client.chat(chat_body())
    assert reply["choices"][0]["message"]["content"] == "2"
    chunks = [c async for c in client.stream_chat(chat_body(), request_id="stream-1")]
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == STREAM_TEXTS
    assert fleet.routed[-1].request_id.startswith("stream-1-") and fleet.routed[-1].stream


async def test_client_completions_and_listings(client, fleet):
    await client.completions({"model": MODEL, "prompt": "Hello, world", "max_tokens": 2})
    assert fleet.routed[-1].endpoint == Endpoint.COMPLETIONS and list(fleet.routed[-1].token_ids) == [19556, 28, 905]
    chunks = [c async for c in client.stream_completions({"model": MODEL, "prompt": [1, 2]})]
    assert len(chunks) == len(STREAM_TEXTS)
    assert [m["id"] for m in (await client.models())["data"]] == [MODEL]
    assert [w["worker_id"] for w in (await client.workers())["data"]] == ["w1"]


async def test_client_errors(client, fleet):
    with pytest.raises(InferaError) as info:
        await client.chat({"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert info.value.status == 404 and info.value.error["code"] == "model_not_found"

    with pytest.raises(InferaError) as info:
        async for _ in client.stream_chat(chat_body(max_tokens=0)):
            pass
    assert info.value.status == 400 and info.value.error["param"] == "max_tokens"

    fleet.route_status = 429
    with pytest.raises(InferaError) as info:
        async for _ in client.stream_chat(chat_body()):
            pass
    assert info.value.status == 429


async def test_stream_failing_midway_ends_with_error(make_frontend, fleet, nats_server):
    fe = await make_frontend(upstream_timeout=0.5)
    await wait_until(lambda: fe.models.is_known(MODEL))
    fleet.script = script_stall_after_first_chunk
    got = []
    async with InferaClient(nats_server, timeout=5.0) as c:
        with pytest.raises(InferaError) as info:
            async for chunk in c.stream_chat(chat_body(), request_id="stall-1"):
                got.append(chunk)
    assert len(got) == 1 and info.value.status == 504
    assert fleet.routed[-1].request_id.startswith("stall-1-")
    assert await fleet.wait_cancel(fleet.routed[-1].request_id, timeout=2.0) is not None


async def test_nats_api_can_be_disabled(make_frontend, fleet, nats_server):
    fe = await make_frontend(enable_nats_api=False)
    await wait_until(lambda: fe.models.is_known(MODEL))
    async with InferaClient(nats_server, timeout=2.0) as c:
        with pytest.raises(InferaError) as info:
            await c.models()
    assert info.value.status == 503


#: how long the fake engine takes before its answer begins, in the tests of alive messages
WORKING = 1.5


async def slow_but_alive(fleet, req):
    """An engine that takes WORKING seconds, its worker saying meanwhile that it still holds the request."""
    loop = asyncio.get_running_loop()
    until = loop.time() + WORKING
    while loop.time() < until:
        await asyncio.sleep(req.keepalive)
        await fleet.nc.publish(req.reply_subject, encode(Frame(kind="alive", seq=0 if not req.stream else 1)))
    await script_ok(fleet, req)


async def test_a_client_bounding_its_wait_below_the_engine_time_gets_its_answer(make_frontend, fleet, nats_server):
    fe = await make_frontend(upstream_timeout=0.6)
    await wait_until(lambda: fe.models.is_known(MODEL))
    fleet.script = slow_but_alive
    async with InferaClient(nats_server, timeout=0.6) as c:  # before: 504 "no reply within 0.6s"
        assert (await c.chat(chat_body()))["choices"][0]["message"]["content"] == "2"
        chunks = [c async for c in c.stream_chat(chat_body())]
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == STREAM_TEXTS
    assert fleet.cancels == []


async def test_alive_messages_come_only_when_asked_and_never_after_the_last(make_frontend, fleet, nats_server):
    fe = await make_frontend(upstream_timeout=0.6)
    await wait_until(lambda: fe.models.is_known(MODEL))
    fleet.script = slow_but_alive
    nc = await connect(nats_server, "raw-client")
    try:
        async def exchange(headers):
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            await nc.publish(API_CHAT_COMPLETIONS, json.dumps(chat_body()).encode(), reply=inbox, headers=headers)
            got = []
            while not got or got[-1][0] == "alive":
                msg = await sub.next_msg(timeout=5)
                got.append(((msg.headers or {}).get(HEADER_KIND), msg.data))
            await asyncio.sleep(0.6)  # past two more periods: nothing follows the answer
            with pytest.raises(nats.errors.TimeoutError):
                await sub.next_msg(timeout=0.01)
            await sub.unsubscribe()
            return got

        got = await exchange({HEADER_ALIVE_EVERY: "0.25"})
        kinds = [kind for kind, _ in got]
        assert kinds[:-1] == ["alive"] * (len(kinds) - 1) and len(kinds) - 1 >= 2  # ~6 in 1.5 s at 0.25 s
        assert got[-1][1] == completion_json() and all(data == b"" for _, data in got[:-1])
        assert [kind for kind, _ in await exchange(None)] == [None]  # not asked: the answer alone

        msg = await nc.request(API_CHAT_COMPLETIONS, json.dumps(chat_body()).encode(), timeout=5,
                               headers={HEADER_ALIVE_EVERY: "soon"})
        assert msg.headers[HEADER_STATUS] == "400"
        assert json.loads(msg.data)["error"]["param"] == HEADER_ALIVE_EVERY
    finally:
        await nc.close()


async def test_a_client_that_leaves_has_its_request_cancelled(make_frontend, fleet, nats_server):
    # the frontend's alive messages are NATS requests: once no one listens on the reply subject,
    # NATS answers "no responders" and the worker is told to stop (before: only --upstream-timeout)
    fe = await make_frontend(upstream_timeout=5)
    await wait_until(lambda: fe.models.is_known(MODEL))
    fleet.script = script_silent  # the engine is still at work
    nc = await connect(nats_server, "leaving-client")
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(API_CHAT_COMPLETIONS, json.dumps(chat_body()).encode(), reply=inbox,
                         headers={HEADER_REQUEST_ID: "leaves-1", HEADER_ALIVE_EVERY: "0.2"})
        first = await sub.next_msg(timeout=5)
        assert first.headers[HEADER_KIND] == "alive" and first.reply  # an answer is welcome, not needed
        await sub.unsubscribe()  # the client gives up and goes
        assert await fleet.wait_cancel(fleet.routed[-1].request_id, timeout=3) is not None
    finally:
        await nc.close()
    await wait_until(lambda: fe.metrics.registry.get_sample_value(
        "infera_frontend_client_disconnects_total", {"endpoint": "/v1/chat/completions"}) == 1)
    assert fe.metrics.registry.get_sample_value("infera_frontend_cancels_sent_total",
                                                {"reason": "client_disconnect"}) == 1


async def test_a_client_call_given_up_stops_the_engine_work(make_frontend, fleet, nats_server):
    fe = await make_frontend(upstream_timeout=5)
    await wait_until(lambda: fe.models.is_known(MODEL))
    fleet.script = script_silent
    async with InferaClient(nats_server, timeout=0.6) as c:  # alive messages every 0.2 s, answered
        call = asyncio.create_task(c.chat(chat_body(), request_id="given-up-1"))
        await wait_until(lambda: len(fleet.routed) == 1)
        await asyncio.sleep(0.5)  # probes answered meanwhile: the request stays
        assert fleet.cancels == []
        call.cancel()  # the caller gives up (a timeout of its own, a user who left)
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await fleet.wait_cancel(fleet.routed[-1].request_id, timeout=3) is not None
