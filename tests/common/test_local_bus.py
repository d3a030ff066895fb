"""The in-process bus (``python -m infera.server``): core-NATS semantics, and the services' own NATS code on it."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from nats import errors
from nats.aio.msg import Msg

from infera_common.local_bus import DEFAULT_MAX_PAYLOAD, JetStreamUnavailableError, LocalBus
from infera_common.nats_conn import close_connection, unsubscribe_quietly
from infera_common.schemas import Endpoint, OverlapReply, RouteReply, decode, encode
from infera_common.subject_match import subject_error
from infera_common.subjects import KV_INDEXER_QUEUE, KV_QUERY, ROUTER_QUEUE, ROUTER_ROUTE

# --- helpers -----------------------------------------------------------------------------------


class Recorder:
    """A subscription callback that keeps what it received (and wakes waiters)."""

    def __init__(self) -> None:
        self.msgs: list[Msg] = []
        self._changed = asyncio.Event()

    async def __call__(self, msg: Msg) -> None:
        self.msgs.append(msg)
        self._changed.set()

    async def wait_for(self, n: int) -> list[Msg]:
        while len(self.msgs) < n:
            self._changed.clear()
            await self._changed.wait()
        return self.msgs

    @property
    def data(self) -> list[bytes]:
        return [m.data for m in self.msgs]


async def settle(bus: LocalBus) -> None:
    """Let every subscription task handle what is pending."""
    while bus.pending_messages():
        await asyncio.sleep(0)
    await asyncio.sleep(0)


@pytest.fixture
async def bus():
    b = LocalBus()
    yield b
    await b.close()


# --- delivery ----------------------------------------------------------------------------------


async def test_wildcards_reach_every_matching_subscription(bus):
    nc = bus.connect("t")
    recs = {p: Recorder() for p in ("infera.load.*", "infera.>", "infera.load.w1", ">", "*.load.w2", "other")}
    for p, rec in recs.items():
        await nc.subscribe(p, cb=rec)
    await nc.publish("infera.load.w1", b"1")
    await nc.publish("infera.load.w2", b"2")
    await nc.publish("infera.kv.events.w1", b"3")
    await settle(bus)
    assert {p: r.data for p, r in recs.items()} == {
        "infera.load.*": [b"1", b"2"], "infera.>": [b"1", b"2", b"3"], "infera.load.w1": [b"1"],
        ">": [b"1", b"2", b"3"], "*.load.w2": [b"2"], "other": [],
    }
    msg = recs["infera.load.*"].msgs[0]
    assert (msg.subject, msg.reply, msg.headers) == ("infera.load.w1", "", None)


async def test_a_queue_group_shares_messages_while_plain_subscribers_get_all(bus):
    routers = [bus.connect(f"router-{i}") for i in range(3)]
    members = [Recorder() for _ in routers]
    for nc, rec in zip(routers, members):
        await nc.subscribe(ROUTER_ROUTE, queue=ROUTER_QUEUE, cb=rec)
    other_group, plain = Recorder(), Recorder()
    await routers[0].subscribe(ROUTER_ROUTE, queue="audit", cb=other_group)
    await routers[1].subscribe(ROUTER_ROUTE, cb=plain)
    frontend = bus.connect("frontend")
    sent = [str(i).encode() for i in range(300)]
    for data in sent:
        await frontend.publish(ROUTER_ROUTE, data)
    await settle(bus)
    shared = sorted((d for rec in members for d in rec.data), key=int)
    assert shared == sent  # each message to exactly one member of the group
    assert all(rec.msgs for rec in members)  # spread among them (at random)
    assert other_group.data == sent and plain.data == sent


async def test_one_subscription_gets_its_messages_in_order_and_one_callback_at_a_time(bus):
    nc = bus.connect("t")
    got, running, overlap = [], 0, []

    async def cb(msg: Msg) -> None:
        nonlocal running
        running += 1
        overlap.append(running)
        await asyncio.sleep(0)  # a callback that suspends does not let the next message in
        got.append(int(msg.data))
        running -= 1

    await nc.subscribe("seq", cb=cb)
    for i in range(500):
        await nc.publish("seq", str(i).encode())
    await settle(bus)
    assert got == list(range(500))
    assert max(overlap) == 1


async def test_different_subscriptions_run_concurrently(bus):
    nc = bus.connect("t")
    released = asyncio.Event()
    done = asyncio.Event()

    async def waits(_msg: Msg) -> None:  # would block forever if B's callback could not run meanwhile
        await released.wait()
        done.set()

    async def releases(_msg: Msg) -> None:
        released.set()

    await nc.subscribe("a", cb=waits)
    await nc.subscribe("b", cb=releases)
    await nc.publish("a")
    await nc.publish("b")
    await done.wait()


async def test_a_callback_that_raises_is_counted_and_the_subscription_goes_on(bus):
    nc = bus.connect("t")
    got = []

    async def cb(msg: Msg) -> None:
        if msg.data == b"bad":
            raise ValueError("boom")
        got.append(msg.data)

    await nc.subscribe("s", cb=cb)
    for data in (b"1", b"bad", b"2"):
        await nc.publish("s", data)
    await settle(bus)
    assert got == [b"1", b"2"]
    assert bus.metrics.registry.get_sample_value("infera_bus_callback_errors_total",
                                                 {"client": "t", "subject": "s"}) == 1


async def test_a_slow_consumer_loses_the_overflow_and_publish_never_waits(bus):
    nc = bus.connect("t")
    gate = asyncio.Event()
    got = []

    async def slow(msg: Msg) -> None:
        await gate.wait()
        got.append(msg.data)

    sub = await nc.subscribe("s", cb=slow, pending_msgs_limit=5)
    for i in range(20):  # the callback is stuck: publish still returns at once
        await nc.publish("s", str(i).encode())
    assert sub.pending_msgs == 5 and sub.dropped == 15
    assert bus.metrics.registry.get_sample_value("infera_bus_dropped_messages_total",
                                                 {"client": "t", "subject": "s"}) == 15
    gate.set()
    await settle(bus)
    assert got == [str(i).encode() for i in range(5)]


async def test_payloads_arrive_as_bytes_and_headers_as_a_copy(bus):
    nc = bus.connect("t")
    rec = Recorder()
    await nc.subscribe("s", cb=rec)
    payload = b"x" * 1000
    headers = {"Nats-Kind": "data"}
    await nc.publish("s", payload, headers=headers)
    await nc.publish("s", bytearray(b"ba"))
    await settle(bus)
    assert rec.msgs[0].data is payload  # not copied
    assert rec.msgs[0].headers == headers and rec.msgs[0].headers is not headers
    assert type(rec.msgs[1].data) is bytes and rec.data[1] == b"ba"


async def test_max_payload_is_a_nats_servers_default_unless_configured():
    small, large = LocalBus(), LocalBus(max_payload=64 << 20)
    assert small.connect().max_payload == DEFAULT_MAX_PAYLOAD == 1 << 20
    with pytest.raises(errors.MaxPayloadError):
        await small.connect().publish("s", b"x" * (DEFAULT_MAX_PAYLOAD + 1))
    await large.connect().publish("s", b"x" * (DEFAULT_MAX_PAYLOAD + 1))
    assert large.connect().max_payload == 64 << 20


async def test_invalid_subjects_are_refused(bus):
    nc = bus.connect("t")
    with pytest.raises(errors.BadSubjectError):
        await nc.publish("a.*", b"")
    with pytest.raises(errors.BadSubjectError):
        await nc.publish("a b", b"")
    with pytest.raises(errors.BadSubjectError):
        await nc.subscribe("a.>.b", cb=Recorder())


# --- no responders and request/reply -----------------------------------------------------------


async def test_a_publish_with_a_reply_nobody_receives_gets_no_responders_on_its_reply_subject(bus):
    from infera_router.jetstream import parse_pub_ack

    frontend, other = bus.connect("frontend"), bus.connect("other")
    inbox, eavesdropper = Recorder(), Recorder()
    await frontend.subscribe("_INBOX.fe.*", cb=inbox)
    await other.subscribe("_INBOX.fe.*", cb=eavesdropper)
    await frontend.publish(ROUTER_ROUTE, b"route me", reply="_INBOX.fe.1")
    (msg,) = await inbox.wait_for(1)
    assert (msg.subject, msg.data, msg.headers) == ("_INBOX.fe.1", b"", {"Status": "503"})
    assert parse_pub_ack(msg.data, msg.headers.get("Status")).kind == "gone"  # the router's reading of it
    await settle(bus)
    assert eavesdropper.msgs == []  # sent to the publishing client only, as a nats-server does
    assert bus.metrics.registry.get_sample_value("infera_bus_no_responders_total") == 1
    assert bus.metrics.registry.get_sample_value("infera_bus_messages_total") == 1  # the 503 is the bus's own


async def test_request_raises_no_responders_then_timeout_as_nats_py_does(bus):
    nc = bus.connect("router")
    with pytest.raises(errors.NoRespondersError):
        await nc.request(KV_QUERY, b"q", timeout=5)

    async def silent(_msg: Msg) -> None:
        pass

    await bus.connect("indexer").subscribe(KV_QUERY, queue=KV_INDEXER_QUEUE, cb=silent)
    with pytest.raises(errors.TimeoutError) as info:
        await nc.request(KV_QUERY, b"q", timeout=0.01)
    assert isinstance(info.value, TimeoutError)  # what the router's KvClient catches


async def test_request_and_respond_round_trip_between_clients(bus):
    async def echo(msg: Msg) -> None:
        await msg.respond(b"re:" + msg.data)

    await bus.connect("indexer").subscribe("svc.*", queue="q", cb=echo)
    nc = bus.connect("router")
    replies = await asyncio.gather(*(nc.request(f"svc.{i}", str(i).encode(), timeout=5) for i in range(50)))
    assert [r.data for r in replies] == [b"re:%d" % i for i in range(50)]
    hdr = await nc.request("svc.h", b"", timeout=5, headers={"X-Request-Id": "r1"})
    assert hdr.headers == {"X-Request-Id": "r1"}  # nats-py's Msg.respond sends the request's headers back


async def test_new_inboxes_are_unique_across_clients(bus):
    inboxes = {nc.new_inbox() for nc in (bus.connect(), bus.connect()) for _ in range(100)}
    assert len(inboxes) == 200
    assert all(i.startswith("_INBOX.") and subject_error(i, pattern=False) is None for i in inboxes)


# --- unsubscribe, drain, close -----------------------------------------------------------------


async def test_unsubscribe_stops_delivery_and_leaves_no_responders(bus):
    nc = bus.connect("t")
    rec, inbox = Recorder(), Recorder()
    sub = await nc.subscribe("s", cb=rec)
    await nc.subscribe("_INBOX.t.*", cb=inbox)
    await nc.publish("s", b"1")
    await settle(bus)
    await sub.unsubscribe()
    await nc.publish("s", b"2", reply="_INBOX.t.1")
    await inbox.wait_for(1)
    assert rec.data == [b"1"]
    assert inbox.msgs[0].headers == {"Status": "503"}
    with pytest.raises(errors.BadSubscriptionError):
        await sub.unsubscribe()
    await unsubscribe_quietly(sub)  # the services' helper shrugs it off
    await unsubscribe_quietly(None)


async def test_unsubscribe_with_a_limit_stops_after_that_many_messages(bus):
    nc = bus.connect("t")
    rec = Recorder()
    sub = await nc.subscribe("s", cb=rec)
    await sub.unsubscribe(limit=2)
    for data in (b"1", b"2", b"3"):
        await nc.publish("s", data)
    await settle(bus)
    assert rec.data == [b"1", b"2"]


async def test_a_callback_can_unsubscribe_its_own_subscription(bus):
    nc = bus.connect("t")
    got, after = [], asyncio.Event()
    sub = None

    async def once(msg: Msg) -> None:
        got.append(msg.data)
        await sub.unsubscribe()
        await asyncio.sleep(0)  # the callback itself runs to its end
        after.set()

    sub = await nc.subscribe("s", cb=once)
    for data in (b"1", b"2", b"3"):
        await nc.publish("s", data)
    await after.wait()
    await settle(bus)
    assert got == [b"1"] and bus.subscription_count() == 0


async def test_drain_handles_what_was_received_then_stops_interest(bus):
    nc = bus.connect("t")
    gate = asyncio.Event()
    got = []

    async def cb(msg: Msg) -> None:
        await gate.wait()
        got.append(msg.data)

    sub = await nc.subscribe("s", cb=cb)
    for data in (b"1", b"2", b"3"):
        await nc.publish("s", data)
    draining = asyncio.create_task(sub.drain())
    while bus.subscription_count():
        await asyncio.sleep(0)
    await nc.publish("s", b"late")  # after the drain began: not for this subscription any more
    gate.set()
    await draining
    assert got == [b"1", b"2", b"3"]
    assert sub.pending_msgs == 0 and bus.subscription_count() == 0


async def test_close_cancels_callbacks_and_refuses_later_use(bus):
    nc = bus.connect("t")
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def stuck(_msg: Msg) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def never(_msg: Msg) -> None:
        pass

    await nc.subscribe("s", cb=stuck)
    await bus.connect("other").subscribe("q", cb=never)
    await nc.publish("s")
    await started.wait()
    in_flight = asyncio.create_task(nc.request("q", b"", timeout=60))
    await asyncio.sleep(0)
    await nc.close()
    assert cancelled.is_set() and nc.is_closed and not nc.is_connected
    with pytest.raises(errors.ConnectionClosedError):
        await in_flight  # ended by the close, not left to its timeout
    with pytest.raises(errors.ConnectionClosedError):
        await nc.publish("s", b"")
    with pytest.raises(errors.ConnectionClosedError):
        await nc.subscribe("s", cb=never)
    with pytest.raises(errors.ConnectionClosedError):
        await nc.flush()
    await nc.close()  # again: nothing happens
    assert [c.name for c in bus.clients] == ["other"]


async def test_a_callback_can_close_its_own_client(bus):
    nc = bus.connect("t")
    got, after = [], asyncio.Event()

    async def closes(msg: Msg) -> None:
        got.append(msg.data)
        await nc.close()
        await asyncio.sleep(0)  # the callback itself runs to its end
        after.set()

    sub = await nc.subscribe("s", cb=closes)
    for data in (b"1", b"2"):
        await nc.publish("s", data)
    await after.wait()
    await sub._task  # its delivery task ends too, the second message never handled
    assert got == [b"1"] and nc.is_closed and bus.subscription_count() == 0


async def test_close_connection_drains_what_is_in_flight_then_closes(bus):
    nc = bus.connect("t")
    gate = asyncio.Event()
    got = []

    async def cb(msg: Msg) -> None:
        await gate.wait()
        got.append(msg.data)

    await nc.subscribe("s", cb=cb)
    await nc.publish("s", b"1")
    await nc.publish("s", b"2")
    closing = asyncio.create_task(close_connection(nc))
    while not nc.is_draining:
        await asyncio.sleep(0)
    assert nc.is_connected and got == []
    gate.set()
    await closing
    assert got == [b"1", b"2"] and nc.is_closed
    with pytest.raises(errors.ConnectionClosedError):
        await nc.publish("s", b"3")
    await close_connection(nc)  # already closed: the helper stays quiet


async def test_a_drain_stuck_on_a_callback_ends_in_a_close():
    bus = LocalBus(drain_timeout=0.01)
    nc, other = bus.connect("t"), bus.connect("other")
    cancelled = asyncio.Event()

    async def stuck(_msg: Msg) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    await nc.subscribe("s", cb=stuck)
    await other.subscribe("s", cb=stuck)
    await nc.publish("s")
    await nc.drain()  # the bus's own drain_timeout
    assert nc.is_closed and cancelled.is_set()
    cancelled.clear()
    await close_connection(other, timeout=0.01)  # the services' helper: its own bound, then close
    assert other.is_closed and cancelled.is_set() and bus.clients == []


async def test_bus_close_closes_every_client():
    bus = LocalBus()
    clients = [bus.connect() for _ in range(3)]
    for nc in clients:
        await nc.subscribe("s", cb=Recorder())
    await bus.close()
    assert all(nc.is_closed for nc in clients) and bus.clients == [] and bus.subscription_count() == 0


async def test_jetstream_is_refused_with_a_clear_message(bus):
    with pytest.raises(JetStreamUnavailableError, match="no JetStream"):
        bus.connect().jetstream()


# --- the services' own NATS code on the bus ----------------------------------------------------


async def test_the_frontend_inbox_relay_and_the_router_publisher_work_on_the_bus(bus):
    from infera_frontend.failover import NO_ROUTER, RetryableError
    from infera_frontend.inbox import Inbox
    from infera_frontend.metrics import FrontendMetrics
    from infera_frontend.relay import Relay
    from infera_frontend.validation import ApiError
    from infera_router.jetstream import AckedPublisher

    fe = bus.connect("frontend")
    inbox = Inbox(fe, "fe-1")
    await inbox.start()
    relay = Relay(fe, inbox, FrontendMetrics(), route_timeout=5, upstream_timeout=5, request_timeout=60)

    async def open_request(body: bytes = b"{}"):
        return await relay.open(request_id="r1", endpoint=Endpoint.CHAT, model="m", body=body, stream=False,
                                token_ids=None, prompt_tokens=1)

    with pytest.raises(RetryableError) as no_router:  # nobody on infera.router.route: NATS "no responders"
        await open_request()
    assert no_router.value.reason == NO_ROUTER and no_router.value.status == 503
    with pytest.raises(ApiError) as too_large:  # the frontend reads the bus's max_payload
        await open_request(b"x" * (DEFAULT_MAX_PAYLOAD + 1))
    assert too_large.value.status == 413

    router = bus.connect("router")

    async def route(msg: Msg) -> None:  # a router that refuses: its reply reaches the request's inbox
        await router.publish(msg.reply, encode(RouteReply(status=404, message="no such model")))

    await router.subscribe(ROUTER_ROUTE, queue=ROUTER_QUEUE, cb=route)
    with pytest.raises(ApiError) as refused:
        await open_request()
    assert refused.value.status == 404 and len(inbox) == 0  # every attempt's mailbox released

    publisher = AckedPublisher(router)  # the router's JetStream publish: with no stream, "no responders"
    await publisher.start()
    results = asyncio.Queue()
    await publisher.publish("infera.work.w1", b"envelope", 5, results.put)
    assert (await results.get()).kind == "gone"

    async def fake_stream(msg: Msg) -> None:
        await msg.respond(b'{"stream": "INFERA_REQ_w1", "seq": 1}')

    await bus.connect("stream").subscribe("infera.work.w1", cb=fake_stream)
    await publisher.publish("infera.work.w1", b"envelope", 5, results.put)
    assert (await results.get()).kind == "stored"
    await publisher.stop()
    await inbox.stop()
    await close_connection(fe)
    await close_connection(router)


async def test_the_router_asks_the_kv_indexer_over_the_bus():
    from infera_kv_indexer.service import KvIndexerService
    from infera_kv_indexer.settings import KvIndexerSettings
    from infera_router.kv_client import KvClient
    from infera_router.metrics import RouterMetrics
    from infera_router.state import WorkerState
    from tests.kv_indexer.kv_fakes import MODEL, FakeEngine, query, record, tokens
    from tests.kv_indexer.test_kv_index import feed

    bus = LocalBus()
    router_nc, indexer_nc = bus.connect("router"), bus.connect("kv-indexer")
    metrics = RouterMetrics()
    kv = KvClient(router_nc, timeout=5, metrics=metrics)
    candidates = [WorkerState(record("w1")), WorkerState(record("w2"))]
    prompt = tokens(16)

    view = await kv.query(query(prompt), candidates)
    assert not view.ok and view.failure == "no_indexer"

    indexer = KvIndexerService(KvIndexerSettings())
    indexer.index.worker_joined("w1", MODEL)
    engine = FakeEngine("w1")
    feed(indexer.index, engine, engine.stored(prompt[:8]))  # w1 caches the first 2 blocks of 4
    sub = await indexer_nc.subscribe(KV_QUERY, queue=KV_INDEXER_QUEUE, cb=indexer._on_query)

    view = await kv.query(query(prompt), candidates)
    assert view.ok and view.depth == {"w1": 2}
    raw = await router_nc.request(KV_QUERY, encode(query(prompt)), timeout=5)
    assert [o.worker_id for o in decode(OverlapReply, raw.data).overlaps] == ["w1"]
    assert msgpack.unpackb(raw.data, raw=False)  # the indexer's own bytes, untouched

    await unsubscribe_quietly(sub)
    await bus.close()
    view = await kv.query(query(prompt), candidates)  # a closed connection: counted, never raised
    assert not view.ok and view.failure == "error"
