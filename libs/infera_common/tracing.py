"""OpenTelemetry tracing: one request's spans across the services, in the client's W3C trace.

Spans are recorded only when ``--otlp-traces-endpoint`` (``INFERA_OTLP_TRACES_ENDPOINT``) names an
OTLP/HTTP collector (``http://collector:4318/v1/traces``); they are exported in batches (the SDK's
``OTEL_BSP_*`` variables tune it). On or off, the trace context travels with the request as a W3C
``traceparent`` string:

    client header (HTTP, or the NATS request's header) -> frontend span ``POST /v1/...`` (server)
    -> ``RouteRequest.traceparent`` -> router span ``route`` (and its ``kv query``, whose NATS request's
    ``traceparent`` header parents the kv-indexer's span ``kv overlap query``)
    -> the work envelope's engine headers -> engine span ``engine POST /v1/...`` (client; the
    worker-agent, or the router on ``--request-transport http``) -> the engine's HTTP request header

so an engine with its own tracing on (vLLM ``--otlp-traces-endpoint``) continues the same trace.
With tracing off each hop passes the client's context through unchanged; a malformed
``traceparent`` is ignored (a new trace starts, or none).
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["Span", "SpanKind", "configure_tracing", "engine_headers", "finish", "start_span", "traceparent"]

HEADER = "traceparent"
_PROPAGATOR = TraceContextTextMapPropagator()
_TRACER = trace.get_tracer("infera")  # follows the provider configure_tracing sets (a no-op one until then)


def configure_tracing(endpoint: str | None, service: str) -> None:
    """Export this process's spans to ``endpoint`` as ``infera-<service>``; nothing when ``endpoint`` is unset."""
    if not endpoint:
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"infera-{service}"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)  # flushed and shut down at exit
    if (why := unreachable(endpoint)) is not None:  # not fatal: a collector may come up later
        from infera_common.logs import get_logger

        get_logger("tracing").warning(
            "otlp_collector_unreachable", endpoint=endpoint, error=why,
            hint="no OTLP/HTTP collector answers there: spans are dropped after retries (and the SDK retries "
                 "for seconds at exit); check --otlp-traces-endpoint / INFERA_OTLP_TRACES_ENDPOINT")


def unreachable(endpoint: str, timeout: float = 1.0) -> str | None:
    """Why nothing accepts a TCP connection at ``endpoint``'s host and port; None when something does."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(endpoint)
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
        with socket.create_connection((url.hostname or "", port), timeout=timeout):
            return None
    except (OSError, ValueError) as exc:
        return str(exc) or type(exc).__name__


def start_span(name: str, parent: str | None, kind: SpanKind = SpanKind.INTERNAL,
               attributes: Mapping[str, str | int | float | bool] | None = None) -> Span:
    """A span under ``parent`` (a ``traceparent``; None or malformed: a new trace). End it with ``finish``."""
    context = _PROPAGATOR.extract({HEADER: parent}) if parent else None
    return _TRACER.start_span(name, context=context, kind=kind, attributes=attributes)


def traceparent(span: Span) -> str | None:
    """``span``'s context as a ``traceparent`` (tracing off: the parent it was started under, if any)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get(HEADER)


def engine_headers(parent: str | None) -> dict[str, str]:
    """The header that carries ``parent`` on to the next hop (empty without one)."""
    return {HEADER: parent} if parent else {}


def finish(span: Span, status: int | None = None, error: str | None = None) -> None:
    """End ``span`` with the HTTP ``status`` it answered (5xx, or an ``error``: the span failed)."""
    if status is not None:
        span.set_attribute("http.response.status_code", status)
    if error is not None or (status is not None and status >= 500):
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()
