"""The router's NATS adapter: discovery watch, route RPC, releases, load reports, lease expiry.

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

from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from infera_common.discovery_select import FleetWatcher, discovery_for
from infera_common.fleet import Change
from infera_common.logs import get_logger
from infera_common.nats_conn import close_connection, connect, unsubscribe_quietly
from infera_common.schemas import LoadReport, Prefilled, Release, RouteReply, RouteRequest, WorkEnvelope, decode, encode
from infera_common.subjects import (
    LOAD_SUBJECTS,
    ROUTER_QUEUE,
    ROUTER_ROUTE,
    request_stream,
    router_prefilled_subject,
    router_release_subject,
    work_subject,
)

from infera_router.breaker import CircuitBreaker, Transition
from infera_router.core import Plan, RouterCore
from infera_router.dp_pin import pin_bytes, rank_headers
from infera_router.jetstream import AckedPublisher, PubResult
from infera_router.kv_client import KvClient
from infera_router.kv_view import KvView
from infera_router.leases import Lease
from infera_router.metrics import RouterMetrics
from infera_router.pd_flow import PdFlow
from infera_router.pd_pairs import PdPairs
from infera_router.policies import create_policy
from infera_router.policy_kv_aware import WorkerCost
from infera_router.sessions import SessionIdError, SessionTable
from infera_router.settings import RouterSettings
from infera_router.state import WorkerState

log = get_logger("router")
T = TypeVar("T")

#: How long start() tries to reach NATS before giving up with a clear error.
NATS_CONNECT_TIMEOUT = 10.0
#: How long start() waits for discovery's initial snapshot before serving anyway.
DISCOVERY_READY_TIMEOUT = 10.0


@dataclass(slots=True)
class Routing:
    """One route request between the publish of its envelope and its reply."""

    request: RouteRequest
    reply_to: str  # the requester's reply subject ('' when it expects none)
    order: list[WorkerState]  # candidates, most preferred first
    t0: float  # perf_counter at arrival
    tried: int = 0
    plan: Plan | None = None
    costs: list[WorkerCost] | None = None  # the kv-aware breakdown, in ``order``'s order
    hashes: dict[int, list[int]] = field(default_factory=dict)  # the prompt's block hashes per block size
    lease: Lease | None = None
    full: int = 0
    gone: int = 0
    failed: int = 0


class RouterService:
    def __init__(self, settings: RouterSettings, metrics: RouterMetrics | None = None) -> None:
        self.settings = settings
        self.router_id = settings.resolved_router_id()
        self.release_subject = router_release_subject(self.router_id)
        self.metrics = metrics or RouterMetrics()
        policy = create_policy(settings.router_policy, settings.kv_overlap_weight, settings.kv_decode_weight)
        self.discovery = discovery_for(settings)
        self.core = RouterCore(policy, self.router_id, settings.lease_max_age,
                               SessionTable(settings.session_affinity, settings.session_affinity_ttl_seconds),
                               CircuitBreaker(settings.breaker_failure_threshold, settings.breaker_cooldown_s,
                                              settings.breaker_max_cooldown_s),
                               discovery_backend=settings.discovery_backend, discovery=self.discovery.describe())
        self.pairs = PdPairs(settings.pd_prefill_guard_release)
        self._pd: PdFlow | None = None
        self._kv: KvClient | None = None
        self._route_tasks: set[asyncio.Task] = set()
        self.nc: NATS | None = None
        self._js = None
        self._watcher: FleetWatcher | None = None
        self._listed_or_told: set[str] = set()  # workers discovery listed once, or already warned about
        self._subs: list[Subscription] = []
        self._route_sub: Subscription | None = None
        self._publisher: AckedPublisher | None = None
        self._sweeper: asyncio.Task | None = None

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self.nc = await connect(self.settings.nats_url, f"infera-router-{self.router_id}", NATS_CONNECT_TIMEOUT)
        self._js = self.nc.jetstream()
        self.discovery = discovery_for(self.settings, self._js)
        log.info("discovery", router_id=self.router_id, nats_url=self.settings.nats_url,
                 **self.discovery.log_fields())
        self._watcher = self.discovery.watcher(on_change=self._on_change)
        try:
            await self._watcher.start()
        except ConnectionError as exc:  # etcd unreachable
            raise ConnectionError(self.discovery.start_failed(exc, self.settings.nats_url)) from exc
        try:
            await asyncio.wait_for(self._watcher.ready.wait(), DISCOVERY_READY_TIMEOUT)
        except TimeoutError:
            log.warning("discovery_snapshot_slow", waited=DISCOVERY_READY_TIMEOUT)
        self._publisher = AckedPublisher(self.nc)
        await self._publisher.start()
        self._kv = KvClient(self.nc, self.settings.kv_query_timeout, self.metrics)
        self._pd = PdFlow(self.nc, self.router_id, self.core, self.pairs, self._publisher, self.metrics,
                          self.settings.publish_timeout, self._lease_gauge)
        await self._pd.start()
        self._subs.append(await self.nc.subscribe(self.release_subject, cb=self._on_release))
        self._subs.append(await self.nc.subscribe(router_prefilled_subject(self.router_id), cb=self._on_prefilled))
        self._subs.append(await self.nc.subscribe(LOAD_SUBJECTS, cb=self._on_load))
        self._route_sub = await self.nc.subscribe(ROUTER_ROUTE, queue=ROUTER_QUEUE, cb=self._on_route)
        await self.nc.flush()  # the broker knows the subscriptions before we say we serve
        self._sweeper = asyncio.create_task(self._sweep(), name="lease-sweeper")
        log.info(
            "router_serving", router_id=self.router_id, policy=self.settings.router_policy,
            workers=len(self.core.fleet), lease_max_age=self.settings.lease_max_age,
        )

    async def stop(self) -> None:
        """Stop taking requests, answer the ones in hand, then close."""
        if self._route_sub is not None:
            try:
                await self._route_sub.drain()
            except Exception as exc:  # connection already gone
                log.info("route_drain_skipped", error=str(exc))
            self._route_sub = None
        if self._route_tasks:  # requests waiting for the kv-indexer or a PD leg: let them reach their reply
            await asyncio.gather(*list(self._route_tasks), return_exceptions=True)
        if self._pd is not None:
            await self._pd.stop()
        if self._publisher is not None:  # answer the requests whose envelope awaits its ack
            await self._publisher.wait_idle(self.settings.publish_timeout + 1.0)
            await self._publisher.stop()
            self._publisher = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        if self._watcher is not None:
            await self._watcher.stop()
            self._watcher = None
        for sub in self._subs:
            await unsubscribe_quietly(sub)
        self._subs.clear()
        if self.nc is not None:
            await close_connection(self.nc)
            self.nc = None
        log.info("router_stopped", router_id=self.router_id, leases_held=len(self.core.leases))

    # --- discovery -------------------------------------------------------------------------
    def _on_change(self, change: Change) -> None:
        record = change.record
        self._listed_or_told.add(record.worker_id)  # a leaving worker's trailing load reports are no mix
        old = self.core.fleet.get(record.worker_id)
        before = (old.model, old.record.status) if old is not None else None
        dropped = self.core.apply_change(change)
        if change.kind == "leave":
            self.metrics.forget_worker(record.worker_id)
            if dropped:
                self.metrics.leases_dropped.labels("worker_left").inc(len(dropped))
                actions = self.pairs.worker_left(record.worker_id, [lease.lease_id for lease in dropped])
                if actions and self._pd is not None:
                    self._spawn(self._pd.execute(actions))
            log.info("worker_left", worker_id=record.worker_id, model=record.model, leases_dropped=len(dropped))
        elif before == (record.model, record.status):
            return  # a heartbeat
        else:
            log.info("worker_" + change.kind, worker_id=record.worker_id, model=record.model,
                     status=record.status.value, engine=record.engine, role=record.role.value)
        for model in {record.model, before[0] if before else None} - {None}:
            self.metrics.set_live(model, self.core.fleet.status_counts(model))

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
        accepted = self.core.apply_load(report)
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
        lease = self.core.release(release.lease_id, release.outcome)
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
        interval = max(0.05, min(5.0, self.settings.lease_max_age / 10))
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            self.core.sessions.table.expire(now)
            self.metrics.set_session_stats(self.core.sessions.table.stats())
            self._breaker_metrics()
            for worker_id, state in self.core.breaker.snapshot(now).items():  # open -> half_open with time
                self.metrics.set_breaker_state(worker_id, state.state.value)
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


    # --- routing ---------------------------------------------------------------------------
    async def _on_route(self, msg: Msg) -> None:
        t0 = time.perf_counter()
        try:
            try:
                request = decode(RouteRequest, msg.data)
            except ValueError as exc:
                self.metrics.bad_messages.labels("route").inc()
                log.warning("bad_message", kind="route", error=str(exc)[:500])
                reply = RouteReply(status=400, message=f"malformed RouteRequest: {exc}"[:1000], router_id=self.router_id)
                await self._send(msg.reply, reply, t0)
                return
            query = self.core.kv_query(request)
            if query is not None and self._kv is not None:
                # the indexer round trip must not hold up the next route request: continue in a task
                self._spawn(self._route_with_kv(request, msg.reply, t0, query))
                return
            kv = None
            if getattr(self.core.policy, "needs_kv", False):
                kv = KvView.failed("no_tokens" if not request.token_ids else "no_block_size")
            await self._route(request, msg.reply, t0, kv)
        except Exception as exc:  # never leave a requester without an answer
            log.exception("route_failed")
            await self._send(msg.reply, RouteReply(status=500, message=f"router failure: {type(exc).__name__}: {exc}",
                                                   router_id=self.router_id), t0)

    async def _route_with_kv(self, request: RouteRequest, reply_to: str, t0: float, query) -> None:
        try:
            assert self._kv is not None
            candidates = self.core.candidates(request).order
            kv = await self._kv.query(query, candidates)
            kv.hashes = query.hashes  # for the in-flight view and the lease
            await self._route(request, reply_to, t0, kv)
        except Exception as exc:  # never leave a requester without an answer
            log.exception("route_failed", request_id=request.request_id)
            await self._send(reply_to, RouteReply(status=500, message=f"router failure: {type(exc).__name__}: {exc}",
                                                  router_id=self.router_id), t0)

    async def _route(self, request: RouteRequest, reply_to: str, t0: float, kv: KvView | None) -> None:
        try:
            plan = self.core.plan(request, kv, time.monotonic())
        except SessionIdError as exc:
            await self._send(reply_to, RouteReply(status=400, message=str(exc), router_id=self.router_id), t0)
            return
        routing = Routing(request, reply_to, plan.order, t0, plan=plan)
        if plan.all_open:
            self.metrics.breaker_all_open.labels(request.model).inc()
        if plan.status != 200:
            await self._reply(routing, plan.status, plan.message)
            return
        if plan.costs:
            routing.costs = plan.costs
            routing.hashes = kv.hashes if kv is not None else {}
            self._account_pick(request, plan.costs)
        if plan.disaggregated and self._pd is not None:
            async def reply(status: int, message: str, worker_id: str | None, lease_id: str | None) -> None:
                await self._reply(routing, status, message, worker_id, lease_id)

            # two legs, each waiting for its broker ack: in a task, not in the subscription's callback
            self._spawn(self._pd.route(request, plan, reply, routing.hashes))
            return
        await self._try_next(routing)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._route_tasks.add(task)
        task.add_done_callback(self._route_tasks.discard)

    def _account_pick(self, request: RouteRequest, costs: list[WorkerCost]) -> None:
        """Metrics and the debug line of one kv-aware decision (``costs`` cheapest first)."""
        m = self.metrics
        best = costs[0]
        m.kv_picks.labels(best.worker_id).inc()
        m.kv_hit_blocks.observe(best.matched_blocks)
        m.kv_request_blocks.observe(best.request_blocks)
        if best.cache_info != "ok":
            m.kv_picks_without_cache_info.labels(best.cache_info).inc()
        for c in costs:
            if c.cache_info in ("ok", "unknown_block_size", "unseen"):
                m.set_blind(c.worker_id, None if c.cache_info == "ok" else c.cache_info)
        if self.settings.log_level == "debug":  # the breakdown costs a list build: only when shown
            log.debug("route_pick", request_id=request.request_id, model=request.model, worker_id=best.worker_id,
                      costs=[{"worker": c.worker_id, "cost": round(c.cost, 3), "prefill_blocks": c.prefill_blocks,
                              "matched_blocks": c.matched_blocks, "request_blocks": c.request_blocks,
                              "load_blocks": round(c.load_blocks, 3), "block_size": c.block_size,
                              "cache_info": c.cache_info} for c in costs])

    async def _try_next(self, r: Routing) -> None:
        """Hand the work to the next candidate (its ack continues in ``_on_published``), or answer."""
        if r.tried >= len(r.order):
            await self._reply(r, *self._refusal(r))
            return
        worker = r.order[r.tried]
        r.tried += 1
        request = r.request
        cached = 0
        if r.costs is not None:  # the same order as r.order
            cost = r.costs[r.tried - 1]
            cached = cost.matched_blocks * cost.block_size
        hashes = r.hashes.get(worker.record.kv_block_size or 0)
        lease = r.lease = self.core.acquire(worker, request, time.monotonic(), cached, hashes, r.plan)
        self._lease_gauge(lease)
        try:
            data = encode(WorkEnvelope(
                request_id=request.request_id, endpoint=request.endpoint, body=pin_bytes(request.body, worker.rank),
                stream=request.stream, reply_subject=request.reply_subject, deadline=request.deadline,
                lease_id=lease.lease_id, router_id=self.router_id, headers=rank_headers(worker.rank),
            ))
            assert self._publisher is not None, "router stopped"
        except BaseException:
            self._drop(lease)
            raise
        try:
            await self._publisher.publish(
                work_subject(worker.base_id), data, self.settings.publish_timeout,
                lambda result: self._on_published(r, result),
            )
        except Exception as exc:  # connection closed or draining: NATS did not take it
            self._drop(lease)
            await self._reply(r, 503, f"JetStream did not take the request for worker {worker.base_id}: "
                                      f"{type(exc).__name__}")

    async def _on_published(self, r: Routing, result: PubResult) -> None:
        try:
            wid = r.order[r.tried - 1].base_id
            lease = r.lease
            assert lease is not None
            if result.kind == "stored":
                await self._reply(r, 200, worker_id=wid, lease_id=lease.lease_id)
                return
            self._drop(lease)
            if result.kind == "timeout":
                # The envelope may or may not be stored; trying another worker could run it twice.
                await self._reply(r, 503, f"JetStream did not take the request for worker {wid}: TimeoutError")
                return
            if result.kind == "full":
                r.full += 1
                self.metrics.publish_refused.labels(wid, "full").inc()
            elif result.kind == "gone":
                r.gone += 1
                self.metrics.publish_refused.labels(wid, "gone").inc()
                log.info("worker_stream_missing", worker_id=wid, stream=request_stream(wid))
            else:
                r.failed += 1
                self.metrics.publish_refused.labels(wid, "error").inc()
                log.warning("publish_refused", worker_id=wid, code=result.code, err_code=result.err_code,
                            description=result.description)
            await self._try_next(r)
        except Exception as exc:  # never leave a requester without an answer
            log.exception("route_failed", request_id=r.request.request_id)
            await self._reply(r, 500, f"router failure: {type(exc).__name__}: {exc}")

    @staticmethod
    def _refusal(r: Routing) -> tuple[int, str]:
        """Every candidate refused: 429 when some were full, else 503."""
        n = len(r.order)
        model = r.request.model
        if r.full:
            message = f"all {r.full} workers of model {model!r} are at their pending limit"
            if r.full < n:
                message += f" ({n - r.full} more could not take requests)"
            return 429, message
        return 503, (f"none of the {n} active workers of model {model!r} could take the request "
                     f"({r.gone} without a request queue, {r.failed} refused)")

    def _drop(self, lease: Lease) -> None:
        if self.core.release(lease.lease_id) is not None:
            self._lease_gauge(lease)

    async def _reply(self, r: Routing, status: int, message: str = "",
                     worker_id: str | None = None, lease_id: str | None = None) -> None:
        request = r.request
        if r.plan is not None:
            self.core.discard(r.plan)
        self.metrics.routed_inc(request.model, worker_id or "", status)
        if status != 200:
            (log.debug if status == 429 else log.info)(
                "route_refused", request_id=request.request_id, model=request.model, status=status, message=message)
        reply = RouteReply(status=status, message=message, worker_id=worker_id, lease_id=lease_id,
                           router_id=self.router_id)
        await self._send(r.reply_to, reply, r.t0)

    async def _send(self, reply_to: str, reply: RouteReply, t0: float) -> None:
        if reply_to and self.nc is not None:
            try:
                await self.nc.publish(reply_to, encode(reply))
            except Exception as exc:  # requester or connection gone
                log.warning("route_reply_failed", error=str(exc))
        self.metrics.route_seconds.observe(time.perf_counter() - t0)
