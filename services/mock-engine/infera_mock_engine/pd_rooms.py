"""The prefill engine's table of KV transfers in flight ("rooms"), keyed by (DP rank, bootstrap room or
transfer id). Either side may arrive first: the prefill request `open`s its room, the decode's KV
pull `attach`es to it. A room ends once: `finish` (the KV reached the decode) or `fail` (timeout, abort,
peer gone), which resolves `outcome` for whoever waits and leaves a tombstone, so the side that comes
later (or asks again) fails at once instead of waiting for a timeout.

No I/O: asyncio futures and timers only (the server and the sessions do the waiting).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

Key = tuple[int, "int | str"]


@dataclass(frozen=True)
class KvPayload:
    """What the prefill hands over: the prompt's KV (its size) and the first output token."""

    prompt_tokens: int
    nbytes: int
    first_token: int | None = None


class TransferFailed(Exception):
    """A KV transfer that cannot happen or did not complete; `reason` is the engine-style text and
    `kind` a short label for the failure counters."""

    def __init__(self, reason: str, kind: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


class Room:
    def __init__(self, key: Key) -> None:
        loop = asyncio.get_running_loop()
        self.key = key
        self.opened = False  # the prefill request is here
        self.attached = asyncio.Event()  # a decode is connected (the bootstrap handshake)
        self.payload: asyncio.Future[KvPayload] = loop.create_future()  # the prefill's KV is ready
        self.outcome: asyncio.Future[TransferFailed | None] = loop.create_future()  # None: the KV arrived
        self.timer: asyncio.TimerHandle | None = None

    @property
    def ended(self) -> bool:
        return self.outcome.done()


class RoomTable:
    def __init__(self, tombstone_ttl: float, max_tombstones: int = 65536,
                 clock: Callable[[], float] = time.monotonic,
                 on_fail: Callable[[TransferFailed], None] | None = None) -> None:
        self.tombstone_ttl = tombstone_ttl
        self.on_fail = on_fail
        self.max_tombstones = max_tombstones
        self.clock = clock
        self._rooms: dict[Key, Room] = {}
        self._tombs: OrderedDict[Key, tuple[float, TransferFailed]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rooms)

    def get(self, key: Key) -> Room | None:
        return self._rooms.get(key)

    def open(self, key: Key) -> Room:
        """The prefill side. Raises the tombstone's TransferFailed when the room already ended (its decode
        gave up or it was aborted), or TransferFailed('in use') for a second prefill of one room."""
        self._raise_if_ended(key)
        room = self._rooms.get(key)
        if room is None:
            room = self._rooms[key] = Room(key)
        elif room.opened:
            raise TransferFailed(f"bootstrap room {key[1]} is already in use on DP rank {key[0]} of this prefill "
                                 "engine (two prefill requests with one room)", "duplicate")
        room.opened = True
        return room

    def attach(self, key: Key) -> Room:
        """The decode side (its KV pull connected). Same errors as `open`, for a second decode."""
        self._raise_if_ended(key)
        room = self._rooms.get(key)
        if room is None:
            room = self._rooms[key] = Room(key)
        elif room.attached.is_set():
            raise TransferFailed(f"bootstrap room {key[1]} on DP rank {key[0]} already has a decode attached",
                                 "duplicate")
        room.attached.set()
        return room

    def finish(self, room: Room) -> None:
        """The KV reached the decode."""
        self._drop(room)
        if not room.outcome.done():
            room.outcome.set_result(None)

    def fail(self, room: Room, failure: TransferFailed) -> None:
        """End the room: both sides see `failure` now, and a late side sees it at once."""
        if room.ended:
            return
        self._drop(room)
        room.outcome.set_result(failure)
        self._tombs[room.key] = (self.clock() + self.tombstone_ttl, failure)
        self._tombs.move_to_end(room.key)
        while len(self._tombs) > self.max_tombstones:
            self._tombs.popitem(last=False)
        if self.on_fail is not None:
            self.on_fail(failure)

    def fail_after(self, room: Room, seconds: float, failure: TransferFailed) -> None:
        """Fail the room unless it ended within `seconds` (vLLM's abort timeout for unpulled KV)."""
        if room.timer is not None:
            room.timer.cancel()
        room.timer = asyncio.get_running_loop().call_later(seconds, self.fail, room, failure)

    def fail_all(self, failure: TransferFailed) -> None:
        for room in list(self._rooms.values()):
            self.fail(room, failure)

    def _drop(self, room: Room) -> None:
        if self._rooms.get(room.key) is room:
            del self._rooms[room.key]
        if room.timer is not None:
            room.timer.cancel()
            room.timer = None

    def _raise_if_ended(self, key: Key) -> None:
        tomb = self._tombs.get(key)
        if tomb is None:
            return
        expires, failure = tomb
        if self.clock() >= expires:
            del self._tombs[key]
            return
        raise failure
