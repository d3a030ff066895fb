"""The router's NATS adapter: discovery watch, route RPC (``routing.py``), releases, load reports,
lease expiry.

All decisions are ``RouterCore``'s; this module decodes, publishes, replies and counts.
A route request is handled in the subscription's callback up to the JetStream publish of its
envelope (decision and lease first); the broker's acknowledgement then continues it in a callback
of ``AckedPublisher`` (reply, or the next candidate). No task per request, and no JetStream round
trip holds up the next request.
"""

from __future__ import annotations

import asyncio
import time
from typing import TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from infera_common.answering import ping_answerer
from infera_common.discovery_select import FleetWatcher, discovery_for
from infera_common.fleet import Change
from infera_common.requester_clocks import RequesterClocks
from infera_common.kv_index.stream import request_resync
from infera_common.logs import get_logger
from infera_common.nats_conn import (
    Reconnects, close_connection, connect, flush_all, nats_log_fields, unsubscribe_quietly, RepeatedErrors,
)
from infera_common.schemas import LoadReport, Prefilled, Release, WorkerRecord, WorkerStatus, decode
from infera_common.subjects import (
    LOAD_SUBJECTS,
    ROUTER_QUEUE,
    ROUTER_PING,
    ROUTER_ROUTE,
    router_prefilled_subject,
    router_release_subject,
    router_route_subject,
)
from infera_common.tasks import stop_tasks

from infera_router.breaker import CircuitBreaker, Transition
from infera_router.core import RouterCore
from infera_router.dispatch import Dispatcher, HttpDispatcher, JetStreamDispatcher
from infera_router.kv_client import KvClient
from infera_router.kv_local import LocalKvIndex
from infera_router.leases import Lease
from infera_router.metrics import RouterMetrics
from infera_router.off_bus import OffBusWatch
from infera_router.queue_reaper import QueueReaper
from infera_router.pd_flow import PdFlow
from infera_router.planes import plane_mismatches
from infera_router.pd_pairs import PdPairs
from infera_router.routing import RoutePath
from infera_router.policies import create_policy
from infera_router.sessions import SessionTable
from infera_router.settings import RouterSettings

log = get_logger("router")

#: a refused route (no worker, model unknown, ...) is logged once per status per this many seconds
REFUSALS_LOG_EVERY = 10.0
T = TypeVar("T")

#: How long start() tries to reach NATS before giving up with a clear error.
NATS_CONNECT_TIMEOUT = 10.0
#: How long start() waits for discovery's initial snapshot before serving anyway.
DISCOVERY_READY_TIMEOUT = 10.0


class RouterService(RoutePath):
    def __init__(self, settings: RouterSettings, metrics: RouterMetrics | None = None, nc: NATS | None = None) -> None:
        """``nc``: an already connected client (e.g. ``python -m infera.server``'s in-process bus) that the
        router uses and does not close; by default it connects to ``--nats-url`` itself."""
        self.settings = settings
        self.router_id = settings.resolved_router_id()
        self.release_subject = router_release_subject(self.router_id)
        self.metrics = metrics or RouterMetrics()
        policy = create_policy(settings.router_policy, settings.kv_overlap_weight, settings.kv_decode_weight,
                               settings.kv_evict_weight)
        self.discovery = discovery_for(settings)
        self.core = RouterCore(policy, self.router_id, settings.lease_max_age,
                               SessionTable(settings.session_affinity, settings.session_affinity_ttl_seconds),
                               CircuitBreaker(settings.breaker_failure_threshold, settings.breaker_cooldown_s,
                                              settings.breaker_max_cooldown_s),
                               discovery_backend=settings.discovery_backend, discovery=self.discovery.describe(),
                               request_transport=settings.request_transport)
        self.pairs = PdPairs(settings.pd_prefill_guard_release)
        self._pd: PdFlow | None = None
        self._kv: KvClient | LocalKvIndex | None = None
        # --kv-index local: fed by discovery from the first record on, by the stream once started
        self._local_kv = (LocalKvIndex(self.metrics) if settings.kv_index == "local" and self._needs_kv()
                          else None)
        self._route_tasks: set[asyncio.Task] = set()
        self._refusals = RepeatedErrors(REFUSALS_LOG_EVERY)  # route_refused lines, per status
        self.nc: NATS | None = nc
        self._own_nc = nc is None
        self._watcher: FleetWatcher | None = None
        self._reconnects = Reconnects()  # what to restore when the broker comes back (it may have restarted)
        self._listed_or_told: set[str] = set()  # workers discovery listed once, or already warned about
        self._subs: list[Subscription] = []
        self._route_subs: list[Subscription] = []  # the queue group's, this router's own, the ping
        self._dispatcher: Dispatcher | None = None
        self._sweeper: asyncio.Task | None = None
        self._off_bus: OffBusWatch | None = None
        self._reaper: QueueReaper | None = None
        self._clocks: RequesterClocks | None = None  # the frontends' clock offsets (route deadlines)

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self.nc is None:
            self.nc = await connect(self.settings.nats_url, f"infera-router-{self.router_id}", NATS_CONNECT_TIMEOUT,
                                    self._reconnects, planes_need_it=bool(self.settings.nats_uses()))
        js = self.nc.jetstream() if self.settings.discovery_backend == "nats" else None  # etcd needs no JetStream
        self.discovery = discovery_for(self.settings, js)
        log.info("discovery", router_id=self.router_id, **nats_log_fields(self.settings.nats_url, self._own_nc),
                 **self.discovery.log_fields())
        self._watcher = self.discovery.watcher(on_change=self._on_change)
        try:
            await self._watcher.start()
        except ConnectionError as exc:  # etcd unreachable
            raise ConnectionError(self.discovery.start_failed(exc, self.settings.nats_url)) from exc
        self._reconnects.add("discovery", self._watcher.restore)
        try:
            await asyncio.wait_for(self._watcher.ready.wait(), DISCOVERY_READY_TIMEOUT)
        except TimeoutError:
            log.warning("discovery_snapshot_slow", waited=DISCOVERY_READY_TIMEOUT)
        self._clocks = RequesterClocks(self.nc, self._spawn, self.metrics.requester_clock_offset.set)
        self._dispatcher = self._make_dispatcher()
        await self._dispatcher.start()
        if self._local_kv is not None:  # its history applied before the first request is routed
            await self._local_kv.start(self.nc.jetstream(), lambda: request_resync(self.nc, f"router {self.router_id}"))
            self._reconnects.add("kv_event_stream", self._local_kv.restore)
            self._kv = self._local_kv
        else:
            self._kv = KvClient(self.nc, self.settings.kv_query_timeout, self.metrics)
        self._pd = PdFlow(self.nc, self.router_id, self.core, self.pairs, self._dispatcher, self.metrics,
                          self.settings.publish_timeout, self._lease_gauge, self._clocks.offset_for)
        await self._pd.start()
        self._subs.append(await self.nc.subscribe(self.release_subject, cb=self._on_release))
        self._subs.append(await self.nc.subscribe(router_prefilled_subject(self.router_id), cb=self._on_prefilled))
        self._subs.append(await self.nc.subscribe(LOAD_SUBJECTS, cb=self._on_load))
        self._route_subs = [
            await self.nc.subscribe(ROUTER_PING, cb=ping_answerer(self.router_id)),
            await self.nc.subscribe(router_route_subject(self.router_id), cb=self._on_route),
            await self.nc.subscribe(ROUTER_ROUTE, queue=ROUTER_QUEUE, cb=self._on_route),
        ]
        await flush_all(self.nc)  # the broker knows the subscriptions before we say we serve
        self._sweeper = asyncio.create_task(self._sweep(), name="lease-sweeper")
        self._off_bus = OffBusWatch(self.nc, self.core, self.metrics)
        self._off_bus.start()
        if self.settings.request_transport == "nats":
            self._reaper = QueueReaper(self.nc, lambda wid: self.core.fleet.get(wid) is not None,
                                       self.metrics.queues_deleted.inc)
            self._reconnects.listen(self._reaper.reconnected)
        log.info(
            "router_serving", router_id=self.router_id, policy=self.settings.router_policy,
            kv_index=("local" if self._local_kv is not None else "remote") if self._needs_kv() else None,
            workers=len(self.core.fleet), lease_max_age=self.settings.lease_max_age,
        )

    async def stop(self) -> None:
        """Stop taking requests, answer the ones in hand, then close."""
        for sub in self._route_subs:
            try:
                await sub.drain()
            except Exception as exc:  # connection already gone
                log.info("route_drain_skipped", error=str(exc))
        self._route_subs = []
        if self._route_tasks:  # requests waiting for the kv-indexer or a PD leg: let them reach their reply
            await asyncio.gather(*list(self._route_tasks), return_exceptions=True)
        if self._pd is not None:
            await self._pd.stop()
        if self._dispatcher is not None:  # answer the requests whose envelope awaits its ack
            await self._dispatcher.wait_idle(self.settings.publish_timeout + 1.0)
            await self._dispatcher.stop()
            self._dispatcher = None
        if self._local_kv is not None:
            await self._local_kv.stop()
        sweeper, self._sweeper = self._sweeper, None
        if self._off_bus is not None:
            await self._off_bus.stop()
            self._off_bus = None
        if self._reaper is not None:
            await self._reaper.stop()
            self._reaper = None
        await stop_tasks(sweeper)
        if self._watcher is not None:
            await self._watcher.stop()
            self._watcher = None
        for sub in self._subs:
            await unsubscribe_quietly(sub)
        self._subs.clear()
        await self._reconnects.close()
        if self.nc is not None and self._own_nc:
            await close_connection(self.nc)
            self.nc = None
        log.info("router_stopped", router_id=self.router_id, leases_held=len(self.core.leases))

    def _needs_kv(self) -> bool:
        return bool(getattr(self.core.policy, "needs_kv", False))

    def _make_dispatcher(self) -> Dispatcher:
        if self.settings.request_transport == "http":
            def record_of(worker_id: str):
                state = self.core.fleet.get(worker_id)
                return state.record if state is not None else None

            key = self.settings.engine_api_key
            assert self._clocks is not None
            return HttpDispatcher(self.nc, self.router_id, record_of, self.metrics, self.settings.drain_timeout,
                                  key.get_secret_value() if key is not None else None, self._clocks)
        return JetStreamDispatcher(self.nc)

    # --- discovery -------------------------------------------------------------------------
    def _on_change(self, change: Change) -> None:
        record = change.record
        if self._local_kv is not None:
            self._local_kv.on_change(change)
        self._listed_or_told.add(record.worker_id)  # a leaving worker's trailing load reports are no mix
        old = self.core.fleet.get(record.worker_id)
        before = (old.model, old.record.status) if old is not None else None
        if dropped := self.core.apply_change(change, time.monotonic()):  # back from another start
            self._spawn(self._worker_gone(record.worker_id, dropped))
        if change.kind == "leave":
            self.metrics.forget_worker(record.worker_id)
            if self._dispatcher is not None:
                self._spawn(self._dispatcher.worker_left(record.worker_id, []))
            if self._reaper is not None and record.request_transport == "nats":
                self._reaper.left(record.worker_id, record.ttl)
            kept = self.core.leases.count(record.worker_id)
            log.info("worker_left", worker_id=record.worker_id, model=record.model, leases_kept=kept,
                     **({"kept_for_s": self.core.leave_grace(record)} if kept else {}))
        elif before == (record.model, record.status):
            return  # a heartbeat
        else:
            log.info("worker_" + change.kind, worker_id=record.worker_id, model=record.model,
                     status=record.status.value, engine=record.engine, role=record.role.value)
            if record.status == WorkerStatus.UNHEALTHY and self._dispatcher is not None:
                handed = self._dispatcher.worker_unhealthy(record.worker_id)
                if handed:  # this router's own engine calls (--request-transport http)
                    log.warning("unhealthy_worker_calls_stopped", worker_id=record.worker_id,
                                requests_handed_back=handed)
            if before is None:
                self._check_planes(record)
        for model in {record.model, before[0] if before else None} - {None}:
            self.metrics.set_live(model, self.core.fleet.status_counts(model))

    def _check_planes(self, record: WorkerRecord) -> None:
        """Say once, when a worker joins, which of its planes this router cannot work with."""
        for problem in plane_mismatches(record, self.settings):
            self.metrics.plane_mismatches.labels(problem.flag).inc()
            log.warning("worker_plane_mismatch", worker_id=record.worker_id, model=record.model, flag=problem.flag,
                        worker_value=problem.worker, router_value=problem.ours, effect=problem.effect,
                        hint=f"give every service the same {problem.flag}")
        if (record.engine_api_key and record.request_transport == "http" == self.settings.request_transport
                and self.settings.engine_api_key is None):
            log.warning("worker_engine_key_missing", worker_id=record.worker_id, model=record.model,
                        effect="its engine refuses every request this router sends it (401)",
                        hint="its engine was started with --api-key: give this router (or infera.server) the same "
                             "key as --engine-api-key (env INFERA_ENGINE_API_KEY)")

    # --- load reports and releases ---------------------------------------------------------
    def _decoded(self, schema: type[T], msg: Msg, kind: str) -> T | None:
        """The message as ``schema``, or None (counted under ``kind`` and logged): never raises."""
        try:
            return decode(schema, msg.data)
        except ValueError as exc:
            self.metrics.bad_messages.labels(kind).inc()
            log.warning("bad_message", kind=kind, subject=msg.subject, error=str(exc)[:500])
            return None

    async def _on_load(self, msg: Msg) -> None:
        if (report := self._decoded(LoadReport, msg, "load")) is None:
            return
        accepted = self.core.apply_load(report, time.monotonic())
        (self.metrics.load_accepted if accepted else self.metrics.load_unknown).inc()
        if not accepted and self._watcher is not None and self._watcher.ready.is_set() \
                and report.worker_id not in self._listed_or_told:
            self._listed_or_told.add(report.worker_id)  # once per worker: it reports every second
            log.warning("worker_not_in_discovery", worker_id=report.worker_id, model=report.model,
                        worker_discovery_backend=report.discovery_backend, worker_etcd_endpoint=report.etcd_endpoint,
                        discovery=self.discovery.describe(),
                        hint="the worker reports load on NATS but is registered elsewhere: give every service "
                             "the same --discovery-backend (and --etcd-endpoint)")

    async def _on_release(self, msg: Msg) -> None:
        if (release := self._decoded(Release, msg, "release")) is None:
            return
        if self.pairs.is_leg(release.lease_id):
            self.metrics.release_outcomes[release.outcome].inc()
            if self._pd is not None:
                await self._pd.execute(self.pairs.released(release.lease_id, release.outcome))
            return
        lease = self.core.release(release.lease_id, release.outcome, time.monotonic(), release.unreachable)
        if lease is None:
            self.metrics.unknown_releases.inc()
            log.debug("release_unknown_lease", lease_id=release.lease_id, worker_id=release.worker_id)
            return
        self.metrics.release_outcomes[release.outcome].inc()
        self._lease_gauge(lease)

    async def _on_prefilled(self, msg: Msg) -> None:
        if (note := self._decoded(Prefilled, msg, "prefilled")) is None:
            return
        if self.core.prefilled(note.lease_id) is not None:
            self.metrics.prefilled.inc()

    async def _sweep(self) -> None:
        interval = max(0.05, min(1.0, self.settings.lease_max_age / 10))  # also a leaving worker's grace
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            self.core.sessions.table.expire(now)
            if self._local_kv is not None:
                self._local_kv.expire()
            self.metrics.set_session_stats(self.core.sessions.table.stats())
            self._breaker_metrics()
            for worker_id, state in self.core.breaker.snapshot(now).items():  # open -> half_open with time
                self.metrics.set_breaker_state(worker_id, state.state.value)
            for worker_id, gone in self.core.departures(now):
                self._spawn(self._worker_gone(worker_id, gone))
            dropped = self.core.expire(now)
            if not dropped:
                continue
            self.metrics.leases_dropped.labels("max_age").inc(len(dropped))
            for lease in dropped:
                self._lease_gauge(lease)
                if self.pairs.is_leg(lease.lease_id) and self._pd is not None:  # stop and free its partner
                    await self._pd.execute(self.pairs.released(lease.lease_id, "expired"))
            log.warning(
                "leases_expired", count=len(dropped), max_age=self.settings.lease_max_age,
                workers=sorted({lease.worker_id for lease in dropped}),
            )

    async def _worker_gone(self, worker_id: str, dropped: list[Lease]) -> None:
        """A worker stayed out of discovery past its grace: its leases are dropped, their requesters
        told (NATS request plane), their PD pairs failed."""
        self.metrics.leases_dropped.labels("worker_left").inc(len(dropped))
        log.warning("worker_gone", worker_id=worker_id, leases_dropped=len(dropped))
        actions = self.pairs.worker_left(worker_id, [lease.lease_id for lease in dropped])
        try:
            if self._dispatcher is not None:
                await self._dispatcher.worker_left(worker_id, dropped)
            if actions and self._pd is not None:
                await self._pd.execute(actions)
        except Exception:  # (a spawned task: nothing else would say it failed)
            log.exception("worker_gone_failed", worker_id=worker_id)

    def _lease_gauge(self, lease: Lease) -> None:
        worker = self.core.fleet.get(lease.worker_id)
        if worker is not None:
            self.metrics.set_leases(worker.worker_id, worker.in_flight)
        self._breaker_metrics()

    def _breaker_metrics(self) -> None:
        """Export what the breakers did since the last call (trips, state changes, routing anyway)."""
        core = self.core
        for worker_id, change in core.transitions:
            if change != Transition.CLOSED:
                self.metrics.breaker_trips.labels(worker_id).inc()
                log.warning("breaker_opened", worker_id=worker_id, transition=change.value)
            else:
                log.info("breaker_closed", worker_id=worker_id)
            self.metrics.set_breaker_state(worker_id, core.breaker.state(worker_id, time.monotonic()).value)
        core.transitions.clear()
