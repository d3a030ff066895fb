"""Shared by the in-process bus tests: a recording callback, settling the bus, the ``bus`` fixture."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.msg import Msg

from infera_common.local_bus import LocalBus


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


class Gated(Recorder):
    """A ``Recorder`` whose callback waits until ``gate`` is set: a consumer stuck on its work."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def __call__(self, msg: Msg) -> None:
        await self.gate.wait()
        await super().__call__(msg)


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
