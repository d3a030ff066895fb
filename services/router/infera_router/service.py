"""The router's NATS adapter: discovery watch, route RPC, releases, load reports, lease expiry.

All decisions are ``RouterCore``'s; this module decodes, publishes, replies and counts.
Each route request runs in its own task, so one JetStream round trip does not hold up the next
request; the decision and the lease are taken synchronously before the first await.
"""

from __future__ import annotations

import asyncio
import time

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import APIError, NoStreamResponseError

from infera_common.discovery import Watcher
from infera_common.fleet import Change
from infera_common.logs import get_logger
from infera_common.nats_conn import connect
from infera_common.schemas import LoadReport, Release, RouteReply, RouteRequest, WorkEnvelope, decode, encode
from infera_common.subjects import (
    LOAD_SUBJECTS,
    ROUTER_QUEUE,
    ROUTER_ROUTE,
    request_stream,
    router_release_subject,
    work_subject,
)

from infera_router.core import RouterCore
from infera_router.leases import Lease
from infera_router.metrics import RouterMetrics
from infera_router.policies import create_policy
from infera_router.settings import RouterSettings

log = get_logger("router")

#: JetStream's error code for a store refused by a stream limit (description names the limit).
JS_STORE_FAILED = 10077
#: How long start() tries to reach NATS before giving up with a clear error.
NATS_CONNECT_TIMEOUT = 10.0
#: How long start() waits for discovery's initial snapshot before serving anyway.
DISCOVERY_READY_TIMEOUT = 10.0


def stream_full(exc: APIError) -> bool:
    """True when the broker refused the message because the stream is at a limit (discard-new).

    nats-server 2.15 answers ``{"code": 503, "err_code": 10077, "description": "maximum messages
    exceeded"}`` (nats-py raises ``ServiceUnavailableError``, an ``APIError``).
    """
    return exc.err_code == JS_STORE_FAILED and "maximum" in (exc.description or "")


class RouterService:
    def __init__(self, settings: RouterSettings, metrics: RouterMetrics | None = None) -> None:
        self.settings = settings
        self.router_id = settings.resolved_router_id()
        self.release_subject = router_release_subject(self.router_id)
        self.metrics = metrics or RouterMetrics()
        self.core = RouterCore(create_policy(settings.router_policy), self.router_id, settings.lease_max_age)
        self.nc: NATS | None = None
        self._js = None
        self._watcher: Watcher | None = None
        self._subs: list[Subscription] = []
        self._route_sub: Subscription | None = None
        self._inflight: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self.nc = await connect(self.settings.nats_url, f"infera-router-{self.router_id}", NATS_CONNECT_TIMEOUT)
        self._js = self.nc.jetstream()
        self._watcher = Watcher(self._js, on_change=self._on_change)
        await self._watcher.start()
        try:
            await asyncio.wait_for(self._watcher.ready.wait(), DISCOVERY_READY_TIMEOUT)
        except TimeoutError:
            log.warning("discovery_snapshot_slow", waited=DISCOVERY_READY_TIMEOUT)
        self._subs.append(await self.nc.subscribe(self.release_subject, cb=self._on_release))
        self._subs.append(await self.nc.subscribe(LOAD_SUBJECTS, cb=self._on_load))
        self._route_sub = await self.nc.subscribe(ROUTER_ROUTE, queue=ROUTER_QUEUE, cb=self._on_route)
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
        if self._inflight:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        if self._watcher is not None:
            await self._watcher.stop()
            self._watcher = None
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # connection already gone
                pass
        self._subs.clear()
        if self.nc is not None:
            try:
                await self.nc.drain()
            except Exception:
                await self.nc.close()
            self.nc = None
        log.info("router_stopped", router_id=self.router_id, leases_held=len(self.core.leases))

    # --- discovery -------------------------------------------------------------------------
    def _on_change(self, change: Change) -> None:
        record = change.record
        old = self.core.fleet.get(record.worker_id)
        before = (old.model, old.record.status) if old is not None else None
        dropped = self.core.apply_change(change)
        if change.kind == "leave":
            self.metrics.forget_worker(record.worker_id)
            if dropped:
                self.metrics.leases_dropped.labels("worker_left").inc(len(dropped))
            log.info("worker_left", worker_id=record.worker_id, model=record.model, leases_dropped=len(dropped))
        elif before == (record.model, record.status):
            return  # a heartbeat
        else:
            log.info("worker_" + change.kind, worker_id=record.worker_id, model=record.model,
                     status=record.status.value, engine=record.engine, role=record.role.value)
        for model in {record.model, before[0] if before else None} - {None}:
            self.metrics.set_live(model, self.core.fleet.status_counts(model))

    # --- load reports and releases ---------------------------------------------------------
    async def _on_load(self, msg: Msg) -> None:
        try:
            report = decode(LoadReport, msg.data)
        except ValueError as exc:
            self.metrics.bad_messages.labels("load").inc()
            log.warning("bad_load_report", subject=msg.subject, error=str(exc))
            return
        accepted = self.core.apply_load(report)
        self.metrics.load_reports.labels("accepted" if accepted else "unknown_worker").inc()

    async def _on_release(self, msg: Msg) -> None:
        try:
            release = decode(Release, msg.data)
        except ValueError as exc:
            self.metrics.bad_messages.labels("release").inc()
            log.warning("bad_release", error=str(exc))
            return
        lease = self.core.release(release.lease_id)
        if lease is None:
            self.metrics.unknown_releases.inc()
            log.debug("release_unknown_lease", lease_id=release.lease_id, worker_id=release.worker_id)
            return
        self.metrics.releases.labels(release.outcome).inc()
        self._lease_gauge(lease)

    async def _sweep(self) -> None:
        interval = max(0.05, min(5.0, self.settings.lease_max_age / 10))
        while True:
            await asyncio.sleep(interval)
            dropped = self.core.expire(time.monotonic())
            if not dropped:
                continue
            self.metrics.leases_dropped.labels("max_age").inc(len(dropped))
            for lease in dropped:
                self._lease_gauge(lease)
            log.warning(
                "leases_expired", count=len(dropped), max_age=self.settings.lease_max_age,
                workers=sorted({lease.worker_id for lease in dropped}),
            )

    def _lease_gauge(self, lease: Lease) -> None:
        worker = self.core.fleet.get(lease.worker_id)
        if worker is not None:
            self.metrics.set_leases(worker.worker_id, worker.in_flight)

    # --- routing ---------------------------------------------------------------------------
    async def _on_route(self, msg: Msg) -> None:
        task = asyncio.create_task(self._serve_route(msg))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _serve_route(self, msg: Msg) -> None:
        t0 = time.perf_counter()
        try:
            reply = await self.route(msg.data)
        except Exception as exc:  # never leave a requester without an answer
            log.exception("route_failed")
            reply = RouteReply(status=500, message=f"router failure: {type(exc).__name__}: {exc}",
                               router_id=self.router_id)
        if msg.reply:
            try:
                await msg.respond(encode(reply))
            except Exception as exc:  # requester or connection gone
                log.warning("route_reply_failed", error=str(exc))
        self.metrics.route_seconds.observe(time.perf_counter() - t0)

    async def route(self, data: bytes) -> RouteReply:
        """Decode one route request, pick a worker, hand it the work; the reply to send."""
        try:
            request = decode(RouteRequest, data)
        except ValueError as exc:
            self.metrics.bad_messages.labels("route").inc()
            log.warning("bad_route_request", error=str(exc)[:500])
            return RouteReply(status=400, message=f"malformed RouteRequest: {exc}"[:1000], router_id=self.router_id)
        plan = self.core.plan(request)
        if plan.status != 200:
            return self._answer(request, plan.status, plan.message)
        full = gone = failed = 0
        for worker in plan.order:
            lease = self.core.acquire(worker, request, time.monotonic())
            self.metrics.set_leases(worker.worker_id, worker.in_flight)
            envelope = WorkEnvelope.model_construct(
                request_id=request.request_id, endpoint=request.endpoint, body=request.body,
                stream=request.stream, reply_subject=request.reply_subject, deadline=request.deadline,
                lease_id=lease.lease_id, router_id=self.router_id,
            )
            wid = worker.worker_id
            try:
                await self._js.publish(
                    work_subject(wid), encode(envelope),
                    timeout=self.settings.publish_timeout, stream=request_stream(wid),
                )
            except APIError as exc:
                self._drop(lease)
                if stream_full(exc):
                    full += 1
                    self.metrics.publish_refused.labels(wid, "full").inc()
                else:
                    failed += 1
                    self.metrics.publish_refused.labels(wid, "error").inc()
                    log.warning("publish_refused", worker_id=wid, code=exc.code, err_code=exc.err_code,
                                description=exc.description)
                continue
            except NoStreamResponseError:
                self._drop(lease)
                gone += 1
                self.metrics.publish_refused.labels(wid, "gone").inc()
                log.info("worker_stream_missing", worker_id=wid, stream=request_stream(wid))
                continue
            except (nats.errors.TimeoutError, nats.errors.ConnectionClosedError,
                    nats.errors.ConnectionReconnectingError) as exc:
                # The envelope may or may not be stored; trying another worker could run it twice.
                self._drop(lease)
                return self._answer(request, 503, f"JetStream did not take the request for worker {wid}: "
                                                  f"{type(exc).__name__}")
            except BaseException:
                self._drop(lease)
                raise
            return self._answer(request, 200, worker_id=wid, lease_id=lease.lease_id)
        n = len(plan.order)
        model = request.model
        if full:
            message = f"all {full} workers of model {model!r} are at their pending limit"
            if full < n:
                message += f" ({n - full} more could not take requests)"
            return self._answer(request, 429, message)
        return self._answer(
            request, 503, f"none of the {n} active workers of model {model!r} could take the request "
                          f"({gone} without a request queue, {failed} refused)",
        )

    def _drop(self, lease: Lease) -> None:
        if self.core.release(lease.lease_id) is not None:
            self._lease_gauge(lease)

    def _answer(self, request: RouteRequest, status: int, message: str = "",
                worker_id: str | None = None, lease_id: str | None = None) -> RouteReply:
        self.metrics.routed.labels(request.model, worker_id or "", str(status)).inc()
        if status != 200:
            (log.debug if status == 429 else log.info)("route_refused", request_id=request.request_id, model=request.model, status=status,
                     message=message)
        return RouteReply.model_construct(status=status, message=message, worker_id=worker_id,
                                          lease_id=lease_id, router_id=self.router_id)
