"""The frontend's Prometheus metrics, on its own registry (served at GET /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKENIZE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)

#: Label value for a model no worker serves (keeps label cardinality bounded).
UNKNOWN_MODEL = "_unknown"


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._children: dict[int, dict[tuple[str, ...], object]] = {}
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "infera_frontend_requests",
            "Requests answered, by transport (http|nats), endpoint, HTTP status and model; a stream that ended in "
            "an error event after its 200 counts under that error's status.",
            ["transport", "endpoint", "status", "model"], registry=r,
        )
        self.ttfb = Histogram(
            "infera_frontend_time_to_first_byte_seconds",
            "Request arrival to the response head (status line / first NATS reply) of requests a worker "
            "answered; a stream's head waits for its first token. Errors the frontend answers itself "
            "(4xx, no worker, router errors) are not observed.",
            ["transport", "endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.duration = Histogram(
            "infera_frontend_request_duration_seconds", "Request arrival to the end of the response.",
            ["transport", "endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.in_flight = Gauge(
            "infera_frontend_requests_in_flight", "Completion requests being served.", ["transport"], registry=r,
        )
        self.unauthorized = Counter(
            "infera_frontend_unauthorized_requests",
            "HTTP requests refused with 401 for a missing or wrong API key (--api-key).", registry=r,
        )
        self.client_disconnects = Counter(
            "infera_frontend_client_disconnects",
            "Clients gone before their response was complete (request cancelled).",
            ["endpoint"], registry=r,
        )
        self.tokenize_seconds = Histogram(
            "infera_frontend_tokenize_seconds", "Chat template + tokenization time per request.",
            ["endpoint"], buckets=_TOKENIZE_BUCKETS, registry=r,
        )
        self.token_invariant_failures = Counter(
            "infera_frontend_token_invariant_failures",
            "Requests routed without token ids because the chat template could not be rendered.",
            registry=r,
        )
        self.token_mismatch = Counter(
            "infera_frontend_token_mismatch",
            "Responses whose engine usage.prompt_tokens differs from the frontend's prompt token count "
            "(the token invariant is broken: KV-aware routing hashes other ids than the engine caches), by worker.",
            ["worker"], registry=r,
        )
        self.route_errors = Counter(
            "infera_frontend_route_errors",
            "Requests the router did not place, by status (503 includes router unreachable).",
            ["status"], registry=r,
        )
        self.routes_direct = Counter(
            "infera_frontend_routes_direct",
            "Route requests sent to one router's own subject, the first to answer infera.router.ping, instead of "
            "the routers' queue group: within 30 s of a route request no router answered (a router frozen or hung).",
            registry=r,
        )
        self.upstream_timeouts = Counter(
            "infera_frontend_upstream_timeouts",
            "Requests cancelled because no frame came within --upstream-timeout.",
            ["endpoint"], registry=r,
        )
        self.cancels = Counter(
            "infera_frontend_cancels_sent", "Cancel messages published to worker-agents, by reason.", ["reason"], registry=r,
        )
        self.retries = Counter(
            "infera_frontend_retries",
            "Requests tried again on another worker after failing before their first byte, by reason "
            "(worker_<status>, engine_<status>, upstream_timeout, no_router).",
            ["reason"], registry=r,
        )
        self.bad_frames = Counter(
            "infera_frontend_bad_frames", "Response frames that could not be decoded or came out of order.", registry=r,
        )
        self.frames_lost = Counter(
            "infera_frontend_frames_lost",
            "Requests ended because response frames from the worker never arrived and it could not send them again.",
            registry=r,
        )
        self.clients_too_slow = Counter(
            "infera_frontend_clients_too_slow",
            "Streams cancelled because their client read them more slowly than the engine wrote them, until "
            "--max-unread-frames response frames waited unread.",
            registry=r,
        )
        self.frames_replayed = Counter(
            "infera_frontend_frames_replayed",
            "Times a worker sent the frames of a request again, after they were lost on the way (a broker outage).",
            registry=r,
        )
        self.nats_api_refused = Counter(
            "infera_frontend_nats_api_refused",
            "NATS API requests dropped unanswered, by reason: their reply subject is not a publishable subject "
            "(invalid), or is an API subject (api_subject: the answers would be requests to the API).",
            ["reason"], registry=r,
        )
        self.senders_gone = Counter(
            "infera_frontend_senders_gone",
            "Times the process sending silent requests' frames (a worker-agent, or a router on --request-transport "
            "http) had left the message bus: its requests were ended (retried while their clients had nothing).",
            registry=r,
        )

    # --- per-request recording with pre-resolved label children (labels() costs a lock + checks) ---

    def _child(self, metric, *key: str):
        cache = self._children.setdefault(id(metric), {})
        child = cache.get(key)
        if child is None:
            child = cache[key] = metric.labels(*key)
        return child

    def forget_worker(self, worker_id: str) -> None:
        """Drop a worker's series (it left discovery)."""
        try:
            self.token_mismatch.remove(worker_id)
        except KeyError:  # no mismatch counted for it
            pass

    def started(self, transport: str) -> None:
        self._child(self.in_flight, transport).inc()

    def tokenized(self, endpoint: str, seconds: float) -> None:
        self._child(self.tokenize_seconds, endpoint).observe(seconds)

    def first_byte(self, transport: str, endpoint: str, seconds: float) -> None:
        self._child(self.ttfb, transport, endpoint).observe(seconds)

    def finished(self, transport: str, endpoint: str, status: int, model: str, seconds: float) -> None:
        self._child(self.in_flight, transport).dec()
        self._child(self.requests, transport, endpoint, str(status), model).inc()
        self._child(self.duration, transport, endpoint).observe(seconds)
