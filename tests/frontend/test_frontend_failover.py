"""Failover: a request that fails before its first byte is tried again on another worker (issue 4)."""

import asyncio
import json

import aiohttp
import pytest

from infera.client import InferaClient, InferaError
from infera_common.discovery import Registrar
from infera_common.nats_conn import connect, flush_all
from infera_common.settings import parse_cli
from infera_common.schemas import Frame, Release, decode
from infera_common.subjects import (
    ROUTER_QUEUE, ROUTER_ROUTE, frames_query_subject, frames_replay_subject,
    router_frames_query_subject, router_frames_replay_subject, router_release_subject,
)
from infera_frontend.failover import Attempts, engine_status_reason, worker_error_reason
from infera_frontend.settings import FrontendSettings
from tests.frontend.frontend_fakes import (
    MODEL,
    script_ok,
    STREAM_TEXTS,
    MultiFleet,
    chat_body,
    chunk_json,
    completion_json,
    url,
    wait_until,
    worker_record,
    W1,
    W2,
)




async def post(fe, body, headers=None):
    async with aiohttp.ClientSession() as s:
        async with s.post(url(fe, "/v1/chat/completions"), json=body, headers=headers) as r:
            return r.status, r.headers.copy(), await r.read()


def sse_payloads(raw: bytes) -> list[bytes]:
    return [e[len(b"data: "):] for e in raw.split(b"\n\n")[:-1]]


def stream_texts(raw: bytes) -> list[str]:
    payloads = sse_payloads(raw)
    assert payloads[-1] == b"[DONE]"
    return [json.loads(p)["choices"][0]["delta"]["content"] for p in payloads[:-1]]


async def metrics_text(fe) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(url(fe, "/metrics")) as r:
            return await r.text()


def agent_error(status: int, message: str = "agent says no"):
    async def script(f, req):
        await f.frame(req, Frame(kind="error", status=status, message=message))
    return script


def engine_answer(status: int, body: bytes = b'{"object": "error", "message": "busy", "type": "x", "code": 1}'):
    async def script(f, req):
        await f.frame(req, Frame(kind="head", status=status, body=body, final=True))
    return script


async def head_then_error(f, req):
    """The engine's status went out, then the connection to it broke before any token."""
    await f.frame(req, Frame(kind="head", status=200))
    await f.frame(req, Frame(kind="error", seq=1, status=502, message="engine connection lost"))


async def head_then_silence(f, req):
    await f.frame(req, Frame(kind="head", status=200))


async def token_then_error(f, req):
    await f.frame(req, Frame(kind="head", status=200))
    await f.frame(req, Frame(kind="data", seq=1, body=chunk_json(0, "half")))
    await f.frame(req, Frame(kind="error", seq=2, status=502, message="engine connection lost"))


# --- the policy (pure) ---------------------------------------------------------------------------

def test_retryable_statuses():
    assert [s for s in (400, 404, 409, 429, 499, 500, 502, 503, 504) if worker_error_reason(s)] == [502, 503, 504]
    assert [s for s in (400, 404, 422, 429, 500, 502, 503, 504) if engine_status_reason(s)] == [429, 502, 503, 504]
    assert worker_error_reason(503) == "worker_503" and engine_status_reason(429) == "engine_429"


def test_attempts_spend_the_retry_budget_once_per_retry():
    a = Attempts(1)
    assert not a.retry(None)  # a final failure never spends the budget
    assert a.retry("worker_503") and not a.retry("worker_503")
    assert not Attempts(0).retry("worker_503")
    a.tried_on(W1), a.tried_on(W1), a.tried_on(W2)
    assert a.tried == [W1, W2]


def test_a_failure_of_another_worker_moves_the_exclusion_to_it():
    a = Attempts(2)
    a.tried_on(W1)
    a.failed_elsewhere(W1, "w-prefill")  # W1's decode leg was stopped by its prefill's failure
    assert a.tried == ["w-prefill"]
    a.tried_on(W1)
    a.failed_elsewhere(W1, "")  # W1's own failure: it stays excluded
    a.failed_elsewhere(W1, W1)
    assert a.tried == ["w-prefill", W1]


def test_request_max_retries_flag_and_env(monkeypatch):
    def parse(argv):
        return parse_cli(FrontendSettings, argv, prog="infera-frontend")[0]

    monkeypatch.delenv("INFERA_REQUEST_MAX_RETRIES", raising=False)
    assert parse([]).request_max_retries == 1
    assert parse(["--request-max-retries", "0"]).request_max_retries == 0
    monkeypatch.setenv("INFERA_REQUEST_MAX_RETRIES", "3")
    assert parse([]).request_max_retries == 3
    with pytest.raises(SystemExit) as info:
        parse(["--request-max-retries", "-1"])
    assert info.value.code == 2


# --- HTTP --------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
async def test_503_before_any_data_succeeds_on_the_next_worker(start_frontend, multi, stream):
    fe = await start_frontend()
    multi.scripts[W1] = agent_error(503, "worker is draining; retry on another worker")
    status, headers, raw = await post(fe, chat_body(stream=stream))
    assert status == 200
    if stream:
        assert headers["Content-Type"].startswith("text/event-stream") and stream_texts(raw) == STREAM_TEXTS
    else:
        assert raw == completion_json()
    assert multi.placed == [W1, W2]
    first, second = multi.routed
    assert first.exclude == [] and second.exclude == [W1]
    assert first.request_id == second.request_id == headers["X-Request-Id"]
    assert second.body == first.body and second.token_ids == first.token_ids
    assert 'infera_frontend_retries_total{reason="worker_503"} 1.0' in await metrics_text(fe)


async def test_stream_failing_after_its_head_but_before_a_token_is_retried_with_status_200(start_frontend, multi):
    """The status line waits for the first token: the client sees only the second worker's stream."""
    fe = await start_frontend()
    multi.scripts[W1] = head_then_error
    status, headers, raw = await post(fe, chat_body(stream=True))
    assert status == 200 and stream_texts(raw) == STREAM_TEXTS
    assert multi.placed == [W1, W2]


async def test_timeout_before_first_token_cancels_and_retries(start_frontend, multi):
    fe = await start_frontend(upstream_timeout=0.3)
    multi.scripts[W1] = head_then_silence
    status, headers, raw = await post(fe, chat_body(stream=True))
    assert status == 200 and stream_texts(raw) == STREAM_TEXTS
    assert multi.placed == [W1, W2] and multi.routed[1].exclude == [W1]
    # the first worker was told to stop (its router releases the lease), the second was not
    await wait_until(lambda: (W1, headers["X-Request-Id"]) in multi.cancels)
    assert all(w == W1 for w, _ in multi.cancels)
    assert 'infera_frontend_retries_total{reason="upstream_timeout"} 1.0' in await metrics_text(fe)


async def test_error_after_a_token_is_never_retried(start_frontend, multi):
    fe = await start_frontend(request_max_retries=2)
    multi.scripts[W1] = token_then_error
    status, _, raw = await post(fe, chat_body(stream=True))
    assert status == 200
    payloads = sse_payloads(raw)
    assert json.loads(payloads[0])["choices"][0]["delta"]["content"] == "half"
    assert json.loads(payloads[1])["error"]["message"] == "engine connection lost"
    assert payloads[2] == b"[DONE]"
    assert multi.placed == [W1]


async def token_then_a_lost_frame(f, req):
    """Frame 2 never arrives (a broker restarted between the worker and the frontend)."""
    await f.frame(req, Frame(kind="head", status=200))
    for i, text in enumerate(STREAM_TEXTS, start=1):
        await f.frame(req, Frame(kind="data", seq=i, body=chunk_json(i - 1, text)), lost=i == 2)
    await f.frame(req, Frame(kind="end", seq=len(STREAM_TEXTS) + 1))


async def a_lost_head(f, req):
    if not req.stream:
        await f.frame(req, Frame(kind="head", status=200, body=completion_json(), final=True), lost=True)
        return
    await f.frame(req, Frame(kind="head", status=200), lost=True)
    for i, text in enumerate(STREAM_TEXTS, start=1):
        await f.frame(req, Frame(kind="data", seq=i, body=chunk_json(i - 1, text)))
    await f.frame(req, Frame(kind="end", seq=len(STREAM_TEXTS) + 1))


async def test_a_frame_lost_mid_stream_is_sent_again_and_the_answer_is_whole(start_frontend, multi):
    fe = await start_frontend(request_max_retries=2)
    multi.scripts[W1] = token_then_a_lost_frame
    status, headers, raw = await post(fe, chat_body(stream=True))
    assert status == 200 and stream_texts(raw) == STREAM_TEXTS  # in order, none twice
    assert multi.replays == [(headers["X-Request-Id"], 2)] and multi.placed == [W1] and multi.cancels == []
    metrics = await metrics_text(fe)
    assert "infera_frontend_frames_replayed_total 1.0" in metrics and "infera_frontend_frames_lost_total 0.0" in metrics


async def test_a_frame_lost_mid_stream_that_the_worker_no_longer_has_ends_the_stream_with_an_error(
        start_frontend, multi):
    fe = await start_frontend(request_max_retries=2)
    multi.scripts[W1] = token_then_a_lost_frame
    multi.keeps_frames = False
    status, headers, raw = await post(fe, chat_body(stream=True))
    assert status == 200
    payloads = sse_payloads(raw)
    assert json.loads(payloads[0])["choices"][0]["delta"]["content"] == "Two"  # what came before the gap
    err = json.loads(payloads[1])["error"]
    assert err["message"].startswith("response frames from worker w1 from number 2 on were lost in transit")
    assert "no longer has them" in err["message"]
    assert payloads[2] == b"[DONE]" and len(payloads) == 3  # nothing after the gap reaches the client
    assert multi.placed == [W1]  # the client has part of the answer: not retried
    await wait_until(lambda: (W1, headers["X-Request-Id"]) in multi.cancels)  # the worker stops
    assert "infera_frontend_frames_lost_total 1.0" in await metrics_text(fe)


async def test_a_lost_first_frame_is_sent_again_or_the_request_retried_on_another_worker(start_frontend, multi):
    fe = await start_frontend()
    multi.scripts[W1] = a_lost_head
    status, _, raw = await post(fe, chat_body(stream=True))  # the data frames reveal the gap
    assert status == 200 and stream_texts(raw) == STREAM_TEXTS and multi.placed == [W1]
    multi.keeps_frames = False
    status, headers, raw = await post(fe, chat_body(stream=True))
    assert status == 200 and stream_texts(raw) == STREAM_TEXTS and multi.placed == [W1, W1, W2]
    await wait_until(lambda: (W1, headers["X-Request-Id"]) in multi.cancels)
    assert 'infera_frontend_retries_total{reason="frames_lost"} 1.0' in await metrics_text(fe)


# After a reconnect the frontend asks each worker of its open requests how many frames it sent
# (``Relay.resync``, what ``Reconnects`` runs): frames published while it was away never arrive.

async def resync_when(multi, fe, request_id_seen) -> None:
    """Run the frontend's reconnect check once the worker has done its part."""
    await wait_until(lambda: request_id_seen(multi))
    await fe.relay.resync()


async def two_frames_lost_at_the_end(f, req):
    """Data 2 and 3 and the end went out while nobody listened; nothing more comes."""
    if not req.stream:
        await f.frame(req, Frame(kind="head", status=200, body=completion_json(), final=True), lost=True)
        return
    await f.frame(req, Frame(kind="head", status=200))
    for i, text in enumerate(STREAM_TEXTS, start=1):
        await f.frame(req, Frame(kind="data", seq=i, body=chunk_json(i - 1, text)), lost=i > 1)
    await f.frame(req, Frame(kind="end", seq=len(STREAM_TEXTS) + 1), lost=True)


@pytest.mark.parametrize("sender", ["worker", "router"])
@pytest.mark.parametrize("stream", [False, True])
async def test_frames_sent_while_the_frontend_was_away_are_sent_again_at_the_reconnect(
        start_frontend, multi, stream, sender):
    """``sender``: who the route reply says sends the frames (the router, on --request-transport http)."""
    fe = await start_frontend(upstream_timeout=120)
    multi.scripts[W1] = two_frames_lost_at_the_end
    multi.frames_from = sender
    answer = asyncio.create_task(post(fe, chat_body(stream=stream)))
    await resync_when(multi, fe, lambda m: m.sent)
    status, headers, raw = await asyncio.wait_for(answer, 30)  # not the 120 s upstream timeout
    assert status == 200
    assert stream_texts(raw) == STREAM_TEXTS if stream else raw == completion_json()
    assert multi.replays == [(headers["X-Request-Id"], 2 if stream else 0)] and multi.placed == [W1]
    expected = ([frames_query_subject(W1), frames_replay_subject(W1)] if sender == "worker"
                else [router_frames_query_subject("r1"), router_frames_replay_subject("r1")])
    assert multi.asked == [(subject, W1) for subject in expected]  # whoever sends the frames, about W1's


async def test_frames_sent_while_the_frontend_was_away_and_no_longer_kept_end_the_stream(start_frontend, multi):
    fe = await start_frontend(upstream_timeout=120)
    multi.scripts[W1] = two_frames_lost_at_the_end
    multi.keeps_frames = False
    answer = asyncio.create_task(post(fe, chat_body(stream=True)))
    await resync_when(multi, fe, lambda m: m.sent)
    status, headers, raw = await asyncio.wait_for(answer, 30)
    payloads = sse_payloads(raw)
    assert status == 200 and json.loads(payloads[0])["choices"][0]["delta"]["content"] == "Two"
    assert "from number 2 on were lost in transit" in json.loads(payloads[1])["error"]["message"]
    assert payloads[2:] == [b"[DONE]"] and multi.placed == [W1]
    await wait_until(lambda: (W1, headers["X-Request-Id"]) in multi.cancels)
    assert "infera_frontend_frames_lost_total 1.0" in await metrics_text(fe)


async def test_a_request_its_worker_never_received_is_retried_at_the_reconnect(start_frontend, multi):
    """Its envelope was in the queue of a broker that restarted: the worker does not know it."""
    fe = await start_frontend(upstream_timeout=120)
    multi.scripts[W1] = lambda f, req: asyncio.sleep(0)  # nothing arrives, nothing was sent
    released = await multi.nc.subscribe(router_release_subject("r1"))
    await flush_all(multi.nc)
    answer = asyncio.create_task(post(fe, chat_body()))
    await resync_when(multi, fe, lambda m: m.placed == [W1])
    status, headers, raw = await asyncio.wait_for(answer, 30)
    assert status == 200 and raw == completion_json()
    assert multi.placed == [W1, W2]
    await wait_until(lambda: (W1, headers["X-Request-Id"]) in multi.cancels)  # dropped if it ever comes
    # its router gets the lease back, as the worker would have released it
    assert decode(Release, (await released.next_msg(timeout=5)).data) == Release(
        lease_id="lease-1", worker_id=W1, outcome="cancelled")
    assert 'infera_frontend_retries_total{reason="frames_lost"} 1.0' in await metrics_text(fe)


async def test_a_request_with_every_frame_arrived_goes_on_after_the_reconnect(start_frontend, multi):
    fe = await start_frontend(upstream_timeout=120)
    go_on = asyncio.Event()

    async def pause_at_the_reconnect(f, req):
        await f.frame(req, Frame(kind="head", status=200))
        await f.frame(req, Frame(kind="data", seq=1, body=chunk_json(0, STREAM_TEXTS[0])))
        f.sent[req.request_id] = 2
        await go_on.wait()
        for i, text in enumerate(STREAM_TEXTS[1:], start=2):
            await f.frame(req, Frame(kind="data", seq=i, body=chunk_json(i - 1, text)))
        await f.frame(req, Frame(kind="end", seq=len(STREAM_TEXTS) + 1))

    multi.scripts[W1] = pause_at_the_reconnect
    answer = asyncio.create_task(post(fe, chat_body(stream=True)))
    await resync_when(multi, fe, lambda m: m.sent)
    await asyncio.sleep(1.0)  # past the grace given to frames on their way
    go_on.set()
    status, _, raw = await asyncio.wait_for(answer, 30)
    assert status == 200 and stream_texts(raw) == STREAM_TEXTS
    assert multi.cancels == [] and multi.replays == []  # nothing was missing: nothing asked again
    assert "infera_frontend_frames_lost_total 0.0" in await metrics_text(fe)


@pytest.mark.parametrize("script", [
    engine_answer(400, b'{"object": "error", "message": "max_tokens is too large", "type": "BadRequestError"}'),
    engine_answer(500, b'{"message": "engine bug"}'),
    agent_error(499, "cancelled by the requester"),
    agent_error(409, "request id already running"),
    agent_error(500, "worker-agent failure"),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_final_failures_are_not_retried(start_frontend, multi, script, stream):
    fe = await start_frontend(request_max_retries=2)
    multi.scripts[W1] = script
    status, _, raw = await post(fe, chat_body(stream=stream))
    assert status in (400, 409, 499, 500)
    assert json.loads(raw)["error"]["message"]
    assert multi.placed == [W1]
    assert "infera_frontend_retries_total{" not in await metrics_text(fe)


async def test_exhausted_retries_return_the_last_error(start_frontend, multi):
    fe = await start_frontend(request_max_retries=1)
    multi.scripts[W1] = agent_error(502, "engine unreachable: connection refused")
    multi.scripts[W2] = agent_error(503, "worker-agent stopping")
    for stream in (False, True):
        multi.routed.clear(), multi.placed.clear()
        status, headers, raw = await post(fe, chat_body(stream=stream))
        assert status == 503 and headers["Content-Type"].startswith("application/json")
        err = json.loads(raw)["error"]
        assert err["message"] == "worker-agent stopping" and err["type"] == "service_unavailable_error"
        assert multi.placed == [W1, W2]
        assert [r.exclude for r in multi.routed] == [[], [W1]]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_leg_stopped_by_its_prefills_failure_is_retried_without_that_prefill_worker(
        start_frontend, multi, stream):
    """A disaggregated pair's prefill engine died: the router stopped the decode leg (W1) naming the
    prefill worker. The retry must avoid the prefill worker, not W1 (the only decode worker of an
    xP1D fleet: excluding it left nothing to retry on)."""
    fe = await start_frontend(request_max_retries=1)
    seen: list[str] = []

    async def prefill_failed_once(f, req):
        seen.append(req.request_id)
        if len(seen) == 1:
            await f.frame(req, Frame(kind="error", status=502, failed_worker="w-prefill-1",
                                     message="the prefill leg of this disaggregated request failed on worker "
                                             "w-prefill-1: its worker left"))
        else:
            await script_ok(f, req)

    multi.scripts[W1] = prefill_failed_once
    status, _, raw = await post(fe, chat_body(stream=stream))
    assert status == 200
    assert multi.placed == [W1, W1]
    assert [r.exclude for r in multi.routed] == [[], ["w-prefill-1"]]


async def test_two_retries_exclude_every_worker_tried(start_frontend, multi):
    fe = await start_frontend(request_max_retries=2)
    multi.scripts[W1] = agent_error(502)
    multi.scripts[W2] = agent_error(504, "deadline passed before the worker started the request")
    status, _, raw = await post(fe, chat_body())
    assert status == 200 and raw == completion_json()
    assert [r.exclude for r in multi.routed] == [[], [W1], [W1, W2]]


async def test_no_retry_with_max_retries_0(start_frontend, multi):
    fe = await start_frontend(request_max_retries=0)
    multi.scripts[W1] = agent_error(503, "worker is draining")
    status, _, raw = await post(fe, chat_body(stream=True))
    assert status == 503 and json.loads(raw)["error"]["message"] == "worker is draining"
    assert multi.placed == [W1]


async def test_engine_429_is_retried_and_stands_when_no_other_worker_is_left(start_frontend, multi):
    fe = await start_frontend(request_max_retries=1)
    multi.workers[:] = [W1]  # the router has nowhere else to go: it refuses the retry with 503
    multi.scripts[W1] = engine_answer(429, b'{"object": "error", "message": "engine queue full", "type": "x"}')
    status, _, raw = await post(fe, chat_body())
    assert status == 429 and json.loads(raw)["error"]["message"] == "engine queue full"
    assert len(multi.routed) == 2 and multi.routed[1].exclude == [W1] and multi.placed == [W1]
    assert 'infera_frontend_retries_total{reason="engine_429"} 1.0' in await metrics_text(fe)

    multi.workers[:] = [W1, W2]
    assert (await post(fe, chat_body()))[0] == 200 and multi.placed[-2:] == [W1, W2]


async def test_no_router_retries_then_503(make_frontend, nats_server):
    nc = await connect(nats_server, "registrar-only")
    registrar = Registrar(nc.jetstream(), worker_record(W1))
    await registrar.start()
    try:
        fe = await make_frontend(request_max_retries=1, route_timeout=1.0)
        await wait_until(lambda: fe.models.is_known(MODEL))
        status, _, raw = await post(fe, chat_body())
        assert status == 503 and json.loads(raw)["error"]["message"] == "router unavailable"
        assert 'infera_frontend_retries_total{reason="no_router"} 1.0' in await metrics_text(fe)
    finally:
        await registrar.stop()
        await nc.close()


async def test_a_router_that_subscribes_within_the_route_timeout_gets_the_request(make_frontend, nats_server):
    """Routers reconnecting after a broker restart: the route request is sent again meanwhile."""
    nc = await connect(nats_server, "late-router")
    fleet = MultiFleet(nc, [W1])
    registrar = Registrar(nc.jetstream(), worker_record(W1))
    await registrar.start()
    try:
        fe = await make_frontend(request_max_retries=0, route_timeout=10.0)
        await wait_until(lambda: fe.models.is_known(MODEL))
        answer = asyncio.create_task(post(fe, chat_body()))
        await asyncio.sleep(1.0)  # no router: NATS answers "no responders" to each try
        await nc.subscribe(ROUTER_ROUTE, queue=ROUTER_QUEUE, cb=fleet.on_route)
        status, _, raw = await answer
        assert status == 200 and raw == completion_json()
        assert len(fleet.routed) == 1  # it reached the router once
    finally:
        await registrar.stop()
        await nc.close()


# --- NATS API ------------------------------------------------------------------------------------

async def test_nats_api_requests_fail_over_too(start_frontend, multi, nats_server):
    await start_frontend()
    multi.scripts[W1] = agent_error(502, "engine unreachable")
    client = InferaClient(nats_server, timeout=5.0)
    await client.connect()
    try:
        chunks = [c async for c in client.stream_chat(chat_body())]
        assert [c["choices"][0]["delta"]["content"] for c in chunks] == STREAM_TEXTS
        assert multi.placed == [W1, W2]
        multi.placed.clear()
        assert (await client.chat(chat_body()))["choices"][0]["message"]["content"] == "2"
        assert multi.placed == [W1, W2]

        multi.scripts[W2] = agent_error(503, "worker-agent stopping")
        with pytest.raises(InferaError) as info:
            await client.chat(chat_body())
        assert info.value.status == 503
    finally:
        await client.close()

