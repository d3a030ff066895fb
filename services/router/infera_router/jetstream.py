"""Publishing to JetStream with the acknowledgement handed to a callback: no task per publish.

A JetStream publish is a core-NATS publish with a reply subject; the broker answers there with a
PubAck (JSON) or an error. Every publish of the router replies to its own wildcard inbox, and the
answer (or the timeout) calls the publish's ``on_result`` directly. ``parse_pub_ack`` is pure.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from infera_common.logs import get_logger
from infera_common.nats_conn import unsubscribe_quietly

log = get_logger("router.jetstream")

#: JetStream's error code for a store refused by a stream limit (description names the limit).
JS_STORE_FAILED = 10077
#: JetStream's error code for a publish to a sealed stream: a worker-agent seals its queue when it
#: leaves (drain or engine exit), so the publish is refused and another worker is tried.
JS_STREAM_SEALED = 10109

ResultKind = Literal["stored", "full", "gone", "error", "timeout"]


@dataclass(frozen=True, slots=True)
class PubResult:
    """What became of one publish: ``stored``; refused because the stream is ``full`` (discard-new);
    ``gone`` (no stream listens on the subject, or the worker sealed it on its way out); another broker
    ``error``; or no answer (``timeout``)."""

    kind: ResultKind
    stream: str = ""
    code: int = 0
    err_code: int = 0
    description: str = ""


def stream_full(err_code: int, description: str) -> bool:
    """True when the broker refused the message because the stream is at a limit (discard-new).

    nats-server 2.15 answers ``{"code": 503, "err_code": 10077, "description": "maximum messages
    exceeded"}``.
    """
    return err_code == JS_STORE_FAILED and "maximum" in description


def parse_pub_ack(data: bytes, status: str | None) -> PubResult:
    """The broker's answer to a publish; ``status`` is the NATS ``Status`` header, if any."""
    if not data and status == "503":
        return PubResult("gone", description="no responders")
    try:
        resp = json.loads(data)
    except ValueError:
        return PubResult("error", description=f"unreadable acknowledgement: {data[:200]!r}")
    if not isinstance(resp, dict):
        return PubResult("error", description=f"unexpected acknowledgement: {data[:200]!r}")
    err = resp.get("error")
    if isinstance(err, dict):
        code, err_code = int(err.get("code") or 0), int(err.get("err_code") or 0)
        description = str(err.get("description") or "")
        kind: ResultKind = "error"
        if stream_full(err_code, description):
            kind = "full"
        elif err_code == JS_STREAM_SEALED:
            kind = "gone"
        return PubResult(kind, code=code, err_code=err_code, description=description)
    if "stream" in resp and "seq" in resp:
        return PubResult("stored", stream=str(resp["stream"]))
    return PubResult("error", description=f"unexpected acknowledgement: {data[:200]!r}")


OnResult = Callable[[PubResult], Awaitable[None]]


class AckedPublisher:
    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._prefix = nc.new_inbox() + "."
        self._ids = itertools.count(1)
        self._pending: dict[str, tuple[OnResult, asyncio.TimerHandle]] = {}
        self._sub = None
        self._busy = 0  # results being handled (a handler may publish again)
        self._idle = asyncio.Event()
        self._idle.set()
        self._late: set[asyncio.Task] = set()  # timeouts being handled (kept referenced)

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self._prefix + "*", cb=self._on_ack)

    async def publish(self, subject: str, data: bytes, timeout: float, on_result: OnResult) -> None:
        """Publish ``data``; ``on_result`` is awaited with the outcome, exactly once. Raises (and then
        never calls ``on_result``) when the client refuses the publish, e.g. the connection is closed."""
        reply = f"{self._prefix}{next(self._ids)}"
        handle = asyncio.get_running_loop().call_later(timeout, self._expire, reply)
        self._pending[reply] = (on_result, handle)
        self._idle.clear()
        try:
            await self._nc.publish(subject, data, reply=reply)
        except BaseException:
            self._forget(reply)
            handle.cancel()
            raise

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until every publish has had its result; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        if self._sub is not None:
            await unsubscribe_quietly(self._sub)
            self._sub = None

    def _forget(self, reply: str) -> tuple[OnResult, asyncio.TimerHandle] | None:
        entry = self._pending.pop(reply, None)
        self._settle()
        return entry

    def _settle(self) -> None:
        if not self._pending and not self._busy:
            self._idle.set()

    async def _deliver(self, on_result: OnResult, result: PubResult) -> None:
        self._busy += 1
        try:
            await on_result(result)
        finally:
            self._busy -= 1
            self._settle()

    async def _on_ack(self, msg: Msg) -> None:
        entry = self._pending.pop(msg.subject, None)
        if entry is None:
            return  # answered after its timeout: the requester already has its answer
        on_result, handle = entry
        handle.cancel()
        status = msg.headers.get("Status") if msg.headers else None
        await self._deliver(on_result, parse_pub_ack(msg.data, status))

    def _expire(self, reply: str) -> None:
        entry = self._pending.pop(reply, None)
        if entry is not None:
            self._busy += 1  # until the task below has started
            task = asyncio.get_running_loop().create_task(self._expired(entry[0]))
            self._late.add(task)
            task.add_done_callback(self._late.discard)

    async def _expired(self, on_result: OnResult) -> None:
        self._busy -= 1
        await self._deliver(on_result, PubResult("timeout"))
