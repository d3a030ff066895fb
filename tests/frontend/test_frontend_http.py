"""The OpenAI HTTP API end to end through real NATS, with a fake router + worker-agent."""

import asyncio
import json
import os
import re
import signal
import time

import aiohttp
import pytest
from structlog.testing import capture_logs

from infera.procs import free_port, start_nats, stop_process
from infera_common import nats_conn
from infera_common.discovery import Registrar
from infera_common.schemas import Endpoint, Frame, WorkerStatus
from tests.frontend.frontend_fakes import (
    MODEL,
    STREAM_TEXTS,
    WORKER,
    chat_body,
    completion_json,
    script_silent,
    script_stall_after_first_chunk,
    url,
    wait_until,
    worker_record,
)


async def post(fe, path: str, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as s:
        async with s.post(url(fe, path), data=data, headers=headers) as r:
            return r.status, r.headers.copy(), await r.read()


def sse_payloads(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n")
    events = raw.split(b"\n\n")[:-1]
    assert all(e.startswith(b"data: ") for e in events), events
    return [e[len(b"data: "):] for e in events]


def openai_error(raw: bytes) -> dict:
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


async def test_non_streaming_chat_returns_engine_body_verbatim(frontend, fleet, tok_ids_1plus1):
    raw = json.dumps({**chat_body(), "max_tokens": 4, "my_extension": {"k": [1, 2]}}, indent=1).encode()
    status, headers, body = await post(frontend, "/v1/chat/completions", raw)
    assert status == 200 and body == completion_json()
    assert headers["Content-Type"].startswith("application/json")
    rid = headers["X-Request-Id"]
    assert len(rid) == 32 and int(rid, 16) >= 0  # generated uuid hex
    [req] = fleet.routed
    assert req.request_id == rid and req.model == MODEL and req.endpoint == Endpoint.CHAT and not req.stream
    assert req.body == raw  # the client's bytes, never re-serialised
    assert list(req.token_ids) == tok_ids_1plus1 and req.prompt_tokens == 35
    # the worker abandons it after --request-timeout (3600 s); the frontend waits while the worker
    # speaks, and asks it to say every third of --upstream-timeout (2 s here) that the engine works
    assert time.time() + 3500 < req.deadline < time.time() + 3600.5 and req.keepalive == 2.0 / 3


async def test_request_id_is_echoed_and_forwarded(frontend, fleet):
    status, headers, _ = await post(frontend, "/v1/chat/completions", chat_body(),
                                    headers={"X-Request-Id": "trace-42:a.b_c"})
    assert status == 200 and headers["X-Request-Id"] == "trace-42:a.b_c"
    assert re.fullmatch(r"trace-42:a\.b_c-[0-9a-f]{8}", fleet.routed[-1].request_id)  # unique per request

    # a proxy's id in other characters is served, echoed as sent, and carried in safe characters
    status, headers, body = await post(frontend, "/v1/chat/completions", chat_body(),
                                       headers={"X-Request-Id": "a+b/c= {d}"})
    assert status == 200 and headers["X-Request-Id"] == "a+b/c= {d}"
    assert re.fullmatch(r"a_b_c___d_-[0-9a-f]{8}", fleet.routed[-1].request_id)


async def test_streaming_chat_is_sse_ending_with_done(frontend, fleet):
    status, headers, body = await post(frontend, "/v1/chat/completions", chat_body(stream=True))
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    assert headers["Cache-Control"] == "no-cache"
    assert fleet.routed[-1].request_id == headers["X-Request-Id"] and fleet.routed[-1].stream
    assert fleet.routed[-1].deadline > time.time() + 3000  # a stream may run up to --request-timeout
    payloads = sse_payloads(body)
    assert payloads[-1] == b"[DONE]"
    texts = [json.loads(p)["choices"][0]["delta"]["content"] for p in payloads[:-1]]
    assert texts == STREAM_TEXTS


async def test_completions_with_text_and_token_prompts(frontend, fleet):
    status, _, _ = await post(frontend, "/v1/completions", {"model": MODEL, "prompt": "Hello, world"})
    assert status == 200
    assert list(fleet.routed[-1].token_ids) == [19556, 28, 905] and fleet.routed[-1].endpoint == Endpoint.COMPLETIONS
    status, _, body = await post(frontend, "/v1/completions", {"model": MODEL, "prompt": [9, 8, 7], "stream": True})
    assert status == 200 and sse_payloads(body)[-1] == b"[DONE]"
    assert list(fleet.routed[-1].token_ids) == [9, 8, 7] and fleet.routed[-1].prompt_tokens == 3
    assert (fleet.routed[-1].sequences, fleet.routed[-1].samples) == (1, 1)
    status, _, _ = await post(frontend, "/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "n": 2})
    assert status == 200 and fleet.routed[-1].sequences == 4  # the router hands the engine's count on
    assert fleet.routed[-1].samples == 2  # each sample decodes over its own prompt: the router's decode load


async def test_openai_sdk_streams_through_the_frontend(frontend, fleet):
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=url(frontend, "/v1"), api_key="unused", max_retries=0)
    try:
        reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1+1=?"}])
        assert reply.choices[0].message.content == "2"
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                      stream=True)
        assert [c.choices[0].delta.content async for c in stream] == STREAM_TEXTS
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (b'{"model": ', 400, None, None),
        (json.dumps({"model": MODEL}).encode(), 400, "messages", None),
        (json.dumps(chat_body(max_tokens=-3)).encode(), 400, "max_tokens", None),
        (json.dumps(chat_body(stream="true")).encode(), 400, "stream", None),
        (json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}).encode(), 404,
         "model", "model_not_found"),
    ],
)
async def test_bad_requests_get_openai_errors_and_never_reach_the_router(frontend, fleet, body, status, param, code):
    got, headers, raw = await post(frontend, "/v1/chat/completions", body)
    assert got == status and "X-Request-Id" in headers
    err = openai_error(raw)
    assert err["param"] == param and err["code"] == code
    assert fleet.routed == []
    # the service stays up and serves the next request
    assert (await post(frontend, "/v1/chat/completions", chat_body()))[0] == 200


async def test_oversize_body_is_413(make_frontend, fleet):
    fe = await make_frontend(max_body_bytes=4096)
    await wait_until(lambda: fe.models.is_known(MODEL))
    status, _, raw = await post(fe, "/v1/chat/completions", chat_body("x" * 5000))
    assert status == 413 and openai_error(raw)["message"]
    assert fleet.routed == []
    assert (await post(fe, "/v1/chat/completions", chat_body("x" * 3000)))[0] == 200


async def test_a_request_for_more_sequences_than_the_limit_is_400_and_names_the_setting(make_frontend, fleet):
    fe = await make_frontend(max_sequences_per_request=8)
    await wait_until(lambda: fe.models.is_known(MODEL))
    status, _, raw = await post(fe, "/v1/chat/completions", {**chat_body(), "n": 9})
    err = openai_error(raw)
    assert status == 400 and err["param"] == "n" and err["code"] == "too_many_sequences"
    assert "9 sequences" in err["message"] and "--max-sequences-per-request" in err["message"]
    batch = {"model": MODEL, "prompt": ["a", "b", "c"], "n": 3}  # 3 samples of each of 3 prompts
    status, _, raw = await post(fe, "/v1/completions", batch)
    assert status == 400 and openai_error(raw)["param"] == "prompt" and "9 sequences" in openai_error(raw)["message"]
    assert fleet.routed == []
    assert (await post(fe, "/v1/chat/completions", {**chat_body(), "n": 8}))[0] == 200  # at the limit: served
    assert fleet.routed[-1].sequences == 8


async def test_model_without_active_worker_is_503(frontend, fleet):
    registrar = Registrar(fleet.nc.jetstream(), worker_record("w2", model="warming-up", status=WorkerStatus.STARTING))
    await registrar.start()
    try:
        await wait_until(lambda: frontend.models.is_known("warming-up"))
        status, _, raw = await post(frontend, "/v1/chat/completions",
                                    {"model": "warming-up", "messages": [{"role": "user", "content": "x"}]})
        assert status == 503 and openai_error(raw)["type"] == "service_unavailable_error"
        assert fleet.routed == []
    finally:
        await registrar.stop()


@pytest.mark.parametrize(("route_status", "etype"), [(429, "rate_limit_error"), (503, "service_unavailable_error"),
                                                     (500, "internal_server_error")])
async def test_router_refusals_are_passed_through(frontend, fleet, route_status, etype):
    fleet.route_status, fleet.route_message = route_status, "router says no"
    status, headers, raw = await post(frontend, "/v1/chat/completions", chat_body(stream=True))
    assert status == route_status and "X-Request-Id" in headers
    err = openai_error(raw)
    assert err["message"] == "router says no" and err["type"] == etype
    # every worker full: the client is told when to come back, with OpenAI's code for it
    assert (headers.get("Retry-After"), err["code"]) == (("1", "rate_limit_exceeded") if route_status == 429
                                                         else (None, err["code"]))


async def test_router_unreachable_is_503_after_the_route_timeout(make_frontend, nats_server):
    from infera_common.nats_conn import connect

    fe = await make_frontend(route_timeout=1.0, request_max_retries=0)
    nc = await connect(nats_server, "registrar-only")
    registrar = Registrar(nc.jetstream(), worker_record())
    await registrar.start()
    try:
        await wait_until(lambda: fe.models.is_known(MODEL))
        status, _, raw = await post(fe, "/v1/chat/completions", chat_body())
        assert status == 503 and openai_error(raw)["message"] == "router unavailable"
    finally:
        await registrar.stop()
        await nc.close()


async def test_silent_router_is_503_after_route_timeout(make_frontend, fleet):
    fe = await make_frontend(route_timeout=0.3)
    await wait_until(lambda: fe.models.is_known(MODEL))
    fleet.route_silent = True
    status, _, raw = await post(fe, "/v1/chat/completions", chat_body())
    assert status == 503 and openai_error(raw)["message"] == "router unavailable: no answer within 0.3s"
    assert fe.metrics.registry.get_sample_value("infera_frontend_retries_total", {"reason": "route_timeout"}) == 1
    fleet.route_silent = False
    assert (await post(fe, "/v1/chat/completions", chat_body()))[0] == 200


async def test_frames_overtaking_the_route_reply_are_kept(frontend, fleet):
    fleet.frames_before_reply = True
    status, _, body = await post(frontend, "/v1/chat/completions", chat_body())
    assert status == 200 and body == completion_json()
    status, _, body = await post(frontend, "/v1/chat/completions", chat_body(stream=True))
    payloads = sse_payloads(body)
    assert [json.loads(p)["choices"][0]["delta"]["content"] for p in payloads[:-1]] == STREAM_TEXTS


async def test_upstream_timeout_is_504_and_cancels(make_frontend, fleet):
    fe = await make_frontend(upstream_timeout=0.5)
    await wait_until(lambda: fe.models.is_known(MODEL))
    fleet.script = script_silent
    status, headers, raw = await post(fe, "/v1/chat/completions", chat_body())
    assert status == 504 and openai_error(raw)["type"] == "timeout_error"
    assert await fleet.wait_cancel(headers["X-Request-Id"], timeout=2.0) is not None
    cancel = fleet.cancel_msgs[headers["X-Request-Id"]]
    assert cancel.worker_fault and cancel.status == 504  # counted against the worker by its router's breaker


async def test_stalled_stream_ends_with_error_event_and_cancel(make_frontend, fleet):
    fe = await make_frontend(upstream_timeout=0.5)
    await wait_until(lambda: fe.models.is_known(MODEL))
    fleet.script = script_stall_after_first_chunk
    status, headers, raw = await post(fe, "/v1/chat/completions", chat_body(stream=True))
    assert status == 200
    payloads = sse_payloads(raw)
    assert json.loads(payloads[0])["choices"][0]["delta"]["content"] == "Two"
    assert json.loads(payloads[1])["error"]["type"] == "timeout_error"
    assert payloads[2] == b"[DONE]"
    assert await fleet.wait_cancel(headers["X-Request-Id"], timeout=2.0) is not None


async def test_engine_error_status_is_passed_through_in_openai_shape(frontend, fleet):
    async def engine_rejects(f, req):
        body = b'{"object": "error", "message": "max_tokens is too large", "type": "BadRequestError", "code": 400}'
        await f.frame(req, Frame(kind="head", status=400, body=body, final=True))

    fleet.script = engine_rejects
    for stream in (False, True):
        status, headers, raw = await post(frontend, "/v1/chat/completions", chat_body(stream=stream))
        assert status == 400 and headers["Content-Type"].startswith("application/json")
        err = openai_error(raw)
        assert err["message"] == "max_tokens is too large" and err["type"] == "invalid_request_error"
        assert err["code"] is None  # the engine's integer 400 only repeated the status


async def test_agent_error_frames(frontend, fleet):
    async def agent_fails(f, req):
        await f.frame(req, Frame(kind="error", status=502, message="engine unreachable"))

    fleet.script = agent_fails
    status, _, raw = await post(frontend, "/v1/chat/completions", chat_body())
    assert status == 502 and openai_error(raw)["message"] == "engine unreachable"

    async def fails_mid_stream(f, req):
        await f.frame(req, Frame(kind="head", status=200))
        await f.frame(req, Frame(kind="data", seq=1, body=b'{"choices": []}'))
        await f.frame(req, Frame(kind="error", seq=2, status=500, message="engine crashed"))

    fleet.script = fails_mid_stream
    status, _, raw = await post(frontend, "/v1/chat/completions", chat_body(stream=True))
    payloads = sse_payloads(raw)
    assert status == 200 and payloads[0] == b'{"choices": []}'
    assert json.loads(payloads[1])["error"]["message"] == "engine crashed"
    assert payloads[2] == b"[DONE]"


async def test_a_stream_that_fails_midway_is_counted_and_logged_as_the_error_it_ended_in(frontend, fleet):
    # the client saw 200 and then an error event: dashboards and logs must still show a failure
    async def fails_mid_stream(f, req):
        await f.frame(req, Frame(kind="head", status=200))
        await f.frame(req, Frame(kind="data", seq=1, body=b'{"choices": []}'))
        await f.frame(req, Frame(kind="error", seq=2, status=502, message="the engine's connection broke"))

    fleet.script = fails_mid_stream
    with capture_logs() as logs:
        status, headers, _ = await post(frontend, "/v1/chat/completions", chat_body(stream=True),
                                        headers={"X-Request-Id": "cut-1"})
    assert status == 200
    metrics = frontend.metrics.registry
    labels = {"transport": "http", "endpoint": "/v1/chat/completions", "model": MODEL}
    assert metrics.get_sample_value("infera_frontend_requests_total", {**labels, "status": "502"}) == 1
    assert not metrics.get_sample_value("infera_frontend_requests_total", {**labels, "status": "200"})
    [line] = [e for e in logs if e["event"] == "stream_failed"]
    assert line["request_id"].startswith("cut-1-") and line["worker_id"] == WORKER and line["status"] == 502


async def test_client_disconnect_mid_stream_cancels_within_a_second(make_frontend, fleet):
    fe = await make_frontend(upstream_timeout=30)
    await wait_until(lambda: fe.models.is_known(MODEL))
    fleet.script = script_stall_after_first_chunk
    async with aiohttp.ClientSession() as s:
        resp = await s.post(url(fe, "/v1/chat/completions"), json=chat_body(stream=True))
        assert resp.status == 200
        first = await resp.content.readuntil(b"\n\n")
        assert first.startswith(b"data: ")
        rid = resp.headers["X-Request-Id"]
        resp.close()  # the client goes away
        left = time.monotonic()
    got = await fleet.wait_cancel(rid, timeout=3.0)
    assert got is not None and got - left < 1.0
    await wait_until(lambda: len(fe.inbox) == 0)


async def test_client_disconnect_while_waiting_cancels(make_frontend, fleet):
    fe = await make_frontend(upstream_timeout=30)
    await wait_until(lambda: fe.models.is_known(MODEL))
    fleet.script = script_silent
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as s:
        with pytest.raises(asyncio.TimeoutError):
            await s.post(url(fe, "/v1/chat/completions"), json=chat_body(), headers={"X-Request-Id": "gone-1"})
        left = time.monotonic()
    rid = fleet.routed[-1].request_id
    assert rid.startswith("gone-1-")
    got = await fleet.wait_cancel(rid, timeout=3.0)
    assert got is not None and got - left < 1.0


async def test_models_workers_health_ready_metrics(frontend, fleet):
    async with aiohttp.ClientSession() as s:
        async with s.get(url(frontend, "/v1/models")) as r:
            models = await r.json()
        assert models["object"] == "list"
        assert [(m["id"], m["object"], m["owned_by"]) for m in models["data"]] == [(MODEL, "model", "infera")]
        async with s.get(url(frontend, "/v1/workers")) as r:
            [w] = (await r.json())["data"]
        assert (w["worker_id"], w["model"], w["engine"], w["role"], w["status"], w["url"]) == (
            WORKER, MODEL, "mock", "aggregated", "active", "http://127.0.0.1:1")
        async with s.get(url(frontend, "/health")) as r:
            assert r.status == 200
        async with s.get(url(frontend, "/ready")) as r:
            assert r.status == 200
        await post(frontend, "/v1/chat/completions", chat_body())
        await post(frontend, "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]})
        async with s.get(url(frontend, "/metrics")) as r:
            text = await r.text()
    assert (f'infera_frontend_requests_total{{endpoint="/v1/chat/completions",model="{MODEL}",status="200",'
            f'transport="http"}} 1.0') in text
    assert 'model="_unknown",status="404"' in text
    assert "infera_frontend_tokenize_seconds_count" in text
    assert "infera_frontend_time_to_first_byte_seconds_count" in text
    assert "_created" not in text  # no creation-time series beside each counter (it doubled the series)


async def test_one_model_is_retrieved_as_the_openai_sdk_asks(frontend, fleet):
    import openai

    client = openai.AsyncOpenAI(base_url=url(frontend, "/v1"), api_key="none")
    got = await client.models.retrieve(MODEL)
    assert (got.id, got.object, got.owned_by) == (MODEL, "model", "infera")
    with pytest.raises(openai.NotFoundError) as err:
        await client.models.retrieve("org/no-such-model")  # ids may hold a slash
    assert err.value.body["code"] == "model_not_found" and "org/no-such-model" in err.value.body["message"]
    await client.close()


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/embeddings", 404), ("POST", "/nowhere", 404), ("GET", "/v1/chat/completions", 405),
    ("DELETE", "/v1/models", 405),
])
async def test_unknown_routes_and_methods_get_openai_errors(frontend, fleet, method, path, status):
    async with aiohttp.ClientSession() as s, s.request(method, url(frontend, path)) as r:
        assert r.status == status and r.content_type == "application/json"
        error = (await r.json())["error"]
    assert path in error["message"] and error["type"] == "invalid_request_error"
    if status == 405:
        assert method in error["message"] and r.headers["Allow"]


async def test_not_ready_without_nats(make_frontend, nats_server):
    fe = await make_frontend()
    await fe.nc.close()
    async with aiohttp.ClientSession() as s:
        async with s.get(url(fe, "/ready")) as r:
            assert r.status == 503 and "NATS not connected" in (await r.json())["reasons"]
        async with s.get(url(fe, "/health")) as r:
            assert r.status == 200


async def test_a_stalled_broker_makes_the_frontend_not_ready_and_it_comes_back(make_frontend, tmp_path, monkeypatch):
    # a broker that stops answering (SIGSTOP: its sockets stay open) is noticed by the clients' pings
    monkeypatch.setattr(nats_conn, "PING_INTERVAL_S", 0.3)
    monkeypatch.setattr(nats_conn, "MAX_OUTSTANDING_PINGS", 1)
    port = free_port()
    broker = start_nats(port, tmp_path / "js")
    try:
        fe = await make_frontend(nats_url=f"nats://127.0.0.1:{port}")

        async def ready() -> int:
            async with aiohttp.ClientSession() as s, s.get(url(fe, "/ready")) as r:
                return r.status

        assert await ready() == 200
        os.kill(broker.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while await ready() == 200 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert await ready() == 503
        os.kill(broker.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while await ready() == 503 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert await ready() == 200
    finally:
        os.kill(broker.pid, signal.SIGCONT)
        stop_process(broker)


async def test_stream_request_answered_without_sse_returns_the_body(frontend, fleet):
    async def engine_ignores_stream(f, req):  # the agent sends a non-SSE answer as one final head
        await f.frame(req, Frame(kind="head", status=200, body=completion_json(), final=True))

    fleet.script = engine_ignores_stream
    status, headers, body = await post(frontend, "/v1/chat/completions", chat_body(stream=True))
    assert status == 200 and body == completion_json()
    assert headers["Content-Type"].startswith("application/json")


async def test_final_head_with_an_empty_body_is_the_whole_answer(frontend, fleet):
    """A final head ends the response even with an empty body: nothing more is awaited."""
    async def empty_answer(f, req):
        await f.frame(req, Frame(kind="head", status=200, body=b"", final=True))

    fleet.script = empty_answer
    for stream in (False, True):
        status, _, body = await post(frontend, "/v1/chat/completions", chat_body(stream=stream))
        assert (status, body) == (200, b"")  # not a 504 after --upstream-timeout


async def test_head_with_a_body_but_not_final_is_still_complete(frontend, fleet):
    """An agent that predates ``final`` (head with the body, then end) is still understood."""
    async def old_agent(f, req):
        await f.frame(req, Frame(kind="head", status=200, body=completion_json()))
        await f.frame(req, Frame(kind="end", seq=1))

    fleet.script = old_agent
    status, _, body = await post(frontend, "/v1/chat/completions", chat_body())
    assert status == 200 and body == completion_json()


async def test_x_session_id_header_is_not_interpreted(frontend, fleet):
    """Only X-Dynamo-Session-ID opts in to session affinity: another header neither fails nor reaches the router."""
    status, _, _ = await post(frontend, "/v1/chat/completions", chat_body(), headers={"X-Session-Id": "bad id!"})
    assert status == 200
    assert fleet.routed[-1].session_ids == []


async def test_a_prompt_far_past_the_context_length_is_refused_before_it_is_tokenized(make_frontend, nats_server):
    """Its characters alone say it cannot fit (``ChatTokenizer.min_tokens``): no seconds of
    tokenizing, no gigabyte held, nothing routed."""
    from infera_common.nats_conn import connect

    nc = await connect(nats_server, "registrar-only")
    registrar = Registrar(nc.jetstream(), worker_record(context_length=8192))
    await registrar.start()
    try:
        fe = await make_frontend()
        await wait_until(lambda: fe.models.context_limit(MODEL) is not None)
        floor = fe.http.pipeline.tokenizer.min_tokens(2_000_000)
        assert floor >= 8192
        spent = []
        real = fe.http.pipeline.tokens

        async def tokens(parsed):
            spent.append(1)
            return await real(parsed)

        fe.http.pipeline.tokens = tokens
        status, _, raw = await post(fe, "/v1/chat/completions", chat_body("ab" * 1_000_000))
        assert status == 400 and spent == []
        err = openai_error(raw)
        assert err["code"] == "context_length_exceeded" and f"at least {floor} tokens" in err["message"], err
    finally:
        await registrar.stop()
        await nc.close()
