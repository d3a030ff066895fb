"""The router's Prometheus metrics, on its own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from infera_common.schemas import WorkerStatus

#: Route handling time, decode to reply: tens of microseconds for the decision plus one
#: JetStream publish round trip.
#: A kv-indexer overlap query: ~0.3 ms of work plus a NATS round trip; the timeout bounds it.
KV_QUERY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
#: Request sizes and cache hits, in KV blocks.
BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
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
            "infera_router_active_leases", "Leases this router holds, per worker.", ["worker"], registry=r,
        )
        self.releases = Counter(
            "infera_router_lease_releases", "Leases released by the worker-agent, by outcome.", ["outcome"], registry=r,
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
        self.bad_messages = Counter(
            "infera_router_bad_messages", "Messages that could not be decoded, by kind (route, release, load).",
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
        reason = self._blind.pop(worker_id, None)
        if reason is not None:
            self.kv_workers_without_events.remove(worker_id, reason)
        if self._lease_gauges.pop(worker_id, None) is not None:
            self.active_leases.remove(worker_id)

    def set_live(self, model: str, counts: dict[str, int]) -> None:
        for status in WorkerStatus:
            self.live_workers.labels(model, status.value).set(counts.get(status.value, 0))
