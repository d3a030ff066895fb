"""The kv-indexer service: discovery watch, KV event intake, overlap query responder.

KV events come in two ways, chosen per worker by its record's ``kv_event_transport``:

- ``nats`` (this indexer on ``--kv-event-transport nats``): the JetStream stream the worker-agents
  relay into, replayed from its start (``stream.StreamFollower``);
- ``zmq``: the engine's own ZMQ publishers, one per DP rank, read directly with a replay from
  seq 0 when the worker is first followed (``zmq_follow.ZmqFollower``). Followed on either setting.

On ``--kv-event-transport zmq`` the indexer does not touch JetStream at all (no stream, no
consumer); with ``--discovery-backend etcd`` it then needs of NATS only request/reply, so a caller
may hand it any connected NATS-like client (``nc``: ``subscribe(subject, queue=, cb=)`` and
``flush()``; ``jetstream()`` only for the NATS discovery backend or the stream). A client passed
in is neither connected nor closed here.

Start-up order: discovery snapshot first (so replayed events attach to their model at once), then
the replays (the stream's history; each followed worker's first ZMQ replay), and only then the
query responder: a restarted indexer answers from a rebuilt index; while it replays, other replicas
of the queue group answer.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

from nats.aio.msg import Msg

from infera_common.answering import ping_answerer
from infera_common.discovery_select import FleetWatcher, discovery_for
from infera_common.fleet import Change
from infera_common.logs import get_logger
from infera_common.nats_conn import (
    Reconnects, close_connection, connect, flush_all, nats_log_fields, unsubscribe_quietly,
)
from infera_common.subjects import KV_INDEXER_QUEUE, KV_PING, KV_QUERY, kv_query_subject
from infera_common.tasks import stop_tasks
from infera_common.tracing import HEADER as TRACE_HEADER
from infera_common.tracing import SpanKind, finish, start_span

from infera_common.kv_index.index import KvIndex
from infera_common.kv_index.ingest import Ingested, ingest, ingest_batch
from infera_kv_indexer.metrics import KvIndexerMetrics
from infera_kv_indexer.query import EMPTY_REPLY, decode_query, held_sections, reply_for
from infera_kv_indexer.settings import KvIndexerSettings
from infera_common.kv_index.stream import StreamFollower, request_resync
from infera_common.kv_translate import load_translator
from infera_kv_indexer.zmq_follow import ZmqFollower

log = get_logger("kv_indexer")

#: How long start() tries to reach NATS before giving up with a clear error.
NATS_CONNECT_TIMEOUT = 10.0
#: How long start() waits for discovery's initial snapshot before replaying anyway.
DISCOVERY_READY_TIMEOUT = 10.0
#: How often housekeeping runs (unattached workers; the ingest path's counters and block gauges).
TICK = 1.0


class KvIndexerService:
    def __init__(self, settings: KvIndexerSettings, metrics: KvIndexerMetrics | None = None,
                 nc: Any | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or KvIndexerMetrics()
        self.index = KvIndex()
        self._holdings = held_sections(self.index, time.monotonic)  # each worker's holding, reused a moment
        self.nc: Any | None = nc
        self._owns_nc = nc is None
        self._watcher: FleetWatcher | None = None
        self._stream: StreamFollower | None = None
        self._reconnects = Reconnects()  # what to restore when the broker comes back (it may have restarted)
        self._zmq = ZmqFollower(self._apply_zmq, self._clear, self.metrics, settings.kv_replay_timeout,
                                restore=self._restore_state)
        self._query_subs: list[Any] = []  # the ping, this indexer's own query subject, the queue group's
        self.indexer_id = f"kvi-{uuid.uuid4().hex[:12]}"  # answers the routers' ping (``answering``)
        self._housekeeper: asyncio.Task | None = None
        self._mismatch_warned: set[str] = set()
        # workers whose blocks changed since the last tick: when their latest message was relayed
        self._changed: dict[str, float] = {}
        self._query_ok = self.metrics.queries.labels("ok")
        self._query_malformed = self.metrics.queries.labels("malformed")

    @property
    def messages(self) -> int:
        """Stream messages handled (``--kv-event-transport nats``)."""
        return self._stream.messages if self._stream is not None else 0

    @property
    def uses_stream(self) -> bool:
        return self.settings.kv_event_transport == "nats"

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        if self.nc is None:
            self.nc = await connect(s.nats_url, "infera-kv-indexer", NATS_CONNECT_TIMEOUT, self._reconnects,
                                    planes_need_it=bool(s.nats_uses()))
        js = self.nc.jetstream() if self.uses_stream or s.discovery_backend == "nats" else None
        if self.uses_stream:
            self._stream = StreamFollower(js, self._on_stream_message, self.metrics.replaying,
                                          resync=lambda: request_resync(self.nc, "kv-indexer"))
            await self._stream.prepare(s.kv_event_max_age, s.kv_event_max_bytes)
        discovery = discovery_for(s, js)
        log.info("discovery", **nats_log_fields(s.nats_url, self._owns_nc), kv_event_transport=s.kv_event_transport,
                 **discovery.log_fields())
        self._watcher = discovery.watcher(on_change=self._on_change)
        try:
            await self._watcher.start()
        except ConnectionError as exc:  # etcd unreachable
            raise ConnectionError(discovery.start_failed(exc, s.nats_url)) from exc
        self._reconnects.add("discovery", self._watcher.restore)
        try:
            await asyncio.wait_for(self._watcher.ready.wait(), DISCOVERY_READY_TIMEOUT)
        except TimeoutError:
            log.warning("discovery_snapshot_slow", waited=DISCOVERY_READY_TIMEOUT)
        self._housekeeper = asyncio.create_task(self._housekeeping(), name="kv-indexer-housekeeping")
        if self._stream is not None:
            await self._stream.replay()
            self._reconnects.add("kv_event_stream", self._stream.restore)
        t0 = time.monotonic()
        late = await self._zmq.wait_ready(s.kv_replay_timeout + TICK)
        if self._zmq.followed:
            log.info("zmq_replay_done", workers=len(self._zmq.followed), still_replaying=late,
                     seconds=round(time.monotonic() - t0, 3))
        self._query_subs = [
            await self.nc.subscribe(KV_PING, cb=ping_answerer(self.indexer_id)),
            await self.nc.subscribe(kv_query_subject(self.indexer_id), cb=self._on_query),
            await self.nc.subscribe(KV_QUERY, queue=KV_INDEXER_QUEUE, cb=self._on_query),
        ]
        if hasattr(self.nc, "flush"):
            await flush_all(self.nc)  # the broker knows the subscription before we say we serve
        seen, unseen, unattached = self.index.counts()
        log.info("kv_indexer_serving", subject=KV_QUERY, kv_event_transport=s.kv_event_transport,
                 workers_seen=seen, workers_unseen=unseen, workers_unattached=unattached,
                 zmq_workers=len(self._zmq.followed), max_age=s.kv_event_max_age if self.uses_stream else None)

    async def stop(self) -> None:
        subs, self._query_subs = self._query_subs, []
        for sub in subs:
            await unsubscribe_quietly(sub)
        if self._stream is not None:
            await self._stream.stop()
        if self._housekeeper is not None:
            housekeeper, self._housekeeper = self._housekeeper, None
            await stop_tasks(housekeeper)
            self._flush_metrics()
        if self._watcher is not None:
            await self._watcher.stop()
            self._watcher = None
        await self._zmq.close()
        await self._reconnects.close()
        if self.nc is not None and self._owns_nc:
            await close_connection(self.nc)
            self.nc = None
        log.info("kv_indexer_stopped", messages=self.messages)

    # --- discovery -------------------------------------------------------------------------
    def _on_change(self, change: Change) -> None:
        record = change.record
        if change.kind == "leave":
            self._zmq.on_leave(record.worker_id)
            self.index.worker_left(record.worker_id, time.time())
            self.metrics.forget_worker(record.worker_id)
            self._mismatch_warned.discard(record.worker_id)
            log.info("worker_left", worker_id=record.worker_id, model=record.model)
            return
        self.index.worker_joined(record.worker_id, record.model, record.kv_index_block_size, record.started_at)
        self._zmq.on_record(record)
        if (record.kv_event_transport == "nats" and not self.uses_stream
                and record.worker_id not in self._mismatch_warned):
            self._mismatch_warned.add(record.worker_id)
            log.warning("worker_kv_transport_mismatch", worker_id=record.worker_id, model=record.model,
                        worker_kv_event_transport="nats", indexer_kv_event_transport="zmq",
                        hint="this worker relays its KV events into JetStream, which an indexer on "
                             "--kv-event-transport zmq does not read: its cache stays unknown (unseen); "
                             "run every service with the same --kv-event-transport")

    # --- events ----------------------------------------------------------------------------
    def _on_stream_message(self, subject: str, data: bytes) -> None:
        now = time.time()
        try:
            result = ingest(self.index, subject, data, now)
            relay = result.relay
            if relay is not None and result.malformed is None:
                self.metrics.relay_message(relay.kind)
                stream = self._stream
                if stream is None or not stream.replaying:  # (a replayed message's age is the history's)
                    self.metrics.lag.observe(max(0.0, now - relay.ts - self._clock_offset(relay.worker_id)))
            self._record(result)
        except Exception:  # a bug must not stop the consumer
            self.metrics.malformed.labels("relay").inc()
            log.exception("event_failed", subject=subject)

    def _clock_offset(self, worker_id: str) -> float:
        """How far this clock reads ahead of the worker's, its heartbeats' transit included
        (``FleetView.clock_offset``): a relay's lag is then its delay beyond that, not the hosts'
        offset. 0 for a worker discovery has not shown (its relay is read on this clock)."""
        offset = self._watcher.view.clock_offset(worker_id) if self._watcher is not None else None
        return offset or 0.0

    def _apply_zmq(self, worker_id: str, dp_rank: int, seq: int, payload: bytes) -> Iterator[None]:
        """Apply one batch read from ZMQ; yields between slices of it (the reader lets the loop run then)."""
        try:
            result = yield from ingest_batch(self.index, worker_id, dp_rank, seq, payload, time.time())
            self._record(result)
        except Exception:  # a bug must not stop the reader
            self.metrics.malformed.labels("batch").inc()
            log.exception("event_failed", worker_id=worker_id, dp_rank=dp_rank, seq=seq)

    def _restore_state(self, worker_id: str, states: list[dict]) -> int:
        """The worker-agent's translator of each rank (its ``/kv_state``), before the engine's replay;
        how many ranks it restored (a malformed one is counted and skipped)."""
        restored = 0
        for state in states:
            try:
                rank, seq = int(state["dp_rank"]), int(state["seq"])
                translator = load_translator(state["translator"])
            except (KeyError, TypeError, ValueError) as exc:
                self.metrics.malformed.labels("state").inc()
                log.warning("malformed_state", worker_id=worker_id, error=str(exc)[:300])
                continue
            if self.index.restore_target(worker_id, rank, seq, translator, time.time()) is not None:
                restored += 1
        self.metrics.set_blocks(worker_id, self.index.worker_blocks(worker_id))
        return restored

    def _clear(self, worker_id: str, dp_rank: int | None, reason: str) -> None:
        """The worker's engine restarted with an empty cache: forget its blocks (and seqs)."""
        self.index.clear(worker_id, dp_rank, time.time())
        self.metrics.set_blocks(worker_id, self.index.worker_blocks(worker_id))
        log.info("worker_cleared", worker_id=worker_id, dp_rank=dp_rank, reason=reason)

    def _record(self, result: Ingested) -> None:
        m = self.metrics
        if result.malformed is not None:
            m.malformed.labels(result.malformed).inc()
            log.warning("malformed_" + result.malformed, error=result.error,
                        worker_id=result.relay.worker_id if result.relay else None)
            return
        relay = result.relay
        assert relay is not None
        out = result.outcome
        if out is not None:
            if out.duplicate:
                m.duplicates.inc()
                return
            for name, n in out.applied.items():
                m.event_applied(name, n)
            m.blocks_applied(out.stored, out.removed)
            if out.malformed:
                m.malformed.labels("event").inc(out.malformed)
            if out.gap:
                m.gaps.inc(out.gap)
                log.warning("seq_gap", worker_id=relay.worker_id, dp_rank=out.target[1], missing=out.gap, seq=relay.seq)
            if out.unknown_removed:
                m.unknown_removed.inc(out.unknown_removed)
            if out.orphaned:
                m.orphaned.inc(out.orphaned)
        else:
            log.info("worker_cleared", worker_id=relay.worker_id, dp_rank=relay.dp_rank)
        self._changed[relay.worker_id] = relay.ts  # its gauges: set on the next tick

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            for worker_id in self.index.expire_unattached(time.time(), self.settings.unattached_grace):
                self.metrics.forget_worker(worker_id)
                log.info("unattached_worker_dropped", worker_id=worker_id, grace=self.settings.unattached_grace,
                         hint="KV events of a worker this indexer's discovery does not list: if it is running, "
                              "it is registered with another --discovery-backend or --etcd-endpoint")
            self._flush_metrics()

    def _flush_metrics(self) -> None:
        """The ingest path's deferred metrics: counters, each changed worker's block gauge, the worker counts."""
        self.metrics.flush()
        changed, self._changed = self._changed, {}
        for worker_id, relayed in changed.items():
            if self.index.is_seen(worker_id):  # (not a worker that left since)
                self.metrics.set_blocks(worker_id, self.index.worker_blocks(worker_id), relayed)
        self.metrics.set_workers(*self.index.counts())

    # --- queries ---------------------------------------------------------------------------
    async def _on_query(self, msg: Msg) -> None:
        t0 = time.perf_counter()
        parent = msg.headers.get(TRACE_HEADER) if msg.headers else None
        span = start_span("kv overlap query", parent, SpanKind.SERVER) if parent else None  # in the router's trace
        outcome = "ok"
        try:
            model, hashes, workers = decode_query(msg.data)
        except ValueError as exc:
            self._query_malformed.inc()
            log.warning("malformed_query", error=str(exc)[:300])
            reply, outcome = EMPTY_REPLY, "malformed"
        else:
            try:  # query.answer's work, with a malformed query told apart from a failure
                reply, overlaps, unseen = reply_for(self.index, model, hashes, workers, self._holdings)
                self._query_ok.inc()
                if span is not None:
                    span.set_attributes({"infera.model": model, "infera.kv.workers_matched": len(overlaps),
                                         "infera.kv.max_blocks": max((b for _, _, b in overlaps), default=0),
                                         "infera.kv.workers_unseen": len(unseen)})
            except Exception:  # a bug: answer "nothing known" rather than let the router wait
                self.metrics.queries.labels("failed").inc()
                log.exception("query_failed", model=model)
                reply, outcome = EMPTY_REPLY, "failed"
        if msg.reply:
            try:
                await msg.respond(reply)
            except Exception as exc:  # requester or connection gone
                log.warning("query_reply_failed", error=str(exc))
        self.metrics.query_seconds.observe(time.perf_counter() - t0)
        if span is not None:
            span.set_attribute("infera.outcome", outcome)
            finish(span, error=None if outcome == "ok" else outcome)
