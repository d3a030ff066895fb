"""The request plane of one worker in-process: real nats-server, scripted engine."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import nats.errors
import pytest
from nats.js.errors import BadRequestError

from infera_common.nats_conn import connect, ensure_request_stream
from infera_common.schemas import Cancel, Frame, FramesQuery, FramesReplay, FramesReplayed, FramesSent, Prefilled, Release, WorkEnvelope, decode, encode
from infera_common.subjects import (
    cancel_subject, frames_query_subject, frames_replay_subject, request_stream, router_prefilled_subject, router_release_subject, work_consumer, work_subject,
)
from infera_common.engine_relay import EngineAborter
from infera_worker_agent.metrics import AgentMetrics
from infera_common.engine_relay import Relay
from infera_worker_agent.worker import RequestWorker, StopReason

from .fake_engine import FakeEngine

WID = "w-test"
ROUTER = "router-t"


class Harness:
    def __init__(self, nc, engine: FakeEngine, worker: RequestWorker, metrics: AgentMetrics, session) -> None:
        self.nc, self.js, self.engine, self.worker, self.metrics, self.session = nc, nc.jetstream(), engine, worker, metrics, session
        self.releases: list[Release] = []
        self.notes: list[Prefilled | Release] = []  # prefilled notes and releases, in arrival order
        self._n = 0

    async def start(self) -> None:
        async def on_release(msg):
            self.releases.append(decode(Release, msg.data))
            self.notes.append(self.releases[-1])

        async def on_prefilled(msg):
            self.notes.append(decode(Prefilled, msg.data))

        await self.nc.subscribe(router_release_subject(ROUTER), cb=on_release)
        await self.nc.subscribe(router_prefilled_subject(ROUTER), cb=on_prefilled)

    async def submit(self, body: dict, *, stream: bool = True, deadline_in: float = 30.0, rid: str | None = None,
                     keepalive: float | None = None, lease: str | None = None):
        """Publish an envelope; returns (request_id, frame subscription)."""
        self._n += 1
        rid = rid or f"req-{self._n}"
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        env = WorkEnvelope(request_id=rid, endpoint="/v1/completions", body=json.dumps(body).encode(), stream=stream,
                           reply_subject=inbox, deadline=time.time() + deadline_in, lease_id=lease or f"lease-{rid}",
                           router_id=ROUTER, keepalive=keepalive)
        await self.js.publish(work_subject(WID), encode(env))
        return rid, sub

    async def frames(self, sub, timeout: float = 10.0) -> list[Frame]:
        out = []
        while True:
            f = decode(Frame, (await sub.next_msg(timeout=timeout)).data)
            out.append(f)
            if f.kind in ("end", "error") or f.final:
                return out

    async def released(self, lease_id: str, timeout: float = 5.0) -> list[Release]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = [r for r in self.releases if r.lease_id == lease_id]
            if got:
                await asyncio.sleep(0.1)  # a second release would show up now
                return [r for r in self.releases if r.lease_id == lease_id]
            await asyncio.sleep(0.01)
        return []

    async def stream_msgs(self) -> int:
        return (await self.js.stream_info(request_stream(WID))).state.messages


async def make_harness(nats_url: str, *, max_pending: int = 16, ack_wait: float = 30.0, finds_hangs: bool = True):
    nc = await connect(nats_url, "test")
    engine = await FakeEngine().start()
    session = aiohttp.ClientSession()
    metrics = AgentMetrics()
    await ensure_request_stream(nc.jetstream(), WID, max_pending, 60.0)
    worker = RequestWorker(nc=nc, js=nc.jetstream(), worker_id=WID, max_pending=max_pending,
                           relay=Relay(session, engine.url), abort=EngineAborter(session, engine.url, "/abort_request"),
                           metrics=metrics, finds_hangs=finds_hangs, ack_wait=ack_wait)
    h = Harness(nc, engine, worker, metrics, session)
    await h.start()  # listen for releases before the worker takes work already queued
    await nc.flush()
    await worker.start()
    return h


async def close_harness(h: Harness) -> None:
    await h.worker.close()
    await h.session.close()
    await h.engine.close()
    await h.nc.close()


@pytest.fixture
async def h(nats_server):
    harness = await make_harness(nats_server)
    yield harness
    await close_harness(harness)


async def test_stream_relayed_acked_and_released_once(h):
    rid, sub = await h.submit({"stream": True, "events": 2})
    frames = await h.frames(sub)
    assert [f.kind for f in frames] == ["head", "data", "data", "end"]
    assert [r.outcome for r in await h.released(f"lease-{rid}")] == ["ok"]
    assert await h.stream_msgs() == 0  # acked: gone from the work queue
    assert h.worker.in_flight == 0


async def test_the_router_hears_once_when_a_stream_s_prefill_is_done_and_never_for_unary(h):
    rid, sub = await h.submit({"stream": True, "events": 3})
    await h.frames(sub)
    await h.released(f"lease-{rid}")
    assert [(type(n).__name__, n.lease_id) for n in h.notes] == [("Prefilled", f"lease-{rid}"), ("Release", f"lease-{rid}")]
    h.notes.clear()
    rid, sub = await h.submit({"stream": False}, stream=False)
    await h.frames(sub)
    await h.released(f"lease-{rid}")
    assert [type(n).__name__ for n in h.notes] == ["Release"]


async def test_many_concurrent_requests_each_released_exactly_once(h):
    subs = [await h.submit({"stream": True, "events": 3, "delay": 0.05}) for _ in range(12)]
    for _, sub in subs:
        assert (await h.frames(sub))[-1].kind == "end"
    for rid, _ in subs:
        assert [r.outcome for r in await h.released(f"lease-{rid}", timeout=2)] == ["ok"]
    assert len(h.releases) == 12
    assert h.metrics.requests.labels("ok")._value.get() == 12


async def test_malformed_envelope_is_dropped_counted_and_the_worker_goes_on(h):
    await h.js.publish(work_subject(WID), b"\x93not an envelope")
    await h.js.publish(work_subject(WID), encode(Cancel(request_id="wrong type")))
    rid, sub = await h.submit({"mode": "json"}, stream=False)
    assert [(f.kind, f.final) for f in await h.frames(sub)] == [("head", True)]
    assert h.metrics.bad_envelopes._value.get() == 2
    await asyncio.sleep(0.1)
    assert await h.stream_msgs() == 0
    assert len(h.releases) == 1


async def test_expired_envelope_is_not_sent_to_the_engine(h):
    rid, sub = await h.submit({"mode": "json"}, stream=False, deadline_in=-1)
    frames = await h.frames(sub)
    assert [(f.kind, f.status) for f in frames] == [("error", 504)]
    assert [r.outcome for r in await h.released(f"lease-{rid}")] == ["expired"]
    assert h.engine.requests == []


async def test_cancel_before_the_envelope_drops_it(h):
    await h.nc.publish(cancel_subject(WID), encode(Cancel(request_id="early")))
    await h.nc.flush()
    await asyncio.sleep(0.1)
    rid, sub = await h.submit({"mode": "json"}, stream=False, rid="early")
    frames = await h.frames(sub)
    assert [f.kind for f in frames] == ["error"]
    assert [r.outcome for r in await h.released("lease-early")] == ["cancelled"]
    assert h.engine.requests == []


async def test_a_cancel_for_a_failure_elsewhere_before_the_envelope_answers_it_with_that_failure(h):
    """A disaggregated pair's prefill refused or failed before the decode leg's envelope was read: the
    requester gets the prefill's failure (and the worker to avoid), not 499 'cancelled'."""
    why = "the prefill leg of this disaggregated request failed on worker w-p: engine gone"
    await h.nc.publish(cancel_subject(WID), encode(Cancel(request_id="early", status=502, message=why,
                                                         failed_worker="w-p")))
    await h.nc.flush()
    await asyncio.sleep(0.1)
    rid, sub = await h.submit({"mode": "json"}, stream=False, rid="early")
    [frame] = await h.frames(sub)
    assert (frame.kind, frame.status, frame.message, frame.failed_worker) == ("error", 502, why, "w-p")
    assert [r.outcome for r in await h.released("lease-early")] == ["cancelled"]
    assert h.engine.requests == []


async def test_a_cancel_naming_a_lease_spares_a_retry_of_the_request_under_another_lease(h):
    """The decode leg of a pair was stopped (its prefill failed) and the request is retried with a new
    pair on the same decode worker: the retry runs; only the stopped lease is refused or stopped."""
    stop = Cancel(request_id="again", status=502, message="prefill failed", failed_worker="w-p", lease_id="lease-1")
    await h.nc.publish(cancel_subject(WID), encode(stop))
    await h.nc.flush()
    await asyncio.sleep(0.1)
    _, late = await h.submit({"mode": "json"}, stream=False, rid="again", lease="lease-1")
    assert [(f.kind, f.status) for f in await h.frames(late)] == [("error", 502)]  # the stopped attempt
    _, retry = await h.submit({"stream": True, "mode": "hang", "events": 1}, rid="again", lease="lease-2")
    assert [decode(Frame, (await retry.next_msg(timeout=5)).data).kind for _ in range(2)] == ["head", "data"]
    await h.nc.publish(cancel_subject(WID), encode(stop))  # a copy of the first cancel: still not this one
    await h.nc.flush()
    await asyncio.sleep(0.2)
    assert h.worker.in_flight == 1
    await h.nc.publish(cancel_subject(WID), encode(Cancel(request_id="again", lease_id="lease-2")))
    assert [(f.kind, f.status) for f in await h.frames(retry)] == [("error", 499)]


async def test_cancel_in_flight_closes_the_engine_connection_and_aborts(h):
    rid, sub = await h.submit({"stream": True, "mode": "hang", "events": 1})
    first = [decode(Frame, (await sub.next_msg(timeout=5)).data) for _ in range(2)]
    assert [f.kind for f in first] == ["head", "data"]
    await h.nc.publish(cancel_subject(WID), encode(Cancel(request_id=rid)))
    rest = await h.frames(sub)
    assert [(f.kind, f.status) for f in rest] == [("error", 499)]
    assert [r.outcome for r in await h.released(f"lease-{rid}")] == ["cancelled"]
    for _ in range(100):
        if h.engine.cancelled and h.engine.aborts:
            break
        await asyncio.sleep(0.02)
    assert h.engine.cancelled == [rid] and h.engine.aborts == [rid]
    assert h.metrics.cancels._value.get() == 1
    assert await h.stream_msgs() == 0


async def test_a_cancel_for_a_failure_elsewhere_reaches_the_requester_as_that_failure(h):
    rid, sub = await h.submit({"stream": True, "mode": "hang", "events": 1})
    [decode(Frame, (await sub.next_msg(timeout=5)).data) for _ in range(2)]
    why = "the prefill leg of this disaggregated request failed"
    stop = Cancel(request_id=rid, status=502, message=why, failed_worker="w-p")
    await h.nc.publish(cancel_subject(WID), encode(stop))
    assert [(f.kind, f.status, f.message, f.failed_worker) for f in await h.frames(sub)] == [
        ("error", 502, why, "w-p")]
    assert [r.outcome for r in await h.released(f"lease-{rid}")] == ["cancelled"]  # not this worker's fault


async def test_a_requester_that_timed_out_on_the_worker_releases_the_lease_as_an_error(h):
    rid, sub = await h.submit({"stream": True, "mode": "hang", "events": 1})
    [decode(Frame, (await sub.next_msg(timeout=5)).data) for _ in range(2)]
    await h.nc.publish(cancel_subject(WID), encode(Cancel(request_id=rid, status=504, message="nothing for 60s",
                                                         worker_fault=True)))
    assert [(f.kind, f.status) for f in await h.frames(sub)] == [("error", 504)]
    assert [r.outcome for r in await h.released(f"lease-{rid}")] == ["error"]  # the router's breaker counts it


async def test_drain_refuses_queued_work_while_in_flight_work_finishes(h):
    rid, sub = await h.submit({"stream": True, "events": 4, "delay": 0.2})
    await sub.next_msg(timeout=5)  # head: it is running
    h.worker.begin_drain(StopReason("cancelled", 503, "draining", abort_engine=False))
    rid2, sub2 = await h.submit({"mode": "json"}, stream=False)
    assert [(f.kind, f.status) for f in await h.frames(sub2)] == [("error", 503)]
    assert [r.outcome for r in await h.released(f"lease-{rid2}")] == ["cancelled"]
    assert (await h.frames(sub))[-1].kind == "end"
    assert await h.worker.wait_idle(5)
    assert [r.outcome for r in await h.released(f"lease-{rid}")] == ["ok"]
    assert len(h.engine.requests) == 1


async def test_stop_all_fails_in_flight_requests_with_the_reason(h):
    rid, sub = await h.submit({"stream": True, "mode": "hang", "events": 1})
    await sub.next_msg(timeout=5)
    await sub.next_msg(timeout=5)
    assert h.worker.stop_all(StopReason("error", 502, "engine exited", abort_engine=False)) == 1
    frames = await h.frames(sub)
    assert [(f.kind, f.status, f.message) for f in frames] == [("error", 502, "engine exited")]
    assert [r.outcome for r in await h.released(f"lease-{rid}")] == ["error"]
    assert h.engine.aborts == []


async def test_long_request_is_kept_alive_past_ack_wait(nats_server):
    h = await make_harness(nats_server, ack_wait=1.0)
    try:
        rid, sub = await h.submit({"stream": True, "events": 5, "delay": 0.6})
        await asyncio.sleep(2.0)  # twice the ack wait, still running
        info = await h.js.consumer_info(request_stream(WID), work_consumer(WID))
        assert info.num_ack_pending == 1 and info.num_redelivered == 0
        assert (await h.frames(sub))[-1].kind == "end"
        await h.released(f"lease-{rid}")
        assert await h.stream_msgs() == 0  # the late ack still removed it from the queue
    finally:
        await close_harness(h)


async def test_the_worker_tells_a_reconnected_frontend_how_many_frames_each_request_sent(h):
    async def ask(*request_ids: str) -> dict[str, int]:
        msg = await h.nc.request(frames_query_subject(WID), encode(FramesQuery(request_ids=list(request_ids))), timeout=5)
        return decode(FramesSent, msg.data).sent

    rid, sub = await h.submit({"stream": True, "mode": "hang", "events": 2})
    running = [await sub.next_msg(timeout=5) for _ in range(3)]  # head and two data frames, still running
    assert await ask(rid, "never-received") == {rid: len(running)}
    await h.nc.publish(cancel_subject(WID), encode(Cancel(request_id=rid)))
    frames = running + [(await sub.next_msg(timeout=5))]  # its error frame
    await h.released(f"lease-{rid}")
    assert await ask(rid) == {rid: len(frames)}  # remembered once finished
    rid2, sub2 = await h.submit({"mode": "json"}, stream=False, deadline_in=-1)  # refused at once: one frame
    await h.frames(sub2)
    assert await ask(rid2, rid) == {rid2: 1, rid: 4}


async def test_the_worker_sends_frames_again_from_a_number_on(h):
    async def replay(rid: str, from_seq: int) -> int:
        msg = await h.nc.request(frames_replay_subject(WID), encode(FramesReplay(request_id=rid, from_seq=from_seq)),
                                 timeout=5)
        return decode(FramesReplayed, msg.data).count

    rid, sub = await h.submit({"stream": True, "events": 3})
    first = await h.frames(sub)
    assert [f.kind for f in first] == ["head", "data", "data", "data", "end"]
    await h.released(f"lease-{rid}")
    assert await replay(rid, 2) == 3  # finished: its frames are still kept
    again = [decode(Frame, (await sub.next_msg(timeout=5)).data) for _ in range(3)]
    assert again == first[2:]  # the same frames, same numbers, to the same requester
    assert await replay(rid, 6) == -1 and await replay("never-received", 0) == -1


async def test_an_unreadable_question_is_counted_and_the_worker_answers_the_next(h):
    for subject in (frames_query_subject(WID), frames_replay_subject(WID)):
        with pytest.raises(nats.errors.TimeoutError):
            await h.nc.request(subject, b"\xc1 not msgpack", timeout=0.3)
    assert h.metrics.frames_queries.labels("bad")._value.get() == 1
    assert h.metrics.frames_replays.labels("bad")._value.get() == 1
    msg = await h.nc.request(frames_query_subject(WID), encode(FramesQuery(request_ids=["x"])), timeout=5)
    assert decode(FramesSent, msg.data).sent == {}


async def test_work_queued_before_the_agent_started_is_answered(nats_server):
    """Envelopes already in the worker's queue when its agent (re)starts are each run once."""
    nc = await connect(nats_server, "early")
    await ensure_request_stream(nc.jetstream(), WID, 16, 60.0)
    early = Harness(nc, None, None, None, None)  # only its submit/frames helpers
    queued = [await early.submit({"mode": "json"}, stream=False, rid=f"early-{i}") for i in range(2)]
    h = await make_harness(nats_server)
    try:
        for rid, sub in queued:
            assert [(f.kind, f.status, f.final) for f in await h.frames(sub)] == [("head", 200, True)]
            assert [r.outcome for r in await h.released(f"lease-{rid}")] == ["ok"]
        assert sorted(r["headers"]["x-request-id"] for r in h.engine.requests) == ["early-0", "early-1"]
    finally:
        await close_harness(h)
        await nc.close()


async def test_cancel_and_stop_together_give_one_error_and_one_release(h):
    rid, sub = await h.submit({"stream": True, "mode": "hang", "events": 1})
    await sub.next_msg(timeout=5)
    await sub.next_msg(timeout=5)  # head, data: it runs
    await h.nc.publish(cancel_subject(WID), encode(Cancel(request_id=rid)))
    await h.nc.flush()
    for _ in range(500):  # until the agent has taken the cancel
        if h.metrics.cancels._value.get() == 1:
            break
        await asyncio.sleep(0.01)
    assert h.worker.stop_all(StopReason("error", 502, "engine exited", abort_engine=False)) == 0  # already stopping
    frames = await h.frames(sub)
    assert [(f.kind, f.status) for f in frames] == [("error", 499)]
    assert [r.outcome for r in await h.released(f"lease-{rid}", timeout=2)] == ["cancelled"]
    assert await h.worker.wait_idle(5) and h.worker.in_flight == 0


async def test_a_sealed_queue_refuses_new_work_delivers_what_it_held_and_a_restart_reopens_it(nats_server):
    """What a worker-agent on its way out relies on: envelopes stored before the seal are still
    delivered (and refused while draining), envelopes after it are refused by the broker."""
    nc = await connect(nats_server, "early")
    await ensure_request_stream(nc.jetstream(), WID, 16, 60.0)
    early = Harness(nc, None, None, None, None)  # only its submit/frames helpers
    held = [await early.submit({"mode": "json"}, stream=False, rid=f"held-{i}") for i in range(3)]
    h = await make_harness(nats_server)  # the consumer starts with three envelopes stored
    try:
        h.worker.begin_drain(StopReason("cancelled", 503, "draining", abort_engine=False))
        await h.worker.seal_queue()
        with pytest.raises(BadRequestError, match="sealed"):
            await h.submit({"mode": "json"}, stream=False)
        assert await h.worker.wait_delivered(5) == 0
        for rid, sub in held:
            assert [(f.kind, f.status) for f in await h.frames(sub)] in ([("error", 503)], [("head", 200)])
        assert await h.worker.wait_idle(5)
    finally:
        await close_harness(h)
    await ensure_request_stream(nc.jetstream(), WID, 16, 60.0)  # the next agent of this worker
    assert not (await nc.jetstream().stream_info(request_stream(WID))).config.sealed
    await early.submit({"mode": "json"}, stream=False)  # stored again
    await nc.close()


async def test_requests_with_nothing_answered_yet_are_handed_back_and_started_ones_are_left(h):
    waiting_rid, waiting = await h.submit({"stream": True, "mode": "hang", "events": 0})  # head only
    started_rid, started = await h.submit({"stream": True, "mode": "hang", "events": 1})  # a token out
    unary_rid, unary = await h.submit({"stream": False, "mode": "hang", "events": 0}, stream=False)
    assert (await waiting.next_msg(timeout=5)) and (await started.next_msg(timeout=5))  # heads
    assert decode(Frame, (await started.next_msg(timeout=5)).data).kind == "data"
    for _ in range(250):  # until the unary request is running too
        if h.worker.in_flight == 3:
            break
        await asyncio.sleep(0.02)
    reason = StopReason("error", 503, "engine stopped answering")
    assert h.worker.stop_unanswered(reason) == 2
    assert [(f.kind, f.status) for f in await h.frames(waiting)] == [("error", 503)]
    assert [(f.kind, f.status) for f in await h.frames(unary)] == [("error", 503)]
    with pytest.raises(nats.errors.TimeoutError):
        await started.next_msg(timeout=0.3)  # the client has part of this answer: it goes on
    assert h.worker.in_flight == 1
    h.worker.stop_all(reason)


async def test_a_request_waiting_on_its_engine_is_said_alive_until_its_answer_begins(h):
    rid, unary = await h.submit({"mode": "json", "delay": 1.5}, stream=False, keepalive=0.2)
    frames = await h.frames(unary)
    assert [f.kind for f in frames[-1:]] == ["head"] and frames[-1].final
    alive = frames[:-1]
    assert len(alive) >= 3 and {(f.kind, f.seq) for f in alive} == {("alive", 0)}  # numbered as the head
    rid, stream = await h.submit({"stream": True, "events": 2, "delay": 1.0}, keepalive=0.2)
    kinds = [(f.kind, f.seq) for f in await h.frames(stream)]
    first_data = kinds.index(("data", 1))
    assert kinds[0] == ("head", 0) and kinds[first_data:] == [("data", 1), ("data", 2), ("end", 3)]
    # alive frames take no number (data and end are 1..3) and none come once a token went out
    assert len(kinds[1:first_data]) >= 2 and set(kinds[1:first_data]) == {("alive", 1)}
    rid, quiet = await h.submit({"mode": "json", "delay": 0.8}, stream=False)  # not asked: none
    assert [f.kind for f in await h.frames(quiet)] == ["head"]


async def test_no_alive_frames_for_an_engine_whose_hang_the_agent_would_not_find(nats_server):
    h = await make_harness(nats_server, finds_hangs=False)  # e.g. --no-engine-stall-check on vLLM
    try:
        rid, unary = await h.submit({"mode": "json", "delay": 0.8}, stream=False, keepalive=0.1)
        assert [f.kind for f in await h.frames(unary)] == ["head"]  # the requester's timeout stays the guard
    finally:
        await close_harness(h)
