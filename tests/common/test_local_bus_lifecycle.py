"""The in-process bus: unsubscribe, drain and close, as nats-py clients see them."""

from __future__ import annotations

import asyncio

import pytest
from nats import errors
from nats.aio.msg import Msg

from infera_common.local_bus import JetStreamUnavailableError, LocalBus
from infera_common.nats_conn import close_connection, unsubscribe_quietly
from tests.common.local_bus_helpers import Gated, Recorder, bus, settle  # noqa: F401  (the fixture)

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
    cb = Gated()
    sub = await nc.subscribe("s", cb=cb)
    for data in (b"1", b"2", b"3"):
        await nc.publish("s", data)
    draining = asyncio.create_task(sub.drain())
    while bus.subscription_count():
        await asyncio.sleep(0)
    await nc.publish("s", b"late")  # after the drain began: not for this subscription any more
    cb.gate.set()
    await draining
    assert cb.data == [b"1", b"2", b"3"]
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
    cb = Gated()
    await nc.subscribe("s", cb=cb)
    await nc.publish("s", b"1")
    await nc.publish("s", b"2")
    closing = asyncio.create_task(close_connection(nc))
    while not nc.is_draining:
        await asyncio.sleep(0)
    assert nc.is_connected and cb.data == []
    cb.gate.set()
    await closing
    assert cb.data == [b"1", b"2"] and nc.is_closed
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
