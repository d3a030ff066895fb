"""A subscription of the in-process bus (``local_bus.py``): its pending queue, its delivery task and the
nats-py ``Subscription`` calls (``unsubscribe``, ``drain``, ``next_msg``).

``_deliver`` is called inside ``publish`` and never waits: the message joins the pending queue (or,
past the pending limits, is dropped and counted as a slow consumer). A subscription with a callback
has one task that runs the callbacks one at a time, in arrival order; a callback that raises is
logged and the next message is delivered.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from nats import errors
from nats.aio.msg import Msg
from nats.aio.subscription import DEFAULT_SUB_PENDING_BYTES_LIMIT, DEFAULT_SUB_PENDING_MSGS_LIMIT

from infera_common.logs import get_logger

if TYPE_CHECKING:
    from infera_common.local_bus import LocalClient

log = get_logger("bus")

#: Callbacks run back to back before the delivery task yields to the event loop.
BATCH = 64
#: Seconds between two slow-consumer warnings of one subscription.
SLOW_LOG_INTERVAL = 1.0

Callback = Callable[[Msg], Awaitable[None]]


class LocalSubscription:
    """Interest in a subject; with a callback, a task delivers its messages one at a time, in order."""

    def __init__(self, client: LocalClient, sid: int, subject: str, queue: str, cb: Callback | None, *,
                 max_msgs: int = 0, pending_msgs_limit: int = DEFAULT_SUB_PENDING_MSGS_LIMIT,
                 pending_bytes_limit: int = DEFAULT_SUB_PENDING_BYTES_LIMIT,
                 direct: Callable[[Msg], None] | None = None) -> None:
        self._client = client
        self._sid = sid
        self.subject = subject
        self.queue = queue
        self._cb = cb
        self._direct = direct  # handled at once inside publish (the request() reply mux): no task, no queue
        self._max_msgs = max_msgs
        self._msgs_limit = pending_msgs_limit
        self._bytes_limit = pending_bytes_limit
        self._pending: deque[Msg] = deque()
        self._pending_bytes = 0
        self._received = 0
        self.dropped = 0
        self._unlogged_drops = 0
        self._drop_logged_at = -SLOW_LOG_INTERVAL
        self._waiter: asyncio.Future | None = None
        self._drained: asyncio.Future | None = None
        self._busy = False
        self._stop_when_empty = False
        self._closed = False
        self._task: asyncio.Task | None = None

    @property
    def pending_msgs(self) -> int:
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    @property
    def delivered(self) -> int:
        return self._received

    def _start(self) -> None:
        if self._cb is not None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"bus-sub-{self._client.name}-{self.subject}")

    # --- delivery (called by publish, never waits) ------------------------------------------
    def _deliver(self, subject: str, reply: str, data: bytes, headers: dict | None) -> None:
        if self._closed or self._stop_when_empty:
            return
        msg = Msg(_client=self._client, subject=subject, reply=reply, data=data,  # type: ignore[arg-type]
                  headers=dict(headers) if headers else None, _sid=self._sid)
        self._received += 1
        if self._max_msgs and self._received >= self._max_msgs:  # unsubscribe(limit) reached: no more interest
            self._client._bus._remove(self)
            self._stop_when_empty = True
        if self._direct is not None:
            self._direct(msg)
            return
        size = len(data)
        if (0 < self._msgs_limit <= len(self._pending)) or (
                self._bytes_limit > 0 and self._pending_bytes + size >= self._bytes_limit):
            self._slow_consumer()
            return
        self._pending.append(msg)
        self._pending_bytes += size
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _slow_consumer(self) -> None:
        self.dropped += 1
        self._unlogged_drops += 1
        self._client._bus.metrics.dropped.labels(self._client.name, self.subject).inc()
        now = time.monotonic()
        if now - self._drop_logged_at >= SLOW_LOG_INTERVAL:
            log.warning("bus_slow_consumer", client=self._client.name, subject=self.subject, queue=self.queue,
                        dropped=self._unlogged_drops, dropped_total=self.dropped, pending=len(self._pending),
                        pending_bytes=self._pending_bytes, error=str(errors.SlowConsumerError(
                            subject=self.subject, reply="", sid=self._sid, sub=self)))
            self._drop_logged_at = now
            self._unlogged_drops = 0

    async def _run(self) -> None:
        assert self._cb is not None
        cb, pending, loop = self._cb, self._pending, asyncio.get_running_loop()
        task = asyncio.current_task()
        while True:
            done = 0
            while pending and not self._closed:
                msg = pending.popleft()
                self._pending_bytes -= len(msg.data)
                self._busy = True
                try:
                    await cb(msg)
                except asyncio.CancelledError:
                    if task is not None and task.cancelling():  # the subscription is being stopped
                        raise
                    self._callback_failed(msg)  # the callback raised CancelledError of its own
                except Exception:
                    self._callback_failed(msg)
                finally:
                    self._busy = False
                done += 1
                if done % BATCH == 0:  # let other subscriptions and tasks run
                    await asyncio.sleep(0)
            if self._drained is not None and not self._drained.done():
                self._drained.set_result(None)
            if self._stop_when_empty or self._closed:  # drained or unsubscribed from its own callback, or closed
                self._finish()
                return
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _callback_failed(self, msg: Msg) -> None:
        self._client._bus.metrics.callback_errors.labels(self._client.name, self.subject).inc()
        log.exception("bus_callback_failed", client=self._client.name, subject=self.subject,
                      msg_subject=msg.subject)

    # --- nats-py Subscription API ----------------------------------------------------------
    async def next_msg(self, timeout: float | None = 1.0) -> Msg:
        """The next message of a subscription made without a callback (``nats.errors.TimeoutError``)."""
        if self._client.is_closed:
            raise errors.ConnectionClosedError
        if self._cb is not None:
            raise errors.Error("nats: next_msg cannot be used in async subscriptions")
        if not self._pending:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(self._waiter, timeout)
            except asyncio.TimeoutError:
                raise errors.TimeoutError from None
            finally:
                self._waiter = None
            if not self._pending:  # woken by close()
                raise errors.ConnectionClosedError
        msg = self._pending.popleft()
        self._pending_bytes -= len(msg.data)
        return msg

    async def unsubscribe(self, limit: int = 0) -> None:
        """Remove interest now, dropping what is pending; with ``limit``, after ``limit`` messages in all."""
        self._check_usable()
        if limit > 0 and self._received < limit:
            self._max_msgs = limit
            return
        self._closed = True
        self._client._bus._remove(self)
        self._pending.clear()
        self._pending_bytes = 0
        if self._task is not None and self._task is asyncio.current_task():
            self._stop_when_empty = True  # from its own callback: stop once that callback returns
        else:
            self._kill()
        self._client._subs.pop(self._sid, None)

    async def drain(self) -> None:
        """Remove interest, then return once every message already received has been handled."""
        self._check_usable()
        await self._drain()

    def _check_usable(self) -> None:
        if self._client.is_closed:
            raise errors.ConnectionClosedError
        if self._client.is_draining:
            raise errors.ConnectionDrainingError
        if self._closed:
            raise errors.BadSubscriptionError

    async def _drain(self) -> None:
        self._client._bus._remove(self)
        if self._task is None or self._task is asyncio.current_task():
            self._stop_when_empty = True  # no callback, or called from its own callback
            if self._task is None:
                self._finish()
            return
        if self._pending or self._busy:
            if self._drained is None or self._drained.done():
                self._drained = asyncio.get_running_loop().create_future()
            await self._drained
        self._kill()
        self._finish()

    def _finish(self) -> None:
        self._closed = True
        self._client._subs.pop(self._sid, None)

    def _kill(self) -> asyncio.Task | None:
        """Stop delivering (cancel the task); returns the task to wait for, if another is running it."""
        self._closed = True
        for future in (self._waiter, self._drained):  # wake next_msg() and a drain() in progress
            if future is not None and not future.done():
                future.set_result(None)
        task = self._task
        if task is None or task.done() or task is asyncio.current_task():
            return None
        task.cancel()
        return task
