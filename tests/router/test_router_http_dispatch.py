"""``--request-transport http``: the router calls the engine's HTTP API itself (real nats-server for the
route RPC and the frames, a scripted engine over real HTTP)."""

from __future__ import annotations

import json

import nats.errors
import pytest

from infera_common.discovery import Registrar
from infera_common.nats_conn import connect
from infera_common.schemas import (
    Cancel, Frame, FramesQuery, FramesReplay, FramesReplayed, FramesSent, RouteReply, WorkerStatus, decode, encode,
)
from infera_common.subjects import (
    ROUTER_ROUTE, cancel_subject, router_frames_query_subject, router_frames_replay_subject,
)

from infera_router.service import RouterService
from infera_router.settings import RouterSettings

from router_helpers import record, route_request
from test_router_service import eventually
from tests.worker_agent.fake_engine import FakeEngine


class Rig:
    def __init__(self, router: RouterService, nc, engine: FakeEngine) -> None:
        self.router, self.nc, self.engine = router, nc, engine
        self.registrars: list[Registrar] = []

    async def worker(self, wid: str, url: str | None = None, max_pending: int = 10) -> None:
        reg = Registrar(self.nc.jetstream(), record(wid, url=url or self.engine.url, max_pending=max_pending,
                                                    request_transport="http"))
        await reg.start()
        self.registrars.append(reg)
        await eventually(lambda: (w := self.router.core.fleet.get(wid)) is not None
                         and w.record.status == WorkerStatus.ACTIVE)

    async def send(self, rid: str, body: dict, stream: bool = True):
        """Route one request; returns the router's reply and the subscription its frames arrive on."""
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        req = route_request(request_id=rid, body=json.dumps(body).encode(), stream=stream)
        req.reply_subject = inbox
        msg = await self.nc.request(ROUTER_ROUTE, encode(req), timeout=5)
        return decode(RouteReply, msg.data), sub

    @staticmethod
    async def frames(sub, until_end: bool = True) -> list[Frame]:
        out: list[Frame] = []
        while True:
            frame = decode(Frame, (await sub.next_msg(timeout=10)).data)
            if frame.kind == "head" and frame.final or frame.kind in ("end", "error") and until_end:
                return [*out, frame]
            out.append(frame)
            if not until_end and frame.kind == "data":
                return out

    def metric(self, name: str, **labels) -> float:
        return self.router.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def rig(nats_server):
    engine = await FakeEngine().start()
    router = RouterService(RouterSettings(nats_url=nats_server, router_id="rh", router_policy="round-robin",
                                          request_transport="http"))
    await router.start()
    nc = await connect(nats_server, "test-client")
    r = Rig(router, nc, engine)
    yield r
    for reg in r.registrars:
        await reg.stop()
    await router.stop()
    await nc.close()
    await engine.close()


async def test_stream_goes_straight_to_the_engine_and_the_lease_comes_back(rig):
    await rig.worker("a")
    reply, sub = await rig.send("q1", {"mode": "stream", "events": 3})
    assert (reply.status, reply.worker_id) == (200, "a")
    frames = await rig.frames(sub)
    assert [f.kind for f in frames] == ["head", "data", "data", "data", "end"]
    assert [json.loads(f.body)["i"] for f in frames[1:4]] == [0, 1, 2]
    seen = rig.engine.requests[0]
    assert seen["path"] == "/v1/chat/completions" and seen["headers"]["x-request-id"] == "q1"
    await eventually(lambda: rig.router.core.leases.count("a") == 0)
    assert rig.metric("infera_router_http_requests_total", outcome="ok") == 1
    assert rig.metric("infera_router_lease_releases_total", outcome="ok") == 1


async def test_unary_answer_is_one_final_head(rig):
    await rig.worker("a")
    reply, sub = await rig.send("q2", {"mode": "json"}, stream=False)
    frames = await rig.frames(sub)
    assert len(frames) == 1 and frames[0].final and frames[0].status == 200
    assert json.loads(frames[0].body)["choices"][0]["text"] == "hello"


async def test_cancel_closes_the_connection_aborts_the_engine_and_releases(rig):
    await rig.worker("a")
    reply, sub = await rig.send("q3", {"mode": "hang", "events": 1})
    assert reply.status == 200
    first = await rig.frames(sub, until_end=False)
    assert first[-1].kind == "data"
    await rig.nc.publish(cancel_subject("a"), encode(Cancel(request_id="q3")))
    frames = await rig.frames(sub)
    assert frames[-1].kind == "error" and frames[-1].status == 499
    await eventually(lambda: "q3" in rig.engine.aborts and "q3" in rig.engine.cancelled)
    await eventually(lambda: rig.router.core.leases.count("a") == 0)
    assert rig.metric("infera_router_lease_releases_total", outcome="cancelled") == 1


async def test_max_pending_is_the_workers_limit_on_running_requests(rig):
    await rig.worker("a", max_pending=1)
    reply, sub = await rig.send("q4", {"mode": "hang", "events": 1})
    assert reply.status == 200
    await rig.frames(sub, until_end=False)
    second, _ = await rig.send("q5", {"mode": "json"}, stream=False)
    assert second.status == 429 and "pending limit" in second.message
    await rig.nc.publish(cancel_subject("a"), encode(Cancel(request_id="q4")))
    await eventually(lambda: rig.router.core.leases.count("a") == 0)
    third, sub3 = await rig.send("q6", {"mode": "json"}, stream=False)
    assert third.status == 200 and (await rig.frames(sub3))[0].status == 200


async def test_unreachable_engine_is_a_502_error_frame_and_a_failed_release(rig):
    from infera.procs import free_port

    await rig.worker("dead", url=f"http://127.0.0.1:{free_port()}")
    await rig.worker("w1")
    reply, sub = await rig.send("q7", {"mode": "json"}, stream=False)
    assert reply.status == 200 and reply.worker_id == "dead"  # round-robin, in the order they joined
    frames = await rig.frames(sub)
    # nothing of the request ran: the frontend may try it elsewhere without spending a retry
    assert frames[-1].kind == "error" and frames[-1].status == 502 and frames[-1].unreached
    await eventually(lambda: rig.metric("infera_router_lease_releases_total", outcome="error") == 1)
    assert rig.router.core.leases.count("dead") == 0
    # a refused connection opens its breaker at once (not after three faults): the next requests go to w1
    await eventually(lambda: rig.metric("infera_router_breaker_trips_total", worker="dead") == 1)
    for rid in ("q8", "q9", "q10"):
        reply, sub = await rig.send(rid, {"mode": "json"}, stream=False)
        assert reply.worker_id == "w1"
        assert (await rig.frames(sub))[-1].status == 200


async def test_a_worker_turning_unhealthy_hands_back_its_unanswered_calls(rig):
    await rig.worker("a")
    _, waiting = await rig.send("q1", {"mode": "hang", "events": 0})  # the engine sent headers only
    _, started = await rig.send("q2", {"mode": "hang", "events": 1})  # a token went out
    assert (await rig.frames(started, until_end=False))[-1].kind == "data"
    await rig.registrars[0].set_status(WorkerStatus.UNHEALTHY)  # what its agent registers
    assert [(f.kind, f.status) for f in (await rig.frames(waiting))[-1:]] == [("error", 503)]
    await eventually(lambda: rig.metric("infera_router_http_in_flight") == 1)  # q2 goes on
    await rig.nc.publish(cancel_subject("a"), encode(Cancel(request_id="q2")))  # (not left to the teardown)
    await eventually(lambda: rig.metric("infera_router_http_in_flight") == 0)


async def test_the_router_answers_for_the_frames_it_sent(rig):
    """On this plane the router sends the frames, so a frontend back from a broker outage asks it
    (the subject its route reply names) what it sent, and has lost frames sent again."""
    await rig.worker("a")
    await rig.worker("b")
    reply, sub = await rig.send("q1", {"mode": "stream", "events": 3})
    assert reply.frames_from == "router" and reply.router_id == "rh"
    frames = await rig.frames(sub)
    worker = reply.worker_id

    async def ask(subject: str, question, answer_type, timeout: float = 5):
        return decode(answer_type, (await rig.nc.request(subject, encode(question), timeout=timeout)).data)

    sent = await ask(router_frames_query_subject("rh"),
                     FramesQuery(request_ids=["q1", "never-seen"], worker_id=worker), FramesSent)
    assert sent.sent == {"q1": len(frames)}  # a request it does not run is left out: never received
    other = "b" if worker == "a" else "a"
    assert (await ask(router_frames_query_subject("rh"), FramesQuery(request_ids=["q1"], worker_id=other),
                      FramesSent)).sent == {}  # (worker, request) is the key, as at an agent
    replayed = await ask(router_frames_replay_subject("rh"),
                         FramesReplay(request_id="q1", from_seq=2, worker_id=worker), FramesReplayed)
    assert replayed.count == len(frames) - 2
    again = [decode(Frame, (await sub.next_msg(timeout=5)).data) for _ in range(replayed.count)]
    assert [f.seq for f in again] == list(range(2, len(frames))) and again[-1].kind == "end"
    assert (await ask(router_frames_replay_subject("rh"), FramesReplay(request_id="nope", from_seq=0, worker_id=worker),
                      FramesReplayed)).count == -1
    # a question without the worker cannot be answered right by a router: counted, not answered
    with pytest.raises(nats.errors.TimeoutError):
        await ask(router_frames_query_subject("rh"), FramesQuery(request_ids=["q1"]), FramesSent, timeout=0.5)
    assert rig.metric("infera_router_http_frames_queries_total", outcome="answered") == 2
    assert rig.metric("infera_router_http_frames_queries_total", outcome="bad") == 1
    assert rig.metric("infera_router_http_frames_replays_total", outcome="sent") == 1
    assert rig.metric("infera_router_http_frames_replays_total", outcome="not_kept") == 1


@pytest.mark.parametrize("drain_timeout, mode, last", [(10.0, "stream", ("end", 0)), (0.3, "hang", ("error", 503))])
async def test_a_stopping_router_lets_its_engine_calls_finish_within_the_drain_timeout(
        nats_server, drain_timeout, mode, last):
    """SIGTERM: a stream under way finishes whole (``--drain-timeout``); one that outlasts it ends
    with the router's 503 instead of leaving its requester waiting."""
    engine = await FakeEngine().start()
    router = RouterService(RouterSettings(nats_url=nats_server, router_id="rd", router_policy="round-robin",
                                          request_transport="http", drain_timeout=drain_timeout))
    await router.start()
    nc = await connect(nats_server, "test-client")
    r = Rig(router, nc, engine)
    try:
        await r.worker("a")
        _, sub = await r.send("q1", {"mode": mode, "events": 3, "delay": 0.2})
        assert (await r.frames(sub, until_end=False))[-1].kind == "data"
        await router.stop()
        frames = await r.frames(sub)
        assert (frames[-1].kind, frames[-1].status if frames[-1].kind == "error" else 0) == last
        if mode == "stream":
            assert [f.kind for f in frames] == ["data", "data", "end"]  # the rest of the stream, whole
    finally:
        for reg in r.registrars:
            await reg.stop()
        await router.stop()
        await nc.close()
        await engine.close()
