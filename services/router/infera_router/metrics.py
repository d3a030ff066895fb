"""The router's Prometheus metrics, on its own registry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from infera_common.schemas import WorkerStatus

if TYPE_CHECKING:
    from infera_router.policy_kv_aware import WorkerCost

#: Route handling time, decode to reply: tens of microseconds for the decision plus one
#: JetStream publish round trip.
#: A kv-indexer overlap query: ~0.3 ms of work plus a NATS round trip; the timeout bounds it.
KV_QUERY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
#: Request sizes and cache hits, in KV blocks.
BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
#: infera_router_breaker_state values.
BREAKER_STATE_VALUES = {"closed": 0, "half_open": 1, "open": 2}
ROUTE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.routed = Counter(
            "infera_router_routed", "Route requests answered, by model, chosen worker ('' if none) and status.",
            ["model", "worker", "status"], registry=r,
        )
        self.route_seconds = Histogram(
            "infera_router_route_seconds", "Time to answer a route request (decode, decide, publish, reply).",
            buckets=ROUTE_BUCKETS, registry=r,
        )
        self.publish_refused = Counter(
            "infera_router_publish_refused",
            "Work envelopes a worker's stream refused: full (pending limit), gone (no stream), error.",
            ["worker", "reason"], registry=r,
        )
        self.active_leases = Gauge(
            "infera_router_active_leases",
            "Leases this router holds, per worker: requests queued or running there, and requests whose hand-over "
            "to it waits for the queue's answer (each counts on one worker at a time; one refused as full moves to "
            "the next, so under a burst of 429s this may exceed the worker's --max-pending for a moment).",
            ["worker"], registry=r,
        )
        self.releases = Counter(
            "infera_router_lease_releases", "Leases released by the worker-agent, by outcome.", ["outcome"], registry=r,
        )
        self.route_expired = Counter(
            "infera_router_route_expired",
            "Route requests dropped unplaced: their requester had stopped waiting (RouteRequest.route_deadline) "
            "before this router got to them (the router stalled or fell behind).",
            registry=r,
        )
        self.requester_clock_offset = Gauge(
            "infera_router_requester_clock_offset_seconds",
            "The largest difference measured between this router's wall clock and a frontend's, in absolute "
            "seconds (route deadlines are read with it; above a second, the hosts' time sync is off).",
            registry=r,
        )
        self.unknown_releases = Counter(
            "infera_router_unknown_releases",
            "Releases for leases this router does not hold (already dropped or never issued); ignored.",
            registry=r,
        )
        self.leases_dropped = Counter(
            "infera_router_leases_dropped",
            "Leases dropped without a release: worker_left (left discovery), max_age (release lost).",
            ["reason"], registry=r,
        )
        self.prefilled = Counter(
            "infera_router_prefilled",
            "Streamed requests whose first token went out (their prompt stops counting as pending prefill).",
            registry=r,
        )
        self.pd_pairs = Counter(
            "infera_router_pd_pairs", "Requests handed to a prefill and a decode worker.", registry=r,
        )
        self.pd_leg_failures = Counter(
            "infera_router_pd_leg_failures", "Disaggregated legs that failed, by leg.", ["leg"], registry=r,
        )
        self.pd_legs_cancelled = Counter(
            "infera_router_pd_legs_cancelled",
            "Legs the router stopped because the other leg failed, the client left or a worker vanished.",
            registry=r,
        )
        self.workers_off_bus = Counter(
            "infera_router_workers_off_bus", "Times a worker whose load report was overdue was found to have left "
            "the bus (NATS: no responder for its agent) and was taken out of routing until it reports again.",
            registry=r,
        )
        self.queues_deleted = Counter(
            "infera_router_queues_deleted", "Work-queue streams of workers that left discovery without deleting "
            "them (killed agents), deleted one discovery TTL later when nothing read them.", registry=r,
        )
        self.bad_messages = Counter(
            "infera_router_bad_messages", "Messages that could not be decoded, by kind (route, release, prefilled, load).",
            ["kind"], registry=r,
        )
        self.load_reports = Counter(
            "infera_router_load_reports", "Load reports received: accepted, or ignored (unknown_worker).",
            ["result"], registry=r,
        )
        self.live_workers = Gauge(
            "infera_router_live_workers", "Workers in discovery per model and status.", ["model", "status"], registry=r,
        )
        # --- kv-aware routing ---
        self.kv_query_failures = Counter(
            "infera_router_kv_query_failures",
            "kv-indexer queries that gave no answer (no_indexer, timeout, error, bad_reply); "
            "each such request was routed by load only.", ["reason"], registry=r,
        )
        self.kv_queries_direct = Counter(
            "infera_router_kv_queries_direct",
            "Overlap queries sent to one kv-indexer's own subject, the first to answer infera.kv.ping, instead of "
            "the indexers' queue group: within 30 s of a query no indexer answered (an indexer frozen or hung).",
            registry=r,
        )
        self.kv_queries_skipped = Counter(
            "infera_router_kv_queries_skipped",
            "kv-aware requests routed without a kv-indexer query: the prompt is shorter than every "
            "candidate's KV block size, so no worker can hold any of it.", registry=r,
        )
        self.kv_index_replaying = Gauge(
            "infera_router_kv_index_replaying",
            "--kv-index local: 1 while the router replays the KV event stream's history at start.", registry=r,
        )
        self.kv_index_messages = Counter(
            "infera_router_kv_index_messages",
            "--kv-index local: KV event stream messages the router's own index took in, by outcome (applied, "
            "malformed, failed).", ["outcome"], registry=r,
        )
        self.kv_query_seconds = Histogram(
            "infera_router_kv_query_seconds", "Time of one kv-indexer overlap query (failures included).",
            buckets=KV_QUERY_BUCKETS, registry=r,
        )
        self.kv_hit_blocks = Histogram(
            "infera_router_kv_hit_blocks", "kv-aware picks: cached prefix blocks on the chosen worker.",
            buckets=BLOCK_BUCKETS, registry=r,
        )
        self.kv_request_blocks = Histogram(
            "infera_router_kv_request_blocks",
            "kv-aware picks: the request's blocks at the chosen worker's block size.",
            buckets=BLOCK_BUCKETS, registry=r,
        )
        self.kv_picks = Counter(
            "infera_router_kv_picks", "kv-aware picks (first choice of each request), by worker.",
            ["worker"], registry=r,
        )
        self.kv_picks_without_cache_info = Counter(
            "infera_router_kv_picks_without_cache_info",
            "kv-aware picks whose chosen worker's cache depth was unknown, by reason: unknown_block_size, "
            "unseen (indexer never got its events), no_tokens, no_block_size (no candidate publishes one), "
            "or the query failure (no_indexer, timeout, error, bad_reply).", ["reason"], registry=r,
        )
        self.kv_workers_without_events = Gauge(
            "infera_router_kv_workers_without_events",
            "1 for a worker whose cache depth the router could not know at its last kv-aware pick "
            "(reason: unknown_block_size or unseen), else 0.", ["worker", "reason"], registry=r,
        )
        # --- session affinity (sessions.SessionTable), by role; never by session id ---
        self.session_active_leases = Gauge(
            "infera_router_session_active_leases", "Running requests holding a session binding, by role.",
            ["role"], registry=r,
        )
        self.session_bindings = Gauge(
            "infera_router_session_bindings", "Sessions currently bound to a target, by role.", ["role"], registry=r,
        )
        self.session_hits = Counter(
            "infera_router_session_hits", "Requests sent to their session's bound target, by role.",
            ["role"], registry=r,
        )
        self.session_selections = Counter(
            "infera_router_session_selections",
            "Session bindings recorded after the policy picked (new sessions and replacements), by role.",
            ["role"], registry=r,
        )
        self.session_fallbacks = Counter(
            "infera_router_session_fallbacks",
            "Requests whose session's bound target was unavailable and were routed by the policy, by role.",
            ["role"], registry=r,
        )
        self.session_dropped = Counter(
            "infera_router_session_dropped",
            "Session bindings dropped, by role and reason: expired (idle past the TTL), invalidated "
            "(request or stream failed).", ["role", "reason"], registry=r,
        )
        self.session_unbound = Counter(
            "infera_router_session_unbound",
            "Session requests routed without a binding because the session table was full, by role.",
            ["role"], registry=r,
        )
        # --- circuit breaker (breaker.CircuitBreaker) and failover ---
        self.breaker_state = Gauge(
            "infera_router_breaker_state", "Circuit breaker per worker: 0 closed, 1 half_open, 2 open.",
            ["worker"], registry=r,
        )
        self.breaker_trips = Counter(
            "infera_router_breaker_trips", "Times a worker's circuit breaker opened (trips and failed probes).",
            ["worker"], registry=r,
        )
        self.breaker_all_open = Counter(
            "infera_router_breaker_all_open",
            "Requests routed although every candidate's circuit breaker was open, by model.",
            ["model"], registry=r,
        )
        self.retries = Counter(
            "infera_router_retries", "Requests retried on another worker before their first byte, by failure kind.",
            ["kind"], registry=r,
        )
        self.http_requests = Counter(
            "infera_router_http_requests", "Requests this router ran on engines itself (--request-transport http), "
            "by outcome (ok|error|cancelled|expired).", ["outcome"], registry=r,
        )
        self.http_in_flight = Gauge(
            "infera_router_http_in_flight", "Requests this router is running on engines itself (--request-transport http).",
            registry=r,
        )
        self.http_cancels = Counter(
            "infera_router_http_cancels", "Cancel messages received for requests this router runs itself.", registry=r,
        )
        self.http_requester_gone = Counter(
            "infera_router_http_requester_gone_requests",
            "Requests this router ran on engines itself, stopped because their frontend left the message bus.",
            registry=r,
        )
        self.http_frames_queries = Counter(
            "infera_router_http_frames_queries", "Frontends' questions (FramesQuery: after a broker outage, or about "
            "requests silent for 2 s) about requests this router runs itself, by outcome.", ["outcome"], registry=r,
        )
        self.http_frames_replays = Counter(
            "infera_router_http_frames_replays", "Frontends' requests to send frames of requests this router runs "
            "itself again (FramesReplay), by outcome.", ["outcome"], registry=r,
        )
        self.plane_mismatches = Counter(
            "infera_router_plane_mismatches", "Workers that joined on another request or KV-event plane than this "
            "router's, by flag (--request-transport: not routed to; --kv-event-transport: cache-blind).",
            ["flag"], registry=r,
        )
        self._session_seen: dict[tuple[str, str], int] = {}  # (role, counter) -> value already exported
        self._blind: dict[str, str] = {}  # worker -> reason currently set to 1
        self._lease_gauges: dict[str, Gauge] = {}
        # label children of the per-request series, resolved once (labels() is slow)
        self._routed: dict[tuple[str, str, int], Counter] = {}
        self.release_outcomes = {o: self.releases.labels(o) for o in ("ok", "error", "cancelled", "expired")}
        self.load_accepted = self.load_reports.labels("accepted")
        self.load_unknown = self.load_reports.labels("unknown_worker")

    def routed_inc(self, model: str, worker: str, status: int) -> None:
        child = self._routed.get((model, worker, status))
        if child is None:
            child = self._routed[(model, worker, status)] = self.routed.labels(model, worker, str(status))
        child.inc()

    def set_leases(self, worker_id: str, count: int) -> None:
        child = self._lease_gauges.get(worker_id)
        if child is None:
            child = self._lease_gauges[worker_id] = self.active_leases.labels(worker_id)
        child.set(count)

    def set_blind(self, worker_id: str, reason: str | None) -> None:
        """Mark a worker's cache as unknown (``reason``) or known (None) in the gauge."""
        old = self._blind.get(worker_id)
        if old == reason:
            return
        if old is not None:
            self.kv_workers_without_events.labels(worker_id, old).set(0)
        if reason is None:
            self._blind.pop(worker_id, None)
        else:
            self._blind[worker_id] = reason
            self.kv_workers_without_events.labels(worker_id, reason).set(1)

    def forget_worker(self, worker_id: str) -> None:
        """A worker left: its series go, or they would pile up where worker ids change with each start."""
        for per_worker in (self.routed, self.publish_refused, self.kv_picks, self.breaker_trips):
            per_worker.remove_by_labels({"worker": worker_id})
        reason = self._blind.pop(worker_id, None)
        if reason is not None:
            self.kv_workers_without_events.remove(worker_id, reason)
        if self._lease_gauges.pop(worker_id, None) is not None:
            self.active_leases.remove(worker_id)
        self.set_breaker_state(worker_id, None)

    def set_live(self, model: str, counts: dict[str, int]) -> None:
        for status in WorkerStatus:
            self.live_workers.labels(model, status.value).set(counts.get(status.value, 0))

    def set_session_stats(self, stats: Mapping[str, Any]) -> None:
        """Export a ``SessionTable.stats()`` snapshot: set the gauges, advance the counters."""
        counters = (("hits", self.session_hits, ()), ("selections", self.session_selections, ()),
                    ("fallbacks", self.session_fallbacks, ()), ("unbound_full", self.session_unbound, ()),
                    ("expired", self.session_dropped, ("expired",)),
                    ("invalidated", self.session_dropped, ("invalidated",)))
        for role, s in stats.items():
            role = str(role)
            self.session_active_leases.labels(role).set(s.active_leases)
            self.session_bindings.labels(role).set(s.bindings)
            for name, metric, extra in counters:
                value = getattr(s, name)
                child = metric.labels(role, *extra)  # the series exists from the first export, at 0
                delta = value - self._session_seen.get((role, name), 0)
                if delta > 0:
                    child.inc(delta)
                self._session_seen[(role, name)] = value

    def set_breaker_state(self, worker: str, state: str | None) -> None:
        """Export a worker's breaker state (closed / half_open / open); None removes the series."""
        if state is None:
            try:
                self.breaker_state.remove(worker)
            except KeyError:
                pass
        else:
            self.breaker_state.labels(worker).set(BREAKER_STATE_VALUES[state])


def account_pick(m: RouterMetrics, costs: list[WorkerCost], asked: bool = True) -> None:
    """Metrics of one kv-aware decision (``costs`` cheapest first; ``asked`` False: decided without
    the indexer, which then said nothing about which workers it has seen)."""
    best = costs[0]
    m.kv_picks.labels(best.worker_id).inc()
    m.kv_hit_blocks.observe(best.matched_blocks)
    m.kv_request_blocks.observe(best.request_blocks)
    if best.cache_info != "ok":
        m.kv_picks_without_cache_info.labels(best.cache_info).inc()
    for c in costs:
        if c.cache_info in ("ok", "unknown_block_size", "unseen") and (asked or c.cache_info != "ok"):
            m.set_blind(c.worker_id, None if c.cache_info == "ok" else c.cache_info)
