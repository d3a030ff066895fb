"""The worker-agent's Prometheus metrics, on its own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "infera_agent_requests", "Requests finished, by outcome (ok|error|cancelled|expired).",
            ["outcome"], registry=r,
        )
        self.in_flight = Gauge("infera_agent_in_flight", "Requests handed to the engine and not finished.", registry=r)
        self.engine_running = Gauge("infera_agent_engine_running", "Engine's running requests (last scrape).", registry=r)
        self.engine_waiting = Gauge("infera_agent_engine_waiting", "Engine's queued requests (last scrape).", registry=r)
        self.engine_kv_usage = Gauge("infera_agent_engine_kv_usage", "Engine's KV-cache usage, 0..1 (last scrape).", registry=r)
        self.bad_envelopes = Counter(
            "infera_agent_bad_envelopes", "Work messages that were not a valid WorkEnvelope (dropped).", registry=r
        )
        self.bad_cancels = Counter("infera_agent_bad_cancels", "Cancel messages that were not a valid Cancel.", registry=r)
        self.cancels = Counter("infera_agent_cancels", "Cancel messages received.", registry=r)
        self.requester_clock_offset = Gauge(
            "infera_agent_requester_clock_offset_seconds",
            "The largest difference measured between this host's wall clock and a frontend's, in absolute seconds "
            "(request deadlines are read with it; above a second, the hosts' time sync is off).",
            registry=r,
        )
        self.requesters_gone = Counter(
            "infera_agent_requester_gone_requests",
            "Requests stopped because their frontend left the message bus (requester_watch): the engine aborted them.",
            registry=r,
        )
        self.frames_queries = Counter(
            "infera_agent_frames_queries", "Frontends' questions about the frames sent (FramesQuery: after a broker "
            "outage, or about requests silent for 2 s), by outcome.",
            ["outcome"], registry=r,
        )
        self.frames_replays = Counter(
            "infera_agent_frames_replays", "Frontends' requests to send frames again (FramesReplay), by outcome.",
            ["outcome"], registry=r,
        )
        self.engine_restarts = Counter("infera_agent_engine_restarts", "Engine restarts by the agent.", registry=r)
        self.engine_exit_code = Gauge(
            "infera_agent_engine_exit_code", "Exit code of the engine (-1 while it runs; 128+N for signal N).", registry=r
        )
        self.engine_exit_code.set(-1)
        self.engine_up = Gauge("infera_agent_engine_up", "1 while the engine is healthy and serving.", registry=r)
        self.health_changes = Counter(
            "infera_agent_engine_health_changes", "The worker registered unhealthy (its engine failed "
            "--health-check-failures probes in a row) or healthy again.", ["to"], registry=r,
        )
        self.canaries = Counter(
            "infera_agent_engine_canaries", "One-token completions sent to test the engine (the stall check), by "
            "outcome (answered|progress|refused|failed|silent; silent: stalled) and reason (stalled: it held requests "
            "and counted no token for a whole health round; suspect: an earlier one went unanswered; idle: it held "
            "nothing for --engine-idle-canary-after seconds).",
            ["outcome", "reason"], registry=r,
        )
        self.kv_batches = Counter(
            "infera_agent_kv_batches_relayed", "Engine KV event batches relayed to JetStream, by DP rank.",
            ["dp_rank"], registry=r,
        )
        self.kv_gaps = Counter(
            "infera_agent_kv_gaps", "KV event sequence gaps, by outcome (detected|filled|unrecoverable).",
            ["outcome"], registry=r,
        )
        self.kv_lost_batches = Counter(
            "infera_agent_kv_lost_batches", "KV event batches missed and not recovered by replay.", registry=r
        )
        self.kv_publish_failures = Counter(
            "infera_agent_kv_publish_failures", "KV relays that JetStream did not acknowledge.", registry=r
        )
        self.kv_malformed = Counter(
            "infera_agent_kv_malformed",
            "KV event input dropped as malformed, by kind: zmq (not [topic, 8-byte seq, batch]), batch (not an "
            "engine batch: relayed empty), event (one bad event; the rest of its batch is relayed).",
            ["kind"], registry=r,
        )
        self.kv_blocks = Counter(
            "infera_agent_kv_blocks",
            "Index blocks in the relayed changes, by where they ended: held (stored) or not (removed).", ["op"],
            registry=r,
        )
        self.kv_orphaned = Counter(
            "infera_agent_kv_orphaned_blocks",
            "Stored blocks dropped because their parent block was never stored (events lost before the relay).",
            registry=r,
        )
        self.kv_unknown_removed = Counter(
            "infera_agent_kv_unknown_removed", "Removed engine block hashes that were never stored (ignored).",
            registry=r,
        )
