"""The OpenAI API for NATS request/reply clients (the wire contract is in ``infera_common.nats_api``).

Subjects ``infera.api.v1.chat.completions``, ``infera.api.v1.completions``, ``infera.api.v1.models``
and ``infera.api.v1.workers``, queue group ``infera-frontend``. A completion request's data is the
OpenAI JSON body. Not streaming: one reply, the JSON body with header ``Infera-Status``. Streaming
(``"stream": true``): one message per SSE event payload (``Infera-Kind: data``), then an empty
``Infera-Kind: end``; any failure is a final ``Infera-Kind: error`` message with ``Infera-Status``
and an OpenAI error body. The request runs through the same pipeline as HTTP requests (retries
included); the NATS header ``X-Dynamo-Session-ID`` plays the HTTP header's part. With the header
``Infera-Alive-Every: <seconds>`` a client also gets an empty ``Infera-Kind: alive`` message that often
until the last message, and a client found gone by one (NATS: no responders) has its request
cancelled (``Reply``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from infera_common.fleet import FleetView
from infera_common.logs import get_logger
from infera_common.nats_api import (
    ALIVE_EVERY_MAX,
    ALIVE_EVERY_MIN,
    HEADER_ALIVE_EVERY,
    HEADER_KIND,
    HEADER_REQUEST_ID,
    HEADER_STATUS,
    KIND_ALIVE,
    KIND_DATA,
    KIND_END,
    KIND_ERROR,
)
from infera_common.nats_conn import flush_all, unsubscribe_quietly
from infera_common.openai_errors import error_body
from infera_common.schemas import Endpoint
from infera_common.tracing import HEADER as TRACE_HEADER
from infera_common.subject_match import subject_error
from infera_common.subjects import (
    API_PREFIX,
    API_CHAT_COMPLETIONS,
    API_COMPLETIONS,
    API_MODELS,
    API_WORKERS,
    FRONTEND_QUEUE,
)

from infera_frontend.listing import models_list, workers_list
from infera_frontend.metrics import FrontendMetrics
from infera_frontend.pipeline import Pipeline
from infera_frontend.served import serving
from infera_frontend.session import nats_session_ids
from infera_frontend.validation import ApiError

log = get_logger("frontend.nats_api")

_DATA = {HEADER_KIND: KIND_DATA}
_ALIVE = {HEADER_KIND: KIND_ALIVE}
#: Seconds an ``alive`` message waits for the client's (optional) answer before the next one is due.
ALIVE_ANSWER_WAIT = 1.0


def reply_refusal(reply: str) -> str | None:
    """Why the frontend will not answer on ``reply`` (a metrics reason), or None: a subject no client
    can subscribe to as published (a wildcard, an empty token), or an API subject, where each answer
    (and each ``alive`` message) would arrive as a new request."""
    if subject_error(reply, pattern=False) is not None:
        return "invalid"
    if reply.startswith(API_PREFIX):
        return "api_subject"
    return None


def header(headers: dict[str, str], name: str) -> str | None:
    """A request header's value, its name compared without case (as HTTP's; NATS keeps the case sent)."""
    found = headers.get(name)
    if found is not None:
        return found
    lower = name.lower()
    return next((value for key, value in headers.items() if key.lower() == lower), None)


def alive_every(headers: dict[str, str]) -> float | None:
    """The seconds of the request's ``Infera-Alive-Every`` header (its name compared without case);
    None when absent; ApiError (400) when it is not a number of seconds in range."""
    text = header(headers, HEADER_ALIVE_EVERY)
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not ALIVE_EVERY_MIN <= seconds <= ALIVE_EVERY_MAX:  # NaN fails it too
        raise ApiError(400, f"header {HEADER_ALIVE_EVERY} must be a number of seconds from {ALIVE_EVERY_MIN:g} "
                       f"to {ALIVE_EVERY_MAX:g}, got {text[:40]!r}", param=HEADER_ALIVE_EVERY)
    return seconds


class Reply:
    """The messages to one request's reply subject, in order. With ``keep_alive(every, on_gone)``, an
    ``alive`` message every ``every`` seconds until ``close`` (called before the last message), sent
    as a NATS request: when nobody is subscribed to the reply subject any more, NATS answers "no
    responders", the client has left, and ``on_gone`` is called (once; the probes stop)."""

    def __init__(self, nc: NATS, subject: str) -> None:
        self._nc = nc
        self.subject = subject
        self.gone = False
        self._alive: asyncio.Task | None = None

    def keep_alive(self, every: float, on_gone: Callable[[], None]) -> None:
        self._alive = asyncio.get_running_loop().create_task(self._say_alive(every, on_gone))

    async def send(self, data: bytes, headers: dict[str, str]) -> None:
        await self._nc.publish(self.subject, data, headers=headers)

    async def last(self, data: bytes, headers: dict[str, str]) -> None:
        """The final message: no ``alive`` message follows it."""
        self.close()
        await self.send(data, headers)

    def close(self) -> None:
        if self._alive is not None:
            self._alive.cancel()
            self._alive = None

    async def _say_alive(self, every: float, on_gone: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + every
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            due += every  # the wait for an answer below is part of the period, never more than it
            try:  # a client may answer (infera.client does); one that does not is waited for a moment
                await self._nc.request(self.subject, b"", timeout=min(every, ALIVE_ANSWER_WAIT), headers=_ALIVE)
            except NoRespondersError:
                self.gone = True
                on_gone()
                return
            except NatsTimeoutError:
                pass
            except Exception as exc:  # the connection is closing: the answer's own publish fails too
                log.warning("nats_api_alive_failed", subject=self.subject, error=str(exc) or type(exc).__name__)
                return


class NatsApi:
    def __init__(self, nc: NATS, pipeline: Pipeline, view: FleetView, metrics: FrontendMetrics) -> None:
        self._nc = nc
        self.pipeline = pipeline
        self.view = view
        self.metrics = metrics
        self._subs: list[Any] = []
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        routes: list[tuple[str, Callable[[Msg], Any]]] = [
            (API_CHAT_COMPLETIONS, self._spawner(Endpoint.CHAT)),
            (API_COMPLETIONS, self._spawner(Endpoint.COMPLETIONS)),
            (API_MODELS, self._listing(models_list)),
            (API_WORKERS, self._listing(workers_list)),
        ]
        for subject, cb in routes:
            self._subs.append(await self._nc.subscribe(subject, queue=FRONTEND_QUEUE, cb=cb))
        await flush_all(self._nc)  # the broker knows the subscriptions before we say we serve

    async def stop(self, drain_timeout: float = 0.0) -> None:
        """Stop taking requests, give the ones in flight ``drain_timeout`` seconds to finish, then
        end the rest (their workers get a Cancel)."""
        for sub in self._subs:
            await unsubscribe_quietly(sub)
        self._subs.clear()
        if self._tasks and drain_timeout > 0:
            await asyncio.wait(set(self._tasks), timeout=drain_timeout)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawner(self, endpoint: Endpoint):
        async def cb(msg: Msg) -> None:  # subscription callbacks run one at a time: serve in a task
            task = asyncio.get_running_loop().create_task(self._serve(msg, endpoint))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return cb

    def _listing(self, build: Callable[[FleetView], dict[str, Any]]):
        async def cb(msg: Msg) -> None:
            if self._answerable(msg):
                try:
                    await self._nc.publish(msg.reply, json.dumps(build(self.view)).encode(),
                                           headers={HEADER_STATUS: "200"})
                except Exception as exc:
                    log.warning("nats_api_reply_failed", subject=msg.subject, error=str(exc))
        return cb

    @staticmethod
    async def _error(reply: Reply, err: ApiError, request_id: str) -> None:
        body = error_body(err.status, err.message, type=err.type, param=err.param, code=err.code)
        await reply.last(json.dumps(body).encode(), {
            HEADER_KIND: KIND_ERROR, HEADER_STATUS: str(err.status), HEADER_REQUEST_ID: request_id,
        })

    def _answerable(self, msg: Msg) -> bool:
        """Whether ``msg`` has a reply subject to answer on (none: a publish, dropped quietly)."""
        if not msg.reply:
            return False
        why = reply_refusal(msg.reply)
        if why is not None:
            self.metrics.nats_api_refused.labels(why).inc()
            return False
        return True

    async def _serve(self, msg: Msg, endpoint: Endpoint) -> None:
        if not self._answerable(msg):
            return
        reply = Reply(self._nc, msg.reply)
        headers = msg.headers or {}
        with serving(self.pipeline, "nats", endpoint, header(headers, TRACE_HEADER)) as s:
            try:
                s.take_ids(header(headers, HEADER_REQUEST_ID))
                every = alive_every(headers)
                s.parse(msg.data)
                if every is not None:
                    serving_task = asyncio.current_task()
                    assert serving_task is not None
                    reply.keep_alive(every, lambda: serving_task.cancel("the client left"))
                ex = await s.open(msg.data, session_ids=nats_session_ids(headers),
                                  cancel_reason=lambda: "client_disconnect" if reply.gone else "shutdown")
                if ex.body is not None:
                    hdrs = {HEADER_STATUS: str(ex.status), HEADER_REQUEST_ID: s.request_id}
                    if ex.status >= 400:
                        hdrs[HEADER_KIND] = KIND_ERROR
                    await reply.last(ex.body, hdrs)
                    return
                try:
                    while payloads := await ex.read():
                        for p in payloads:
                            await reply.send(p, _DATA)
                except ApiError as err:
                    s.status = err.status
                    ex.failed_midway(err)
                    await self._error(reply, err, s.request_id)
                    return
                await reply.last(b"", {HEADER_KIND: KIND_END, HEADER_REQUEST_ID: s.request_id})
            except ApiError as err:
                s.status = err.status
                await self._error(reply, err, s.request_id)
            except asyncio.CancelledError:
                if reply.gone:  # no one listens on the reply subject any more: stop the engine's work
                    s.client_left()
                    task = asyncio.current_task()
                    if task is not None and task.uncancel() == 0:
                        return
                    raise  # cancelled for another reason as well
                # the frontend is shutting down, past its --drain-timeout
                s.status = 503
                s.cancel("shutdown")
                # a NATS client has no connection that closes: say so, or it waits for its own timeout
                try:
                    await self._error(reply, ApiError(503, "the frontend is shutting down; retry the request",
                                                      type="service_unavailable_error"), s.request_id)
                except Exception:  # connection already gone
                    pass
                raise
            except Exception as exc:  # one bad request never takes the API down
                log.exception("nats_api_request_failed", request_id=s.carried, error=str(exc))
                s.cancel("error")
                try:
                    await self._error(reply, ApiError(500, "internal error"), s.request_id)
                except Exception:
                    pass
            finally:
                reply.close()
