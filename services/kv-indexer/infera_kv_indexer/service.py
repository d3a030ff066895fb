"""The kv-indexer's NATS adapter: discovery watch, KV event stream consumer, overlap query responder.

Start-up order: the discovery snapshot first (so replayed events attach to their model at once),
then an ordered consumer over the whole KV event stream (DeliverPolicy.ALL), then, once the
history present at start has been applied, the query responder. A restarted indexer therefore
answers only from a rebuilt index; while it replays, other replicas of the queue group answer.

Why an ordered (ephemeral) consumer and not a durable one: the index lives in memory, so every
start has to rebuild it from the stream's whole history anyway; a durable consumer would remember
a position the new process has no use for, and would need acks for nothing.
"""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import DeliverPolicy

from infera_common.discovery_select import FleetWatcher, discovery_for
from infera_common.fleet import Change
from infera_common.logs import get_logger
from infera_common.nats_conn import close_connection, connect, ensure_kv_event_stream, unsubscribe_quietly
from infera_common.subjects import KV_EVENT_STREAM, KV_EVENT_SUBJECTS, KV_INDEXER_QUEUE, KV_QUERY

from infera_kv_indexer.index import KvIndex
from infera_kv_indexer.ingest import Ingested, ingest
from infera_kv_indexer.metrics import KvIndexerMetrics
from infera_kv_indexer.query import EMPTY_REPLY, decode_query, encode_reply
from infera_kv_indexer.settings import KvIndexerSettings

log = get_logger("kv_indexer")

#: How long start() tries to reach NATS before giving up with a clear error.
NATS_CONNECT_TIMEOUT = 10.0
#: How long start() waits for discovery's initial snapshot before replaying anyway.
DISCOVERY_READY_TIMEOUT = 10.0
#: How often housekeeping runs (unattached workers, worker gauges) and replay progress is checked.
TICK = 1.0


class KvIndexerService:
    def __init__(self, settings: KvIndexerSettings, metrics: KvIndexerMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or KvIndexerMetrics()
        self.index = KvIndex()
        self.nc: NATS | None = None
        self._js = None
        self._watcher: FleetWatcher | None = None
        self._events_sub: Subscription | None = None
        self._query_sub: Subscription | None = None
        self._housekeeper: asyncio.Task | None = None
        self._replay_until = 0  # stream sequence of the last message present at start
        self._applied_seq = 0  # stream sequence of the last message applied
        self._caught_up = asyncio.Event()
        self.messages = 0
        self._query_ok = self.metrics.queries.labels("ok")
        self._query_malformed = self.metrics.queries.labels("malformed")

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self.nc = await connect(self.settings.nats_url, "infera-kv-indexer", NATS_CONNECT_TIMEOUT)
        self._js = js = self.nc.jetstream()
        await ensure_kv_event_stream(js, self.settings.kv_event_max_age, self.settings.kv_event_max_bytes)
        discovery = discovery_for(self.settings, js)
        log.info("discovery", nats_url=self.settings.nats_url, **discovery.log_fields())
        self._watcher = discovery.watcher(on_change=self._on_change)
        try:
            await self._watcher.start()
        except ConnectionError as exc:  # etcd unreachable
            raise ConnectionError(discovery.start_failed(exc, self.settings.nats_url)) from exc
        try:
            await asyncio.wait_for(self._watcher.ready.wait(), DISCOVERY_READY_TIMEOUT)
        except TimeoutError:
            log.warning("discovery_snapshot_slow", waited=DISCOVERY_READY_TIMEOUT)
        t0 = time.monotonic()
        state = (await js.stream_info(KV_EVENT_STREAM)).state
        self._replay_until = state.last_seq if state.messages else 0
        self.metrics.replaying.set(1)
        if not self._replay_until:
            self._caught_up.set()
        self._events_sub = await js.subscribe(
            KV_EVENT_SUBJECTS, stream=KV_EVENT_STREAM, cb=self._on_event,
            ordered_consumer=True, deliver_policy=DeliverPolicy.ALL,
        )
        self._housekeeper = asyncio.create_task(self._housekeeping(), name="kv-indexer-housekeeping")
        log.info("replay_started", stream=KV_EVENT_STREAM, messages=state.messages, last_seq=state.last_seq)
        while not self._caught_up.is_set():
            try:
                await asyncio.wait_for(self._caught_up.wait(), TICK)
            except TimeoutError:
                await self._check_replay_end()
        self.metrics.replaying.set(0)
        log.info("replay_done", messages=self.messages, seconds=round(time.monotonic() - t0, 3))
        self._query_sub = await self.nc.subscribe(KV_QUERY, queue=KV_INDEXER_QUEUE, cb=self._on_query)
        await self.nc.flush()  # the broker knows the subscription before we say we serve
        seen, unseen, unattached = self.index.counts()
        log.info("kv_indexer_serving", subject=KV_QUERY, workers_seen=seen, workers_unseen=unseen,
                 workers_unattached=unattached, max_age=self.settings.kv_event_max_age)

    async def _check_replay_end(self) -> None:
        """The history present at start may have aged out under us: nothing left to wait for."""
        assert self._js is not None
        state = (await self._js.stream_info(KV_EVENT_STREAM)).state
        if not state.messages or state.first_seq > self._replay_until:
            self._caught_up.set()
        else:
            log.info("replaying", applied_seq=self._applied_seq, until=self._replay_until)

    async def stop(self) -> None:
        for sub in (self._query_sub, self._events_sub):
            if sub is not None:
                await unsubscribe_quietly(sub)
        self._query_sub = self._events_sub = None
        if self._housekeeper is not None:
            self._housekeeper.cancel()
            await asyncio.gather(self._housekeeper, return_exceptions=True)
            self._housekeeper = None
        if self._watcher is not None:
            await self._watcher.stop()
            self._watcher = None
        if self.nc is not None:
            await close_connection(self.nc)
            self.nc = None
        log.info("kv_indexer_stopped", messages=self.messages)

    # --- discovery -------------------------------------------------------------------------
    def _on_change(self, change: Change) -> None:
        record = change.record
        if change.kind == "leave":
            self.index.worker_left(record.worker_id)
            self.metrics.forget_worker(record.worker_id)
            log.info("worker_left", worker_id=record.worker_id, model=record.model)
        else:
            self.index.worker_joined(record.worker_id, record.model)

    # --- events ----------------------------------------------------------------------------
    async def _on_event(self, msg: Msg) -> None:
        now = time.time()
        try:
            self._record(ingest(self.index, msg.subject, msg.data, now), now)
        except Exception:  # a bug must not stop the consumer
            self.metrics.malformed.labels("relay").inc()
            log.exception("event_failed", subject=msg.subject)
        self.messages += 1
        if not self._caught_up.is_set():
            try:
                self._applied_seq = msg.metadata.sequence.stream
            except Exception:  # not a JetStream message
                return
            if self._applied_seq >= self._replay_until:
                self._caught_up.set()

    def _record(self, result: Ingested, now: float) -> None:
        m = self.metrics
        if result.malformed is not None:
            m.malformed.labels(result.malformed).inc()
            log.warning("malformed_" + result.malformed, error=result.error,
                        worker_id=result.relay.worker_id if result.relay else None)
            return
        relay = result.relay
        assert relay is not None
        m.relay_message(relay.kind)
        m.lag.observe(max(0.0, now - relay.ts))
        out = result.outcome
        if out is not None:
            if out.duplicate:
                m.duplicates.inc()
                return
            for name, n in out.applied.items():
                m.event_applied(name, n)
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
        if self.index.is_seen(relay.worker_id):
            m.set_blocks(relay.worker_id, self.index.worker_blocks(relay.worker_id))

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            for worker_id in self.index.expire_unattached(time.time(), self.settings.unattached_grace):
                self.metrics.forget_worker(worker_id)
                log.info("unattached_worker_dropped", worker_id=worker_id, grace=self.settings.unattached_grace,
                         hint="KV events of a worker this indexer's discovery does not list: if it is running, "
                              "it is registered with another --discovery-backend or --etcd-endpoint")
            self.metrics.set_workers(*self.index.counts())

    # --- queries ---------------------------------------------------------------------------
    async def _on_query(self, msg: Msg) -> None:
        t0 = time.perf_counter()
        try:
            model, hashes, workers = decode_query(msg.data)
        except ValueError as exc:
            self._query_malformed.inc()
            log.warning("malformed_query", error=str(exc)[:300])
            reply = EMPTY_REPLY
        else:
            try:  # query.answer's work, with a malformed query told apart from a failure
                reply = encode_reply(*self.index.depths(model, hashes, workers))
                self._query_ok.inc()
            except Exception:  # a bug: answer "nothing known" rather than let the router wait
                self.metrics.queries.labels("failed").inc()
                log.exception("query_failed", model=model)
                reply = EMPTY_REPLY
        if msg.reply:
            try:
                await msg.respond(reply)
            except Exception as exc:  # requester or connection gone
                log.warning("query_reply_failed", error=str(exc))
        self.metrics.query_seconds.observe(time.perf_counter() - t0)
