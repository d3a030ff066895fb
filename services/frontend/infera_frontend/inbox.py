"""One reply subscription per frontend process, dispatching messages to per-request mailboxes.

Every request gets its own subject ``_INBOX.<frontend_id>-<start>.<n>``: the router's ``RouteReply``
and the worker's ``Frame``s for that request both arrive there, through the single wildcard
subscription ``_INBOX.<frontend_id>-<start>.*`` (no subscription per request). ``<start>`` is new
at every start of the process: a frontend restarted under the same ``--frontend-id`` does not
answer for its predecessor's requests (``requester_watch`` stops them on their engines).
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections import deque
from collections.abc import Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from infera_common.clock_offsets import time_answer
from infera_common.nats_conn import unsubscribe_quietly
from infera_common.subjects import ALIVE_TOKEN, frontend_inbox_prefix


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Mailbox:
    """A request's messages in arrival order; lighter than ``asyncio.Queue`` (one waiter at most).

    At most ``limit`` messages wait unread (0: no limit): a stream whose client reads more slowly
    than its engine writes would otherwise pile up in this process without bound (the engine does
    not slow down for it). The first message past it calls ``on_overflow`` once; those past it are
    dropped. ``force`` puts a message all the same (the reader's end marker)."""

    __slots__ = ("_loop", "_items", "_waiter", "limit", "on_overflow", "_overflowed")

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int = 0) -> None:
        self._loop = loop
        self._items: deque[Msg] = deque()
        self._waiter: asyncio.Future | None = None
        self.limit = limit
        self.on_overflow: Callable[[], None] | None = None
        self._overflowed = False

    def put(self, msg: Msg) -> None:
        if self.limit and len(self._items) >= self.limit:
            if not self._overflowed:
                self._overflowed = True
                if self.on_overflow is not None:
                    self.on_overflow()
            return
        self.force(msg)

    def force(self, msg: Msg) -> None:
        self._items.append(msg)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def push_front(self, msgs: list[Msg]) -> None:
        """Put back messages taken out early, ahead of everything else."""
        self._items.extendleft(reversed(msgs))

    def empty(self) -> bool:
        return not self._items

    def __len__(self) -> int:
        return len(self._items)

    def get_nowait(self) -> Msg:
        return self._items.popleft()

    async def get(self, timeout: float) -> Msg:
        """The next message; ``TimeoutError`` if none arrives within ``timeout`` seconds."""
        if self._items:
            return self._items.popleft()
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(timeout, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        if self._items:
            return self._items.popleft()
        raise TimeoutError


class Inbox:
    def __init__(self, nc: NATS, frontend_id: str, max_unread: int = 0) -> None:
        self._nc = nc
        self.max_unread = max_unread  # each mailbox's limit
        self.prefix = frontend_inbox_prefix(f"{frontend_id}-{uuid.uuid4().hex[:8]}")
        self.alive_subject = self.prefix + ALIVE_TOKEN  # where workers ask whether it is on the bus
        self._boxes: dict[str, Mailbox] = {}
        self._ids = itertools.count(1)
        self._sub = None

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self.prefix + "*", cb=self._on_msg)

    async def stop(self) -> None:
        if self._sub is not None:
            await unsubscribe_quietly(self._sub)
            self._sub = None

    def open(self) -> tuple[str, Mailbox]:
        subject = f"{self.prefix}{next(self._ids)}"
        box = Mailbox(asyncio.get_running_loop(), self.max_unread)
        self._boxes[subject] = box
        return subject, box

    def release(self, subject: str) -> None:
        self._boxes.pop(subject, None)

    def __len__(self) -> int:
        return len(self._boxes)

    async def _on_msg(self, msg: Msg) -> None:
        box = self._boxes.get(msg.subject)
        if box is not None:
            box.put(msg)
        elif msg.subject == self.alive_subject and msg.reply:  # a worker asks (``requester_watch``), or a
            await msg.respond(time_answer(time.time()))  # router the time (``requester_clocks``)
        # else: for a request no longer waiting (e.g. its client left)
