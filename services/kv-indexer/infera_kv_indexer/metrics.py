"""The kv-indexer's Prometheus metrics, on its own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Overlap query handling time, decode to reply: tens of microseconds for a long prompt.
QUERY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)
#: Seconds between the agent relaying a batch and the index applying it (live messages, not a replay's).
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 300.0, 3600.0)


class KvIndexerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.relay_messages = Counter(
            "infera_kv_indexer_relay_messages",
            "KvRelay messages read from the stream, by kind (blocks: translated by the agent; batch: raw; cleared).",
            ["kind"], registry=r,
        )
        self.events = Counter(
            "infera_kv_indexer_events_applied",
            "Raw engine KV events translated and applied here, by type (ZMQ transport; batch relays).",
            ["type"], registry=r,
        )
        self.blocks = Counter(
            "infera_kv_indexer_blocks_applied",
            "Index blocks a target newly holds (stored) or no longer holds (removed), from either form of input.",
            ["op"], registry=r,
        )
        self.malformed = Counter(
            "infera_kv_indexer_malformed",
            "Dropped input: relay (undecodable KvRelay), batch (undecodable engine batch), event (one bad event), "
            "zmq (a ZMQ message that is not [topic, 8-byte seq, batch]), state (a rank of a worker-agent's /kv_state).",
            ["kind"], registry=r,
        )
        self.gaps = Counter(
            "infera_kv_indexer_seq_gaps", "Engine batches missing between two consecutive batches of a target (lost).",
            registry=r,
        )
        self.duplicates = Counter(
            "infera_kv_indexer_duplicates_skipped", "Engine batches skipped because their seq was already applied.",
            registry=r,
        )
        self.unknown_removed = Counter(
            "infera_kv_indexer_unknown_removed", "Removed engine block hashes the index did not hold (ignored).",
            registry=r,
        )
        self.orphaned = Counter(
            "infera_kv_indexer_orphaned_blocks", "Stored blocks dropped because their parent block was unknown.",
            registry=r,
        )
        self.lag = Histogram(
            "infera_kv_indexer_lag_seconds",
            "Seconds from the agent relaying a message to the index applying it, beyond the transit of the agent's "
            "least late recent heartbeat (so another host's clock offset drops out; live messages: not those of the "
            "stream's replay at start, whose age is the history's).",
            buckets=LAG_BUCKETS, registry=r,
        )
        self.worker_blocks = Gauge(
            "infera_kv_indexer_worker_blocks", "Blocks indexed per worker (all DP ranks).", ["worker"], registry=r,
        )
        self.worker_last_event = Gauge(
            "infera_kv_indexer_worker_last_event_timestamp_seconds",
            "Unix time at which the latest KV event message applied from the worker was relayed (its engine's "
            "events, as its agent relayed them; or read from its publisher). A worker that takes requests but "
            "whose time stops moving has a broken event path: alert on time() minus it.",
            ["worker"], registry=r,
        )
        self.workers = Gauge(
            "infera_kv_indexer_workers",
            "Workers by state: seen (in discovery, events arrived), unseen (in discovery, no events yet), "
            "unattached (events arrived, not in discovery).",
            ["state"], registry=r,
        )
        self.queries = Counter(
            "infera_kv_indexer_queries", "Overlap queries answered, by result (ok, malformed, failed).", ["result"], registry=r,
        )
        self.query_seconds = Histogram(
            "infera_kv_indexer_query_seconds", "Time to answer an overlap query (decode, match, encode).",
            buckets=QUERY_BUCKETS, registry=r,
        )
        self.replaying = Gauge(
            "infera_kv_indexer_replaying", "1 while the stream's history is being replayed at start, else 0.",
            registry=r,
        )
        # --- workers on --kv-event-transport zmq: their publishers read directly ---
        self.zmq_workers = Gauge(
            "infera_kv_indexer_zmq_workers", "Workers whose KV events are read from their ZMQ publishers.", registry=r,
        )
        self.zmq_endpoints = Gauge(
            "infera_kv_indexer_zmq_endpoints_connected",
            "ZMQ KV-event publishers (one per DP rank) this indexer is connected to, per worker.", ["worker"], registry=r,
        )
        self.zmq_batches = Counter(
            "infera_kv_indexer_zmq_batches", "Engine batches read from ZMQ publishers and applied (replayed included).",
            registry=r,
        )
        self.zmq_replayed = Counter(
            "infera_kv_indexer_zmq_replayed_batches",
            "Engine batches recovered from a replay socket (the first replay of a worker, and gap fills).", registry=r,
        )
        self.zmq_gaps = Counter(
            "infera_kv_indexer_zmq_gaps", "ZMQ sequence gaps, by outcome (detected|filled|unrecoverable).",
            ["outcome"], registry=r,
        )
        self.zmq_lost = Counter(
            "infera_kv_indexer_zmq_lost_batches", "Engine batches missed on ZMQ and not recovered by replay.",
            registry=r,
        )
        self.zmq_states = Counter(
            "infera_kv_indexer_zmq_agent_states",
            "Reads of a worker-agent's whole KV holding (its record's kv_state_url) before following its engine "
            "on the ZMQ path, by result (read, failed: only the engine's replay buffer rebuilds it).",
            ["result"], registry=r,
        )
        self.zmq_restarts = Counter(
            "infera_kv_indexer_zmq_engine_restarts",
            "Engine restarts seen on the ZMQ path, by how (record: new started_at in discovery; seq: the "
            "publisher's seq went back): the worker's blocks are cleared and rebuilt from replay.",
            ["how"], registry=r,
        )
        self._children: dict[tuple[str, str], object] = {}
        self._stored = self._removed = 0  # counts not flushed yet
        self._relays: dict[str, int] = {}
        self._block_gauges: dict[str, Gauge] = {}
        self._zmq_workers: set[str] = set()  # labels of zmq_endpoints

    def event_applied(self, event_type: str, n: int) -> None:
        self._child(self.events, "events", event_type).inc(n)

    # --- the ingest hot path: plain counts, added to their families by flush() (service: every second)
    def blocks_applied(self, stored: int, removed: int) -> None:
        self._stored += stored
        self._removed += removed

    def relay_message(self, kind: str) -> None:
        self._relays[kind] = self._relays.get(kind, 0) + 1

    def flush(self) -> None:
        """Add the counts gathered since the last flush to their Prometheus counters."""
        if self._stored:
            self._child(self.blocks, "blocks", "stored").inc(self._stored)
        if self._removed:
            self._child(self.blocks, "blocks", "removed").inc(self._removed)
        for kind, n in self._relays.items():
            self._child(self.relay_messages, "relay_messages", kind).inc(n)
        self._stored = self._removed = 0
        self._relays.clear()

    def _child(self, family: Counter, name: str, label: str):  # noqa: ANN202 - prometheus' child type
        """A labelled child, looked up once (``labels()`` costs microseconds on the ingest path)."""
        child = self._children.get((name, label))
        if child is None:
            child = self._children[(name, label)] = family.labels(label)
        return child

    def set_blocks(self, worker_id: str, blocks: int, relayed: float | None = None) -> None:
        """A worker's block count; with ``relayed``, when its latest event message was relayed."""
        child = self._block_gauges.get(worker_id)
        if child is None:
            child = self._block_gauges[worker_id] = self.worker_blocks.labels(worker_id)
        child.set(blocks)
        if relayed is not None:
            self.worker_last_event.labels(worker_id).set(relayed)

    def forget_worker(self, worker_id: str) -> None:
        if self._block_gauges.pop(worker_id, None) is not None:
            self.worker_blocks.remove(worker_id)
        try:
            self.worker_last_event.remove(worker_id)
        except KeyError:  # no event came from it
            pass
        self.forget_zmq_worker(worker_id)

    def set_zmq_endpoints(self, worker_id: str, connected: int) -> None:
        self._zmq_workers.add(worker_id)
        self.zmq_endpoints.labels(worker_id).set(connected)

    def forget_zmq_worker(self, worker_id: str) -> None:
        if worker_id in self._zmq_workers:
            self._zmq_workers.discard(worker_id)
            self.zmq_endpoints.remove(worker_id)

    def set_workers(self, seen: int, unseen: int, unattached: int) -> None:
        self.workers.labels("seen").set(seen)
        self.workers.labels("unseen").set(unseen)
        self.workers.labels("unattached").set(unattached)
