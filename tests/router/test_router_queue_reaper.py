"""The queue reaper (``queue_reaper.py``) around a broker outage: every worker leaves discovery while
the broker is away, and a live agent needs a moment after the broker is back to bind its consumer
again. Its queue must not be deleted in that moment (a broker-restart test once caught it)."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.errors import NotFoundError

from infera_router import queue_reaper as reaper_module
from infera_router.queue_reaper import QueueReaper

GRACE = 0.3


class Broker:
    """The two JetStream calls the reaper makes; nothing is bound to any consumer."""

    def __init__(self) -> None:
        self.is_connected = True
        self.deleted: list[str] = []

    def jetstream(self):
        return self

    async def consumer_info(self, stream: str, consumer: str):
        raise NotFoundError

    async def delete_stream(self, stream: str) -> None:
        self.deleted.append(stream)


@pytest.fixture(autouse=True)
def no_margin(monkeypatch):
    monkeypatch.setattr(reaper_module, "MARGIN", 0.0)


async def test_a_queue_nothing_reads_is_deleted_one_grace_after_its_worker_left():
    broker = Broker()
    reaper = QueueReaper(broker, lambda wid: False, lambda: None)
    reaper.left("w1", GRACE)
    await asyncio.sleep(GRACE / 2)
    assert broker.deleted == []
    await asyncio.sleep(GRACE)
    assert broker.deleted == ["INFERA_REQ_w1"]


async def test_a_worker_that_left_during_a_broker_outage_gets_a_whole_grace_after_the_broker_is_back():
    broker = Broker()
    listed: set[str] = set()
    reaper = QueueReaper(broker, lambda wid: wid in listed, lambda: None)
    broker.is_connected = False
    reaper.left("w1", GRACE)  # aged out of discovery while the broker was away
    await asyncio.sleep(GRACE * 1.5)  # its grace ends during the outage
    broker.is_connected = True
    reaper.reconnected()
    await asyncio.sleep(GRACE / 2)  # its agent reconnects, registers and binds meanwhile
    assert broker.deleted == []
    listed.add("w1")
    await asyncio.sleep(GRACE)
    assert broker.deleted == []
    await reaper.stop()


async def test_the_grace_after_a_reconnect_runs_even_when_the_timer_slept_through_the_outage():
    broker = Broker()
    reaper = QueueReaper(broker, lambda wid: False, lambda: None)
    reaper.left("w1", GRACE)
    await asyncio.sleep(GRACE * 0.9)
    reaper.reconnected()  # the broker was away and came back just before the grace ended
    await asyncio.sleep(GRACE * 0.5)
    assert broker.deleted == []  # (before, it was deleted here: the agent had not bound yet)
    await asyncio.sleep(GRACE)
    assert broker.deleted == ["INFERA_REQ_w1"]  # nobody came back for it
