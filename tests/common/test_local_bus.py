"""The in-process bus (``python -m infera.server``): core-NATS delivery, no responders and request/reply."""

from __future__ import annotations

import asyncio

import pytest
from nats import errors
from nats.aio.msg import Msg

from infera_common.local_bus import DEFAULT_MAX_PAYLOAD, LocalBus
from infera_common.subject_match import subject_error
from infera_common.subjects import KV_INDEXER_QUEUE, KV_QUERY, ROUTER_QUEUE, ROUTER_ROUTE
from tests.common.local_bus_helpers import Gated, Recorder, bus, settle  # noqa: F401  (the fixture)

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
    slow = Gated()
    sub = await nc.subscribe("s", cb=slow, pending_msgs_limit=5)
    for i in range(20):  # the callback is stuck: publish still returns at once
        await nc.publish("s", str(i).encode())
    assert sub.pending_msgs == 5 and sub.dropped == 15
    assert bus.metrics.registry.get_sample_value("infera_bus_dropped_messages_total",
                                                 {"client": "t", "subject": "s"}) == 15
    slow.gate.set()
    await settle(bus)
    assert slow.data == [str(i).encode() for i in range(5)]


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
