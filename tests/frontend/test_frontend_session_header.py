"""Session affinity plumbing: every value of X-Dynamo-Session-ID reaches the router, unmodified."""

import asyncio
import json

import aiohttp
from multidict import CIMultiDict

from infera_common.nats_conn import connect
from infera_common.subjects import API_CHAT_COMPLETIONS
from infera_frontend.session import SESSION_HEADER, nats_session_ids
from tests.frontend.frontend_fakes import chat_body, completion_json, url

H = "X-Dynamo-Session-ID"


async def post(fe, body: bytes, headers):
    async with aiohttp.ClientSession() as s:
        async with s.post(url(fe, "/v1/chat/completions"), data=body,
                          headers=headers or {"Content-Type": "application/json"}) as r:
            return r.status, await r.read()


def with_session(*values: str) -> CIMultiDict:
    headers = CIMultiDict({"Content-Type": "application/json"})
    for v in values:
        headers.add(H, v)
    return headers


def test_nats_header_values_are_read_without_case_and_kept_in_order():
    assert SESSION_HEADER == H
    assert nats_session_ids(None) == [] and nats_session_ids({"X-Request-Id": "r"}) == []
    assert nats_session_ids({H: " a b ", "X-Request-Id": "r", "x-dynamo-session-id": "c"}) == [" a b ", "c"]


async def test_every_value_reaches_the_route_request_unmodified(frontend, fleet):
    raw = json.dumps(chat_body()).encode()
    long_id = "s" * 2000  # over the router's limit: the router decides, not the frontend
    # (HTTP itself drops whitespace around a header value; everything else arrives as sent)
    for values in (["user-7"], ["dup", "dup"], ["b", "a"], ["id with spaces/ünïcode"], [long_id]):
        status, body = await post(frontend, raw, with_session(*values))
        assert (status, body) == (200, completion_json())
        req = fleet.routed[-1]
        assert req.session_ids == values
        assert req.body == raw  # the id never enters the model input


async def test_no_header_means_no_session(frontend, fleet):
    status, _ = await post(frontend, json.dumps(chat_body()).encode(), None)
    assert status == 200 and fleet.routed[-1].session_ids == []


async def test_empty_value_is_passed_on(frontend, fleet):
    status, _ = await post(frontend, json.dumps(chat_body()).encode(), with_session(""))
    assert status == 200 and fleet.routed[-1].session_ids == [""]


async def test_router_400_reaches_the_client_in_openai_shape_without_retry(frontend, fleet):
    fleet.route_status, fleet.route_message = 400, f"{H} was sent 2 times; send it once"
    for stream in (False, True):
        fleet.routed.clear()
        status, raw = await post(frontend, json.dumps(chat_body(stream=stream)).encode(), with_session("a", "b"))
        assert status == 400
        err = json.loads(raw)["error"]
        assert err == {"message": f"{H} was sent 2 times; send it once", "type": "invalid_request_error",
                       "param": None, "code": None}
        assert len(fleet.routed) == 1  # a router refusal is never retried


async def test_nats_api_passes_the_header(frontend, fleet, nats_server):
    nc = await connect(nats_server, "session-client")
    try:
        msg = await nc.request(API_CHAT_COMPLETIONS, json.dumps(chat_body()).encode(), timeout=5,
                               headers={H: "conv-42"})
        assert msg.data == completion_json()
        assert fleet.routed[-1].session_ids == ["conv-42"]

        await nc.request(API_CHAT_COMPLETIONS, json.dumps(chat_body()).encode(), timeout=5)
        assert fleet.routed[-1].session_ids == []
    finally:
        await nc.close()


async def _raw_post(fe, header_value: bytes) -> bytes:
    """One request written byte for byte: a header value no HTTP client library would send."""
    body = json.dumps(chat_body()).encode()
    port = int(url(fe, "/").rsplit(":", 1)[1].split("/")[0])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\n" + H.encode() + b": " + header_value + b"\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return answer.split(b"\r\n", 1)[0]


async def test_a_value_that_is_not_utf8_is_carried_as_its_bytes(frontend, fleet):
    """It was a 500 (the route request could not be encoded), with affinity on or off."""
    for value in (b"sess-\xff\xfe", b"\xe9" * 3, b"caf\xc3"):  # bytes, Latin-1, a cut UTF-8 sequence
        status_line = await _raw_post(frontend, value)
        assert status_line.endswith(b" 200 OK"), status_line
        assert fleet.routed[-1].session_ids == [value.decode("latin-1")]  # the same bytes: the same id
