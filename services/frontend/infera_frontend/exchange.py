"""One placed request attempt: the worker's frames, in order, turned into a status, a body or SSE payloads.

``start()`` waits for the engine's status and, unless streaming, the whole body; for a stream it
also waits for the first payloads, so that nothing reaches the client before the first token (a
failure until then may still be retried on another worker: ``failover.py``). ``read()`` returns
the next payloads of a stream. Timeouts and error frames surface as ``ApiError`` (``RetryableError``
when another worker may do better); ``cancel()`` publishes ``Cancel`` to the worker.

Frames are numbered by their sender from 0, and core NATS delivers one sender's messages in order
but at most once: when a nats-server restarts, frames in flight, and those a worker-agent flushes
before this frontend has subscribed again, are gone. A frame whose number is past the next one
reveals such a gap: later frames are held back, and the worker is asked to send the missing ones
again (``FramesReplay``; it keeps each request's last 1,024 frames, and a finished request's for
30 s); copies of frames already read are dropped. When the worker cannot (or does not answer),
the request is cancelled on it and ends with an error (502, retried on another worker while the
client has nothing of it), never as a shorter answer that looks complete. An ``error`` frame is
taken whatever its number: a router that tells the requester its worker left numbers it 0. A
loss that no later frame reveals (the last frames of an answer, or an envelope lost from a
restarted broker's queue) is found by ``Relay.resync`` after a reconnect: the worker says how many
frames it sent (``has_all``); ``fill_gap`` asks for the missing ones, ``lose`` ends the request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from infera_common.logs import get_logger
from infera_common.openai_errors import normalize_error
from infera_common.frames import FrameWire, decode_frame
from infera_common.schemas import Endpoint

from infera_frontend.failover import (
    CLIENT_TOO_SLOW, FRAMES_LOST, UPSTREAM_TIMEOUT, RetryableError, worker_error_reason,
)
from infera_frontend.inbox import Mailbox
from infera_frontend.validation import ApiError

if TYPE_CHECKING:
    from infera_frontend.relay import Relay

log = get_logger("frontend.relay")

DONE_PAYLOAD = b"[DONE]"
#: Put in a mailbox by ``Exchange.lose``: the reader raises the loss instead of waiting on.
LOST = object()
#: Most SSE payloads one ``read`` returns: a backlog is written to the client in slices, the event
#: loop running between them (a client that caught up on 200,000 unread frames stalled it for ~7 s).
READ_BATCH = 256


def frame_error(frame: FrameWire) -> ApiError:
    """The client's error for a worker-agent ``error`` frame (retryable for 502/503/504)."""
    status = frame.status if 400 <= frame.status < 600 else 502
    message = frame.message or f"upstream error (status {frame.status})"
    reason = worker_error_reason(status, frame.unreached)
    if reason is not None:
        return RetryableError(status, message, reason=reason, failed_worker=frame.failed_worker)
    return ApiError(status, message)


class Exchange:
    """One placed request: its frames, in order, until ``end``, ``error`` or a final ``head``."""

    __slots__ = ("_relay", "request_id", "worker_id", "_subject", "_box", "stream", "endpoint", "done",
                 "_closed", "_cancelled", "_error", "_expected_tokens", "status", "body", "_first", "_seq", "_alive",
                 "_lost", "_lost_reason", "_ahead", "_replay_from", "lease", "frames_router", "sender_known",
                 "on_too_slow")

    def __init__(
        self, relay: Relay, request_id: str, worker_id: str, subject: str, box: Mailbox, stream: bool,
        endpoint: Endpoint, expected_tokens: int | None = None, lease: tuple[str, str] | None = None,
        frames_router: str | None = None, sender_known: bool = True,
    ) -> None:
        self._relay = relay
        self.lease = lease  # (lease id, router id) of the placement, when the router said
        # the router that sends the frames, calling the engine itself (--request-transport http);
        # None: the worker-agent does. Questions about lost frames go to whoever sends them.
        self.frames_router = frames_router
        # False: the router predates ``RouteReply.frames_from``, so who sends the frames is a guess
        # (the worker's agent) and a silent sender is not taken for a dead one (sender_watch.py)
        self.sender_known = sender_known
        self._expected_tokens = expected_tokens  # the frontend's prompt count; None once checked or unknown
        self.request_id = request_id
        self.worker_id = worker_id
        self._subject = subject
        self._box = box
        self.stream = stream
        self.endpoint = endpoint
        self.done = False
        self._closed = False
        self._cancelled = False
        self._error: ApiError | None = None  # an error frame met after payloads not yet returned
        self.status = 0  # the engine's status, once started
        self.body: bytes | None = None  # the whole answer once started, None for a stream
        self._first: list[bytes] = []  # a stream's first payloads, read by start()
        self._seq = 0  # the number the next frame must carry
        self._alive = 0  # alive frames read (the sender is on the bus: sender_watch)
        self._lost = ""  # why frames are lost for good, once known
        self._lost_reason = FRAMES_LOST  # the retry reason that goes with it
        self._ahead: dict[int, FrameWire] = {}  # frames that came after a gap, by number
        self._replay_from = -1  # the number from which the worker was last asked to send frames again
        box.on_overflow = self._too_slow
        self.on_too_slow: Callable[[], None] | None = None  # the transport's: its client stopped reading

    def close(self) -> None:
        """Stop receiving frames (always call, e.g. in ``finally``)."""
        if not self._closed:
            self._closed = True
            self._relay.inbox.release(self._subject)
            self._relay.forget(self)

    @property
    def ended(self) -> bool:
        return self.done or self._closed

    def has_all(self, sent: int | None) -> bool:
        """Whether every frame the worker says it sent (``None``: it does not know the request) has
        arrived here; an exchange already ended has all it needs."""
        if self.ended:
            return True
        return sent is not None and self.progress >= sent

    @property
    def sender(self) -> tuple[str | None, str]:
        """Who sends the frames: (the router that runs the request itself, or None, and its worker)."""
        return self.frames_router, self.worker_id

    @property
    def progress(self) -> int:
        """How many frames have arrived so far (read, held back after a gap, or waiting to be read)."""
        return self._seq + len(self._ahead) + len(self._box)

    @property
    def heard(self) -> int:
        """``progress`` and the ``alive`` frames read: whether its sender was heard from lately."""
        return self.progress + self._alive

    def lose(self, why: str, reason: str = FRAMES_LOST) -> None:
        """Frames of this request will never arrive: the reader ends it with ``why`` (retried, while
        its client has nothing, under ``reason``)."""
        if not self.ended and not self._lost:
            self._lost = why
            self._lost_reason = reason
            self._box.force(LOST)

    def failed_midway(self, err: ApiError) -> None:
        """The answer ended in ``err`` after its head went out (the client got an error event, not an
        error status): say so, with the request and its worker."""
        log.warning("stream_failed", request_id=self.request_id, worker_id=self.worker_id, status=err.status,
                    error=err.message)

    def _too_slow(self) -> None:
        """The mailbox is full: the client reads this stream more slowly than the engine writes it.
        The engine's request is cancelled at once (the client may never read again); the client gets
        what waited, then the error."""
        unread = len(self._box)
        self._relay.metrics.clients_too_slow.inc()
        log.warning("client_too_slow", request_id=self.request_id, worker_id=self.worker_id, unread_frames=unread)
        self.cancel(CLIENT_TOO_SLOW)
        if self.on_too_slow is not None:
            self.on_too_slow()
        self.lose(f"the client read this answer more slowly than the engine wrote it: {unread} response frames "
                  "waited unread (--max-unread-frames)", reason=CLIENT_TOO_SLOW)

    def fill_gap(self, again: bool = False) -> None:
        """Frames from the next number on are missing: ask the worker to send them again (once per
        gap, unless ``again``: after a reconnect, the copies may have been lost too)."""
        if (again or self._replay_from != self._seq) and not self.ended:
            self._replay_from = self._seq
            self._relay.spawn(self._replay(self._seq))

    async def _replay(self, from_seq: int) -> None:
        count = await self._relay.ask_replay(self, from_seq)
        if count is not None and count >= 0:
            self._relay.metrics.frames_replayed.inc()  # they were sent before the answer
            log.info("response_frames_sent_again", request_id=self.request_id, worker_id=self.worker_id,
                     from_seq=from_seq, count=count)
            return
        self.lose(f"response frames from worker {self.worker_id} from number {from_seq} on were lost in transit "
                  "(was the message broker restarted?) and " +
                  ("the worker no longer has them" if count is not None else "the worker did not send them again"))

    def cancel(self, reason: str) -> None:
        """Tell the worker to abort this request (at most once; nothing once the response ended)."""
        if not self._cancelled and not self.done:
            self._cancelled = True
            self._relay.publish_cancel(self.worker_id, self.request_id, reason, self.lease[0] if self.lease else "")

    async def _next(self) -> FrameWire:
        """The next frame in number order (``error`` frames at once; ``alive`` frames only restart the
        wait, and show a gap when the worker sent more frames than arrived)."""
        while True:
            frame = self._ahead.pop(self._seq, None) if self._ahead else None
            if frame is None:
                frame = await self._receive()
                if frame.kind == "alive":  # (one sender's frames arrive in order: fewer than it sent are lost)
                    self._alive += 1
                    if frame.seq > self._seq:
                        self.fill_gap()
                    continue
                if frame.seq != self._seq and frame.kind != "error":
                    if frame.seq > self._seq:  # a gap: hold it back until the missing frames come again
                        self._ahead[frame.seq] = frame
                        self.fill_gap()
                    continue  # (a frame before the next number: a copy of one already read)
            self._seq = frame.seq + 1
            return frame

    async def _receive(self) -> FrameWire:
        box = self._box
        if box.empty():
            try:
                msg = await box.get(self._relay.upstream_timeout)
            except TimeoutError:
                self._relay.metrics.upstream_timeouts.labels(self.endpoint.value).inc()
                self.cancel("upstream_timeout")
                raise RetryableError(
                    504, f"the engine sent nothing for {self._relay.upstream_timeout:g}s; request cancelled",
                    type="timeout_error", reason=UPSTREAM_TIMEOUT,
                ) from None
        else:
            msg = box.get_nowait()
        if msg is LOST:
            raise self._frames_lost(self._lost)
        try:
            frame = decode_frame(msg.data)
        except ValueError as exc:
            self._relay.metrics.bad_frames.inc()
            self.cancel("bad_frame")
            log.error("bad_frame", request_id=self.request_id, worker_id=self.worker_id, error=str(exc))
            raise ApiError(502, "the worker sent an unreadable response frame") from None
        return frame

    def _frames_lost(self, why: str) -> ApiError:
        reason = self._lost_reason
        if reason == FRAMES_LOST:
            self._relay.metrics.frames_lost.inc()
        self.cancel(reason)
        self.done = True
        if reason == CLIENT_TOO_SLOW:  # (logged when it happened; the client's doing: not retried)
            return ApiError(408, f"{why}; the request was cancelled", type="timeout_error", code=CLIENT_TOO_SLOW)
        log.warning("response_frames_lost", request_id=self.request_id, worker_id=self.worker_id,
                    frames_received=self._seq, why=why, reason=reason)
        return RetryableError(502, f"{why}; the request was cancelled rather than answered incompletely",
                              reason=reason)

    def _check(self, payload: bytes) -> None:
        expected = self._expected_tokens
        if expected is not None and self._relay.check_usage(self.worker_id, self.request_id, expected, payload):
            self._expected_tokens = None  # one check per request

    async def start(self) -> tuple[int, bytes | None]:
        """The engine's status and whole body (``None`` for a stream, whose first payloads are then read).

        Nothing has reached the client when this returns or raises: a stream's status line waits for
        its first token, so a failure before it may still be retried elsewhere.
        """
        self.status, self.body = await self.head()
        if self.body is None:
            self._first = await self.read()
        return self.status, self.body

    async def head(self) -> tuple[int, bytes | None]:
        """The engine's status and, unless a stream follows, the whole body (``None`` for a stream).

        Error statuses (>= 400) come with the body in the OpenAI error shape.
        """
        frame = await self._next()
        if frame.kind == "error":
            self.done = True
            raise frame_error(frame)
        if frame.kind != "head":
            self._relay.metrics.bad_frames.inc()
            self.cancel("bad_frame")
            raise ApiError(502, f"the worker sent a '{frame.kind}' frame before the response head")
        status = frame.status
        if frame.final:  # the whole answer (possibly an empty body): nothing follows
            body = frame.body
        elif self.stream and status < 400 and not frame.body:
            return status, None  # a stream follows (a head with a body: the engine answered without SSE)
        else:
            body = frame.body or await self._collect()
        self.done = True
        if status >= 400:
            body = normalize_error(status, body)
        elif body:
            self._check(body)
        return status, body

    async def _collect(self) -> bytes:
        """A body sent as data frames after an empty head."""
        parts: list[bytes] = []
        while True:
            frame = await self._next()
            if frame.kind == "data":
                if frame.body != DONE_PAYLOAD:
                    parts.append(frame.body)
            elif frame.kind == "end":
                return b"".join(parts)
            elif frame.kind == "error":
                self.done = True
                raise frame_error(frame)

    async def read(self) -> list[bytes]:
        """The next SSE payloads of a stream (at least one, or none once ``done``).

        Raises ``ApiError`` for an error frame or a timeout mid-stream.
        """
        if self._first:
            out, self._first = self._first, []
            return out
        if self._error is not None:
            err, self._error = self._error, None
            self.done = True
            raise err
        out: list[bytes] = []
        box = self._box
        while not self.done:
            try:
                frame = await self._next()
            except ApiError as err:
                if not out:
                    raise
                self._error = err  # raised by the next call, after the payloads that came before it
                break
            kind = frame.kind
            if kind == "data":
                if frame.body != DONE_PAYLOAD:
                    out.append(frame.body)
                    if self._expected_tokens is not None:
                        self._check(frame.body)
            elif kind == "end":
                self.done = True
            elif kind == "error":
                if not out:
                    self.done = True
                    raise frame_error(frame)
                self._error = frame_error(frame)  # raised by the next call, after these payloads
                break
            else:
                self._relay.metrics.bad_frames.inc()
            if out and (box.empty() or len(out) >= READ_BATCH):
                break
        return out
