"""One request: WorkEnvelope -> engine HTTP API -> Frames on the requester's inbox, and the engine's abort.

Shared by the worker-agent (NATS request plane) and the router's HTTP dispatcher (``--request-transport
http``): the same frames reach the requester whichever of them called the engine.

Frames: a non-streaming answer is one ``head`` with ``final=True`` (engine status and the whole
body; no ``end`` follows); a stream is ``head`` then one ``data`` per SSE event payload, ``[DONE]``
becoming ``end``.
Relay-side failures (engine unreachable, connection lost mid-stream) give an ``error`` frame 502;
a deadline passing mid-request gives ``error`` 504. The outcome is returned for the Release.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable
from itertools import islice
from typing import Literal

import aiohttp

from infera_common.logs import get_logger
from infera_common.frames import encode_frame
from infera_common.schemas import EngineKind, FrameKind, WorkEnvelope
from infera_common.sse import SseDecoder, is_done
from infera_common.tracing import HEADER as TRACE_HEADER
from infera_common.tracing import SpanKind, engine_headers, finish, start_span, traceparent

log = get_logger("engine_relay")

Outcome = Literal["ok", "error", "cancelled", "expired"]
Abort = Callable[[str], Awaitable[None]]

#: Engines that abort a request by id on POST /abort_request {"rid": ...}; vLLM aborts on disconnect.
ABORT_PATHS: dict[EngineKind, str | None] = {"mock": "/abort_request", "sglang": "/abort_request", "vllm": None}
Publish = Callable[[str, bytes], Awaitable[None]]

SSE_CONTENT_TYPE = "text/event-stream"


def bearer_header(api_key: str | None) -> dict[str, str]:
    """The header an engine started with ``--api-key`` asks every request for (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


#: What an engine's 401 means behind Infera: the key its --api-key asks for is not the one sent.
ENGINE_KEY_REFUSED = ("the engine refused the request with 401 Unauthorized: it was started with --api-key (or "
                      "VLLM_API_KEY) and was not sent that key. The worker-agent sends the key given in the engine's "
                      "arguments; a router that calls the engines itself (--request-transport http) needs it as "
                      "--engine-api-key")


def outcome_for_status(status: int) -> Outcome:
    """An engine answer is a worker failure only when the engine says so (5xx); 4xx are the client's."""
    return "error" if status >= 500 else "ok"


class FrameSink:
    """Numbered frames to one reply subject; the last ``keep`` of them kept, to be sent again
    (``kept_from``, ``resend``) to a requester that lost some to a broker outage."""

    def __init__(self, publish: Publish, subject: str,
                 on_first_data: Callable[[], Awaitable[None]] | None = None, keep: int = 0) -> None:
        self._publish = publish
        self._subject = subject
        self._on_first_data = on_first_data  # called once, after the first streamed data frame
        self.seq = 0
        self.closed = False  # an end, error or final head frame was sent
        self.data_sent = False  # a data frame was sent: the client may have bytes of the answer
        self.last_sent = time.monotonic()  # when a frame (alive ones included) last went out
        self.unreached = False  # it ended with an error saying the engine was never reached
        self._kept: deque[bytes] | None = deque(maxlen=keep) if keep else None

    def kept_from(self, seq: int) -> list[bytes] | None:
        """The frames sent from number ``seq`` on, or None when some of them are no longer kept."""
        kept = self._kept
        if kept is None or seq > self.seq:
            return None
        first = self.seq - len(kept)
        return None if seq < first else list(islice(kept, seq - first, None))

    def forget_frames(self) -> None:
        self._kept = None

    async def resend(self, frames: list[bytes]) -> None:
        for data in frames:
            await self._publish(self._subject, data)

    async def send(
        self, kind: FrameKind, *, status: int = 200, body: bytes = b"", message: str = "", final: bool = False,
        failed_worker: str = "", unreached: bool = False,
    ) -> None:
        data = encode_frame(kind, self.seq, status, body, message, final, failed_worker, unreached)
        self.seq += 1
        if self._kept is not None:
            self._kept.append(data)
        if final or kind == "end" or kind == "error":
            self.closed = True
        elif kind == "data":
            self.data_sent = True
        self.last_sent = time.monotonic()
        await self._publish(self._subject, data)
        if kind == "data" and self._on_first_data is not None:
            first, self._on_first_data = self._on_first_data, None
            await first()

    async def error(self, status: int, message: str, failed_worker: str = "", unreached: bool = False) -> None:
        """End the answer with an error; ``unreached``: the engine never got the request (nothing ran)."""
        self.unreached = unreached
        await self.send("error", status=status, message=message, failed_worker=failed_worker, unreached=unreached)

    @property
    def answer_begun(self) -> bool:
        """Whether the requester has part of the answer (a data frame) or all of it."""
        return self.data_sent or self.closed

    async def alive(self) -> None:
        """Tell the requester the engine still holds the request: an ``alive`` frame, numbered as the
        next frame will be (it takes no number and is not kept: a lost one is not sent again)."""
        self.last_sent = time.monotonic()
        await self._publish(self._subject, encode_frame("alive", self.seq))


def model_renamer(answer_model: tuple[str, str] | None) -> Callable[[bytes], bytes] | None:
    """For ``WorkEnvelope.answer_model`` (engine name, served name): a function giving an answer's
    JSON (a whole body or one SSE payload) the served name as its ``model`` (None: nothing to do).
    Engines write ``"model":<name>`` compact (pydantic, orjson, Starlette); the spaced form is taken too."""
    if answer_model is None:
        return None
    engine, served = (json.dumps(name, ensure_ascii=False).encode() for name in answer_model)
    pairs = [(key + engine, key + served) for key in (b'"model":', b'"model": ')]

    def rename(answer: bytes) -> bytes:
        for old, new in pairs:
            answer = answer.replace(old, new, 1)
        return answer

    return rename


class Relay:
    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self._session = session
        self._base = base_url.rstrip("/")

    async def run(self, env: WorkEnvelope, sink: FrameSink) -> Outcome:
        """Forward ``env`` to the engine and stream its answer to ``sink``; cancellable. The call is
        one span (``tracing``) under the envelope's ``traceparent``, whose context the engine gets."""
        span = start_span(f"engine POST {env.endpoint.value}", env.headers.get(TRACE_HEADER), SpanKind.CLIENT,
                          {"infera.request_id": env.request_id, "server.address": self._base})
        outcome: Outcome = "cancelled"
        try:
            outcome = await self._run(env, sink, traceparent(span))
            return outcome
        finally:
            span.set_attribute("infera.outcome", outcome)
            finish(span, error=None if outcome == "ok" else outcome)

    async def _run(self, env: WorkEnvelope, sink: FrameSink, trace_context: str | None) -> Outcome:
        deadline = asyncio.timeout(max(env.deadline - time.time(), 0.0))
        try:
            async with deadline:
                return await self._forward(env, sink, trace_context)
        except TimeoutError as exc:
            if deadline.expired():
                await sink.error(504, "deadline passed while the engine was answering")
                return "expired"
            await sink.error(502, f"engine timed out: {exc or type(exc).__name__}")
            return "error"
        except aiohttp.ClientConnectorError as exc:  # no connection: the request never left this process
            await sink.error(502, f"the engine could not be reached (the engine may have stopped): "
                                  f"{type(exc).__name__}", unreached=True)
            return "error"
        except (aiohttp.ClientError, OSError) as exc:
            # aiohttp's own text names transfer details ("TransferEncodingError: 400, ...") that read
            # as the client's fault: say what happened, and keep its class for the logs' sake
            what = "the engine's connection broke mid-answer" if sink.seq else "the engine's connection broke"
            await sink.error(502, f"{what} (the engine may have stopped): {type(exc).__name__}")
            return "error"

    async def _forward(self, env: WorkEnvelope, sink: FrameSink, trace_context: str | None) -> Outcome:
        headers = {**env.headers, "Content-Type": "application/json", "X-Request-Id": env.request_id,
                   **engine_headers(trace_context)}
        async with self._session.post(self._base + env.endpoint.value, data=env.body, headers=headers) as resp:
            if resp.status == 401:  # the client's key is the frontend's business: this is the fleet's setup
                await sink.error(502, ENGINE_KEY_REFUSED, unreached=True)
                return "error"
            streaming = (
                env.stream and resp.status < 400 and resp.content_type == SSE_CONTENT_TYPE
            )
            rename = model_renamer(env.answer_model)
            if not streaming:
                body = await resp.read()
                await sink.send("head", status=resp.status, body=rename(body) if rename else body, final=True)
                return outcome_for_status(resp.status)
            await sink.send("head", status=resp.status)
            decoder = SseDecoder()
            async for chunk in resp.content.iter_any():
                for payload in decoder.feed(chunk):
                    if is_done(payload):
                        await sink.send("end")
                        return outcome_for_status(resp.status)
                    await sink.send("data", body=rename(payload) if rename else payload)
            for payload in decoder.close():
                if not is_done(payload):
                    await sink.send("data", body=rename(payload) if rename else payload)
            await sink.send("end")  # the engine closed the stream cleanly without [DONE]
            return outcome_for_status(resp.status)


class EngineAborter:
    """POST the engine's abort endpoint for a request id (SGLang and the mock; vLLM aborts on disconnect)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, path: str | None) -> None:
        self._session = session
        self._url = f"{base_url.rstrip('/')}{path}" if path else None

    async def __call__(self, request_id: str) -> None:
        if self._url is None:
            return
        try:
            async with self._session.post(
                self._url, json={"rid": request_id}, timeout=aiohttp.ClientTimeout(total=5)
            ) as resp:
                if resp.status >= 400:
                    log.info("engine_abort_refused", request_id=request_id, status=resp.status)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.info("engine_abort_failed", request_id=request_id, error=str(exc) or type(exc).__name__)
