"""One API request's bookkeeping, the same over HTTP (``app.py``) and NATS (``nats_api.py``): the
request counters and latency, the server span, the request ids, the model label and the final
status. Each transport keeps only what differs: how it reads the body, writes the answer, and learns
that its client left.

    with serving(pipeline, "http", endpoint, trace_header) as s:
        s.take_ids(header_value)
        s.parse(body)
        ex = await s.open(body, session_ids=...)
        ...            # write the answer; set ``s.status`` where it differs from the exchange's
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from infera_common.schemas import Endpoint
from infera_common.tracing import SpanKind, finish, start_span, traceparent

from infera_frontend.exchange import Exchange
from infera_frontend.pipeline import Pipeline, new_request_id
from infera_frontend.validation import Parsed

Transport = Literal["http", "nats"]
_SPAN_VERB = {"http": "POST", "nats": "NATS"}


class Served:
    def __init__(self, pipeline: Pipeline, transport: Transport, endpoint: Endpoint, span: Any) -> None:
        self.pipeline = pipeline
        self.transport = transport
        self.endpoint = endpoint
        self.span = span
        self.t0 = time.perf_counter()
        self.status = 500  # what the client got; 500 until something says otherwise
        self.request_id = new_request_id()  # echoed to the client (its own when it gave one)
        self.carried = self.request_id  # carried to the worker and the engine
        self.parsed: Parsed | None = None
        self.ex: Exchange | None = None

    def take_ids(self, header: str | None) -> None:
        """The client's ``X-Request-Id`` (or a new one): ``Pipeline.request_ids``."""
        self.request_id, self.carried = self.pipeline.request_ids(header)
        self.span.set_attribute("infera.request_id", self.request_id)
        self.span.set_attribute("infera.carried_request_id", self.carried)

    def parse(self, body: bytes) -> Parsed:
        self.parsed = self.pipeline.parse(self.endpoint, body)
        self.span.set_attribute("infera.model", self.parsed.model)
        return self.parsed

    async def open(self, body: bytes, *, session_ids: list[str] | None = None,
                   cancel_reason: str | Callable[[], str] = "client_disconnect") -> Exchange:
        """``Pipeline.open``, the request's first byte counted; its status is the exchange's."""
        assert self.parsed is not None
        self.ex = await self.pipeline.open(self.parsed, body, self.carried, session_ids=session_ids,
                                          cancel_reason=cancel_reason, traceparent=traceparent(self.span))
        self.status = self.ex.status
        self.pipeline.metrics.first_byte(self.transport, self.endpoint.value, time.perf_counter() - self.t0)
        return self.ex

    def cancel(self, reason: str) -> None:
        """Stop the engine's work for ``reason`` (client_disconnect, shutdown, error), if it began."""
        if self.ex is not None:
            self.ex.cancel(reason)

    def client_left(self) -> None:
        """The client went away before its answer ended: 499 (nginx's convention), counted, work stopped."""
        self.status = 499
        self.pipeline.metrics.client_disconnects.labels(self.endpoint.value).inc()
        self.cancel("client_disconnect")


@contextmanager
def serving(pipeline: Pipeline, transport: Transport, endpoint: Endpoint,
            trace_header: str | None) -> Iterator[Served]:
    """Count the request, open its span (under the client's ``traceparent``), and at the end, whatever
    happened, release its exchange and record its status, model and latency."""
    metrics = pipeline.metrics
    metrics.started(transport)
    span = start_span(f"{_SPAN_VERB[transport]} {endpoint.value}", trace_header, SpanKind.SERVER)
    s = Served(pipeline, transport, endpoint, span)
    try:
        yield s
    finally:
        if s.ex is not None:
            s.ex.close()
        metrics.finished(transport, endpoint.value, s.status, pipeline.model_label(s.parsed),
                         time.perf_counter() - s.t0)
        finish(span, s.status)
