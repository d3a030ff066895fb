"""The router service in-process against a real nats-server, with fake workers registered in discovery."""

from __future__ import annotations

import asyncio
import time

import msgpack
import nats.errors
import pytest

from infera_common.clock_offsets import time_answer
from infera_common.discovery import Registrar
from infera_common.frames import decode_frame
from infera_common.nats_conn import connect, ensure_request_stream, flush_all
from infera_common.schemas import (
    LoadReport, Release, RouteReply, WorkEnvelope, WorkerStatus, decode, encode,
)
from infera_common.subjects import (
    ROUTER_PING, ROUTER_ROUTE, load_subject, request_stream, router_release_subject, router_route_subject,
    work_consumer, work_subject,
)

from infera_router.service import RouterService
from infera_router.settings import RouterSettings

from router_helpers import record, route_request
from tests.waiting import eventually




class Bench:
    """A router plus a client connection that plays frontend and worker-agents."""

    def __init__(self, router: RouterService, nc) -> None:
        self.router = router
        self.nc = nc
        self.js = nc.jetstream()
        self.registrars: dict[str, Registrar] = {}

    async def worker(self, wid: str, model: str = "m", max_pending: int = 10, stream: bool = True,
                     status: WorkerStatus = WorkerStatus.ACTIVE, **record_fields) -> Registrar:
        if stream:
            await ensure_request_stream(self.js, wid, max_pending, max_age=60)
        reg = Registrar(self.js, record(wid, model, status, max_pending=max_pending, **record_fields))
        await reg.start()
        self.registrars[wid] = reg
        await eventually(lambda: (w := self.router.core.fleet.get(wid)) is not None and w.record.status == status)
        return reg

    async def route(self, model: str = "m", **kw) -> RouteReply:
        msg = await self.nc.request(ROUTER_ROUTE, encode(route_request(model, **kw)), timeout=5)
        return decode(RouteReply, msg.data)

    async def raw(self, data: bytes) -> RouteReply:
        msg = await self.nc.request(ROUTER_ROUTE, data, timeout=5)
        return decode(RouteReply, msg.data)

    async def pull(self, wid: str, n: int = 10, ack: bool = True) -> list[WorkEnvelope]:
        sub = await self.js.pull_subscribe(work_subject(wid), durable=work_consumer(wid), stream=request_stream(wid))
        try:
            msgs = await sub.fetch(n, timeout=0.5)
        except nats.errors.TimeoutError:  # nothing queued (any other error fails the test)
            return []
        if ack:
            for m in msgs:
                await m.ack_sync()
        return [decode(WorkEnvelope, m.data) for m in msgs]

    def metric(self, name: str, **labels) -> float:
        return self.router.metrics.registry.get_sample_value(name, labels) or 0.0

    def leases(self, wid: str) -> int:
        return self.router.core.leases.count(wid)


@pytest.fixture
async def bench(nats_server, request):
    overrides = {"router_policy": "round-robin", **getattr(request, "param", {})}
    settings = RouterSettings(nats_url=nats_server, router_id="rt1", **overrides)
    router = RouterService(settings)
    await router.start()
    nc = await connect(nats_server, "test-client")
    b = Bench(router, nc)
    yield b
    for reg in b.registrars.values():
        await reg.stop()
    await router.stop()
    await nc.close()


async def test_round_robin_alternates_between_workers_streams(bench):
    await bench.worker("a")
    await bench.worker("b")
    replies = [await bench.route(request_id=f"q{i}", prompt_tokens=7) for i in range(4)]
    assert [r.status for r in replies] == [200] * 4
    assert [r.worker_id for r in replies] == ["a", "b", "a", "b"]
    assert all(r.router_id == "rt1" and r.frames_from == "worker" for r in replies)  # its agent sends the frames
    env_a, env_b = await bench.pull("a"), await bench.pull("b")
    assert [e.request_id for e in env_a] == ["q0", "q2"] and [e.request_id for e in env_b] == ["q1", "q3"]
    assert [e.lease_id for e in env_a + env_b] == [replies[i].lease_id for i in (0, 2, 1, 3)]
    env = env_a[0]
    assert env.router_id == "rt1" and env.body == b'{"x":1}' and env.reply_subject == "_INBOX.test.1"
    assert env.sequences == 1
    assert bench.leases("a") == 2 and bench.leases("b") == 2
    assert bench.metric("infera_router_routed_total", model="m", worker="a", status="200") == 2
    assert bench.metric("infera_router_active_leases", worker="b") == 2
    assert bench.metric("infera_router_live_workers", model="m", status="active") == 2
    await bench.route(request_id="q4", prompt_tokens=7, sequences=6)  # n samples x prompts, as the frontend says
    assert [e.sequences for e in await bench.pull("a")] == [6]


async def frontend_clock(nc, frontend: str, skew: float | None) -> None:
    """Frontend ``frontend``'s ``alive`` subject, answering the time on a clock ``skew`` seconds
    off this host's (None: an older frontend, which answers with an empty message)."""
    async def answer(msg) -> None:
        await msg.respond(b"" if skew is None else time_answer(time.time() + skew))
    await nc.subscribe(f"_INBOX.{frontend}.alive", cb=answer)
    await flush_all(nc)


@pytest.mark.parametrize("skew", [-10.0, 0.0, 10.0])
async def test_a_route_request_its_requester_stopped_waiting_for_is_not_placed(bench, skew):
    """A router stalled past the frontend's --route-timeout (frozen, or far behind) must not place
    the requests it finds waiting when it wakes: their frontends have tried another router, and
    the engines would answer nobody. Stopped waiting by the frontend's clock: a frontend whose host
    clock is 10 s behind the router's is served, not refused (each of its requests looked 5 s late)."""
    await bench.worker("a")
    await frontend_clock(bench.nc, "fe", skew)
    hello = await bench.route(request_id="hello", reply_subject="_INBOX.fe.1", route_deadline=time.time() + skew + 5)
    assert hello.status == 200  # and the router asks the frontend the time
    await eventually(lambda: bench.metric("infera_router_requester_clock_offset_seconds") == pytest.approx(
        abs(skew), abs=0.5) and len(bench.router._clocks) == 1)
    assert [e.request_id for e in await bench.pull("a")] == ["hello"]
    their_now = time.time() + skew
    fresh = await bench.route(request_id="fresh", reply_subject="_INBOX.fe.2", route_deadline=their_now + 5)
    assert fresh.status == 200 and [e.request_id for e in await bench.pull("a")] == ["fresh"]
    stale = await bench.route(request_id="stale", reply_subject="_INBOX.fe.3", route_deadline=their_now - 2)
    assert stale.status == 504 and "stopped waiting" in stale.message
    assert await bench.pull("a") == [] and bench.leases("a") == 2  # hello and fresh
    assert bench.metric("infera_router_route_expired_total") == 1


async def test_route_deadlines_of_a_frontend_whose_clock_is_unknown_are_not_read(bench):
    """Until the router knows how far a frontend's clock is from its own, and for a frontend that
    cannot say (an older one), a deadline that looks past is no reason to refuse: a wrong clock
    would refuse everything."""
    await bench.worker("a")
    await frontend_clock(bench.nc, "old", None)
    for n in range(2):
        reply = await bench.route(request_id=f"old{n}", reply_subject=f"_INBOX.old.{n}", route_deadline=time.time() - 6)
        assert reply.status == 200
        await asyncio.sleep(0.2)  # (its empty answer to the router's question has come)
    unknown = await bench.route(request_id="unknown", reply_subject="_INBOX.nobody.1", route_deadline=time.time() - 6)
    assert unknown.status == 200
    assert [e.request_id for e in await bench.pull("a")] == ["old0", "old1", "unknown"]
    assert bench.metric("infera_router_route_expired_total") == 0


async def test_the_router_says_it_is_there_and_routes_requests_sent_to_it_alone(bench):
    """What a frontend whose route request went unanswered uses to send the retry past the queue
    group, to a router that answers."""
    await bench.worker("a")
    assert (await bench.nc.request(ROUTER_PING, b"", timeout=2)).data == b"rt1"
    msg = await bench.nc.request(router_route_subject("rt1"), encode(route_request(request_id="direct")), timeout=5)
    assert decode(RouteReply, msg.data).status == 200
    assert [e.request_id for e in await bench.pull("a")] == ["direct"]


async def test_unknown_model_404_and_no_active_worker_503(bench):
    assert (await bench.route("nope")).status == 404
    await bench.worker("d", status=WorkerStatus.DRAINING)
    reply = await bench.route("m")
    assert reply.status == 503 and "draining" in reply.message
    assert await bench.pull("d") == []


async def test_full_worker_overflows_to_the_next_then_429(bench):
    await bench.worker("a", max_pending=1)
    await bench.worker("b", max_pending=1)
    first, second = await bench.route(request_id="1"), await bench.route(request_id="2")
    assert (first.worker_id, second.worker_id) == ("a", "b")
    # b's queue empties (its agent took the work); a is still full, so rotation's turn for a spills to b
    assert [e.request_id for e in await bench.pull("b")] == ["2"]
    third = await bench.route(request_id="3")
    assert third.status == 200 and third.worker_id == "b"
    assert bench.leases("a") == 1  # the refused attempt on a left no lease behind
    fourth = await bench.route(request_id="4")
    assert fourth.status == 429 and "all 2 workers" in fourth.message and "pending limit" in fourth.message
    assert bench.leases("a") == 1 and bench.leases("b") == 2
    assert bench.metric("infera_router_publish_refused_total", worker="a", reason="full") == 2
    assert bench.metric("infera_router_routed_total", model="m", worker="", status="429") == 1


async def test_worker_without_a_queue_is_skipped(bench):
    await bench.worker("a", stream=False)
    await bench.worker("b")
    replies = [await bench.route() for _ in range(3)]
    assert [r.worker_id for r in replies] == ["b", "b", "b"]
    assert bench.leases("a") == 0
    assert bench.metric("infera_router_publish_refused_total", worker="a", reason="gone") >= 1
    await bench.registrars.pop("b").stop()
    await eventually(lambda: bench.router.core.fleet.get("b") is None)
    reply = await bench.route()
    assert reply.status == 503 and "without a request queue" in reply.message


@pytest.mark.parametrize("bench", [{"publish_timeout": 0.3}], indirect=True)
async def test_unacknowledged_publish_is_503_without_trying_another_worker(bench):
    """No acknowledgement within --publish-timeout: the work may be queued, so it is not offered twice."""
    await bench.worker("a", stream=False)
    await bench.worker("b")
    swallowed = await bench.nc.subscribe(work_subject("a"))  # takes a's work, never acknowledges
    await flush_all(bench.nc)  # the broker knows the subscription before the router publishes
    reply = await bench.route(request_id="lost")
    assert reply.status == 503 and "worker a" in reply.message and "did not acknowledge" in reply.message
    assert decode(WorkEnvelope, (await swallowed.next_msg(timeout=1)).data).request_id == "lost"
    assert await bench.pull("b") == []  # not offered to b
    assert bench.leases("a") == 0
    assert (await bench.route()).worker_id == "b"  # the router goes on


async def test_exclude_is_honoured(bench):
    await bench.worker("a")
    await bench.worker("b")
    assert {(await bench.route(exclude=["a"])).worker_id for _ in range(3)} == {"b"}
    assert (await bench.route(exclude=["a", "b"])).status == 503


async def test_garbage_gets_400_and_the_router_keeps_serving(bench):
    await bench.worker("a")
    torn_tokens = route_request(token_ids=[1, 2]).model_dump() | {"tokens": b"\x01\x00\x00"}  # not whole ids
    for junk in (b"", b"\xc1garbage", msgpack.packb({"model": "m"}), msgpack.packb([1, 2, 3]), b"{}",
                 msgpack.packb(torn_tokens, use_bin_type=True)):
        reply = await bench.raw(junk)
        assert reply.status == 400 and "RouteRequest" in reply.message
    await bench.nc.publish(router_release_subject("rt1"), b"\xc1")
    await bench.nc.publish(load_subject("a"), b"not msgpack")
    await bench.nc.flush()
    await eventually(lambda: bench.metric("infera_router_bad_messages_total", kind="load") == 1)
    assert bench.metric("infera_router_bad_messages_total", kind="route") == 6
    assert bench.metric("infera_router_bad_messages_total", kind="release") == 1
    assert (await bench.route()).status == 200


async def test_release_frees_the_lease_and_unknown_release_is_counted(bench):
    await bench.worker("a")
    reply = await bench.route()
    assert bench.leases("a") == 1
    release = Release(lease_id=reply.lease_id, worker_id="a", outcome="ok")
    await bench.nc.publish(router_release_subject(reply.router_id), encode(release))
    await eventually(lambda: bench.leases("a") == 0)
    assert bench.metric("infera_router_lease_releases_total", outcome="ok") == 1
    assert bench.metric("infera_router_active_leases", worker="a") == 0
    await bench.nc.publish(router_release_subject("rt1"), encode(release))  # a duplicate
    await eventually(lambda: bench.metric("infera_router_unknown_releases_total") == 1)
    assert bench.metric("infera_router_lease_releases_total", outcome="ok") == 1


async def test_worker_gone_from_discovery_past_its_ttl_drops_its_leases_and_tells_their_requesters(bench):
    await bench.worker("a", ttl=1.0)
    await bench.worker("b")
    inboxes = [f"_INBOX.client.{i}" for i in range(4)]
    heard = await bench.nc.subscribe("_INBOX.client.*")
    for i, inbox in enumerate(inboxes):
        assert (await bench.route(request_id=f"q{i}", reply_subject=inbox)).status == 200
    assert bench.leases("a") == 2
    assert bench.metric("infera_router_routed_total", model="m", worker="a", status="200") == 2
    await bench.registrars.pop("a").stop()  # its agent is gone: nothing will answer q0 and q2
    await eventually(lambda: bench.router.core.fleet.get("a") is None)
    series = bench.router.metrics.registry.get_sample_value  # its per-worker series went with it
    assert series("infera_router_routed_total", {"model": "m", "worker": "a", "status": "200"}) is None
    assert series("infera_router_routed_total", {"model": "m", "worker": "b", "status": "200"}) == 2
    assert bench.leases("a") == 2  # kept for one TTL: an agent that discovery lost for a moment comes back
    told = [await heard.next_msg(timeout=4) for _ in range(2)]
    assert sorted(m.subject for m in told) == [inboxes[0], inboxes[2]]
    frames = [decode_frame(m.data) for m in told]
    assert {(f.kind, f.status) for f in frames} == {("error", 502)} and "worker a left" in frames[0].message
    with pytest.raises(nats.errors.TimeoutError):  # b's requesters are still answered by b
        await heard.next_msg(timeout=0.3)
    assert bench.leases("a") == 0 and bench.leases("b") == 2
    assert bench.metric("infera_router_leases_dropped_total", reason="worker_left") == 2
    assert bench.metric("infera_router_live_workers", model="m", status="active") == 1
    assert [(await bench.route()).worker_id for _ in range(2)] == ["b", "b"]


async def test_a_worker_back_in_discovery_within_its_ttl_keeps_its_requests(bench):
    """A discovery blip (etcd stalled past the TTL, a broker outage): the worker left every view and
    its agent put the same record again. Its requests ran on: nobody is told they failed, and they
    count on it again until its agent releases them."""
    reg = await bench.worker("a", ttl=1.0)
    inbox = "_INBOX.client.blip"
    heard = await bench.nc.subscribe(inbox)
    reply = await bench.route(request_id="q-blip", reply_subject=inbox)
    await bench.registrars.pop("a").stop()
    await eventually(lambda: bench.router.core.fleet.get("a") is None)
    again = Registrar(bench.js, reg.record)  # the same engine start
    await again.start()
    bench.registrars["a"] = again
    await eventually(lambda: bench.router.core.fleet.get("a") is not None)
    assert bench.router.core.fleet.get("a").in_flight == 1
    with pytest.raises(nats.errors.TimeoutError):  # well past its TTL: nothing said to the requester
        await heard.next_msg(timeout=2.5)
    release = Release(lease_id=reply.lease_id, worker_id="a", outcome="ok")
    await bench.nc.publish(router_release_subject(reply.router_id), encode(release))
    await eventually(lambda: bench.leases("a") == 0 and bench.router.core.fleet.get("a").in_flight == 0)
    assert bench.metric("infera_router_leases_dropped_total", reason="worker_left") == 0


@pytest.mark.parametrize("stream_kept", [False, True], ids=["stream-gone", "stored-then-left"])
async def test_a_worker_that_leaves_while_a_request_awaits_its_ack_is_not_charged_to_the_next_one(bench, stream_kept):
    """The worker leaves between the lease and the broker's ack. Gone with its stream: the request
    goes to the next worker and its requester hears nothing of the first (a 502 sent at the leave
    reached the frontend before the route reply and was charged to the worker that reply named).
    Stored before it went: the reply names it, and only then (one TTL on) is the requester told it left."""
    await bench.worker("a", ttl=1.0)
    await bench.worker("b")
    inbox = "_INBOX.client.ack"
    heard = await bench.nc.subscribe(inbox)
    dispatcher = bench.router._dispatcher
    real_send = dispatcher.send

    async def leave_first(worker_id, env, timeout, on_result):
        if worker_id == "a":
            await bench.registrars.pop("a").stop()
            await eventually(lambda: bench.router.core.fleet.get("a") is None)
            if not stream_kept:
                await bench.js.delete_stream(request_stream("a"))
        await real_send(worker_id, env, timeout, on_result)

    dispatcher.send = leave_first
    reply = await bench.route(request_id="q-ack", reply_subject=inbox)  # round-robin: "a" first
    assert reply.status == 200
    if stream_kept:
        assert reply.worker_id == "a"
        frame = decode_frame((await heard.next_msg(timeout=4)).data)  # once its TTL has passed
        assert (frame.kind, frame.status) == ("error", 502) and "worker a left" in frame.message
    else:
        assert reply.worker_id == "b" and bench.leases("b") == 1
        with pytest.raises(nats.errors.TimeoutError):  # nothing charged to b's answer
            await heard.next_msg(timeout=0.5)
    assert bench.leases("a") == 0


async def test_draining_worker_gets_no_new_work_but_keeps_its_leases(bench):
    reg = await bench.worker("a")
    await bench.worker("b")
    await bench.route()
    await reg.set_status(WorkerStatus.DRAINING)
    await eventually(lambda: not bench.router.core.fleet.get("a").active)
    assert {(await bench.route()).worker_id for _ in range(3)} == {"b"}
    assert bench.leases("a") == 1


@pytest.mark.parametrize("bench", [{"lease_max_age": 0.3}], indirect=True)
async def test_lost_release_is_dropped_after_max_age(bench):
    await bench.worker("a")
    await bench.route()
    assert bench.leases("a") == 1
    await eventually(lambda: bench.leases("a") == 0, timeout=3.0)
    assert bench.metric("infera_router_leases_dropped_total", reason="max_age") == 1
    assert bench.metric("infera_router_active_leases", worker="a") == 0


@pytest.mark.parametrize("bench", [{"router_policy": "least-loaded"}], indirect=True)
async def test_least_loaded_follows_leases_and_load_reports(bench):
    await bench.worker("a")
    await bench.worker("b")
    picks = [(await bench.route()).worker_id for _ in range(4)]
    assert sorted(picks) == ["a", "a", "b", "b"]
    # b reports a long engine queue (other routers' work): new work goes to a
    await bench.nc.publish(load_subject("b"), encode(LoadReport(worker_id="b", in_flight=6, engine_waiting=4)))
    await bench.nc.publish(load_subject("ghost"), encode(LoadReport(worker_id="ghost", in_flight=1)))
    await bench.nc.flush()
    await eventually(lambda: bench.metric("infera_router_load_reports_total", result="unknown_worker") == 1)
    assert [(await bench.route()).worker_id for _ in range(3)] == ["a", "a", "a"]


async def test_a_worker_whose_agent_left_the_bus_is_routed_around_until_it_reports_again(bench):
    """A SIGKILLed agent's entry stays in discovery for its TTL, and the broker still accepts work for
    its queue: once its load report is overdue and NATS has no responder for it, no request goes there."""
    from infera_common.schemas import FramesQuery, FramesSent
    from infera_common.subjects import frames_query_subject

    await bench.worker("a")
    await bench.worker("b")

    async def alive(msg):  # a's agent answers; b's holds no subscription any more (killed)
        decode(FramesQuery, msg.data)
        await msg.respond(encode(FramesSent(sent={})))

    await bench.nc.subscribe(frames_query_subject("a"), cb=alive)

    async def report(*wids):
        for wid in wids:
            await bench.nc.publish(load_subject(wid), encode(LoadReport(worker_id=wid, in_flight=0, report_every=0.2)))
        await bench.nc.flush()

    await report("a", "b")
    await eventually(lambda: all(bench.router.core.fleet.get(w).reported_at for w in "ab"))
    assert sorted([(await bench.route()).worker_id for _ in range(4)]) == ["a", "a", "b", "b"]
    for _ in range(8):  # a keeps reporting, b has stopped
        await report("a")
        await asyncio.sleep(0.1)
    await eventually(lambda: bench.metric("infera_router_workers_off_bus_total") == 1)
    assert [(await bench.route()).worker_id for _ in range(4)] == ["a"] * 4  # round-robin would alternate
    await report("b")  # back: its agent reports again
    await eventually(lambda: not bench.router.core.fleet.get("b").off_bus)
    assert sorted([(await bench.route()).worker_id for _ in range(4)]) == ["a", "a", "b", "b"]


async def test_the_queue_of_a_worker_that_left_without_deleting_it_is_deleted_after_its_grace(bench):
    """A killed agent leaves its work-queue stream behind; the router deletes it one TTL after the
    worker left, unless an agent still reads it."""
    from nats.js.api import AckPolicy, ConsumerConfig

    for wid in ("dead", "alive"):
        await bench.worker(wid, ttl=1.0)
    deliver = bench.nc.new_inbox()  # "alive"'s agent: its consumer has a subscriber bound
    await bench.nc.subscribe(deliver)
    await bench.js.add_consumer(request_stream("alive"), config=ConsumerConfig(
        durable_name=work_consumer("alive"), deliver_subject=deliver, ack_policy=AckPolicy.EXPLICIT))
    await bench.js.add_consumer(request_stream("dead"), config=ConsumerConfig(  # nobody reads this one
        durable_name=work_consumer("dead"), deliver_subject="nobody.listens", ack_policy=AckPolicy.EXPLICIT))
    for wid in ("dead", "alive"):  # both leave discovery
        await bench.registrars.pop(wid).stop()
    await eventually(lambda: bench.metric("infera_router_queues_deleted_total") == 1, timeout=10)
    await asyncio.sleep(0.5)  # both were looked at together: "alive"'s is kept
    assert bench.metric("infera_router_queues_deleted_total") == 1
    streams = {name async for name in _stream_names(bench.js)}
    assert request_stream("dead") not in streams and request_stream("alive") in streams


async def _stream_names(js):
    for info in await js.streams_info():
        yield info.config.name


async def test_concurrent_requests_all_answered_and_accounted(bench):
    await bench.worker("a", max_pending=25)
    await bench.worker("b", max_pending=25)
    replies = await asyncio.gather(*(bench.route(request_id=f"c{i}") for i in range(60)))
    statuses = sorted(r.status for r in replies)
    assert statuses.count(200) == 50 and statuses.count(429) == 10
    assert bench.leases("a") == 25 and bench.leases("b") == 25
    assert len({r.lease_id for r in replies if r.status == 200}) == 50


@pytest.fixture
def route_spans(monkeypatch):
    """The spans this process ends during the test: an in-memory exporter behind a provider of the
    test's own (the global one stays the no-op: other tests count on tracing being off)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from infera_common import tracing

    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_TRACER", provider.get_tracer("infera"))
    return exporter


async def test_the_route_span_says_what_the_requester_got_after_the_workers_ack(bench, route_spans):
    # the span used to end with the plan, before the worker's queue answered: 429s were traced as 200
    await bench.worker("a", max_pending=1)
    assert (await bench.route(request_id="1")).status == 200
    assert (await bench.route(request_id="2")).status == 429
    spans = {s.attributes["infera.request_id"]: s for s in route_spans.get_finished_spans() if s.name == "route"}
    assert spans["1"].attributes["infera.route.status"] == 200 and spans["1"].attributes["infera.worker_id"] == "a"
    assert spans["2"].attributes["infera.route.status"] == 429 and "infera.worker_id" not in spans["2"].attributes


async def test_refused_routes_are_logged_once_per_status_not_once_per_request(bench):
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        for i in range(5):  # an outage: every request of a model refused
            assert (await bench.route("nope", request_id=f"r{i}")).status == 404
    refused = [e for e in logs if e["event"] == "route_refused"]
    assert len(refused) == 1 and refused[0]["status"] == 404 and refused[0]["request_id"] == "r0"
    assert bench.metric("infera_router_routed_total", model="nope", worker="", status="404") == 5
