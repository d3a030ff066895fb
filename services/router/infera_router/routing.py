"""The route RPC of the router service: a route request from the frontend to a published work
envelope (or two, for a disaggregated pair) and its reply. A mixin of ``RouterService``, which owns
the state it uses (``core``, ``metrics``, ``settings``, the dispatcher, the kv client, the PD flow).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from infera_common.logs import get_logger
from infera_common.schemas import OverlapQuery, RouteReply, RouteRequest, WorkEnvelope, decode, encode
from infera_common.subjects import request_stream
from infera_common.tracing import Span, engine_headers, finish, start_span, traceparent

from infera_router.core import Plan
from infera_common.dp_pin import pin_bytes, rank_headers
from infera_router.jetstream import PubResult
from infera_router.kv_local import LocalKvIndex
from infera_router.kv_view import KvView, without_index
from infera_router.leases import Lease
from infera_router.metrics import account_pick
from infera_router.policy_kv_aware import WorkerCost
from infera_router.sessions import SessionIdError
from infera_router.state import WorkerState

log = get_logger("router")


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
    span: Span | None = None  # the request's ``route`` span, ended with the reply (``RoutePath._reply``)


def log_pick(request: RouteRequest, costs: list[WorkerCost]) -> None:
    """The debug line of one kv-aware decision: every candidate's cost breakdown, cheapest first."""
    log.debug("route_pick", request_id=request.request_id, model=request.model, worker_id=costs[0].worker_id,
              costs=[{"worker": c.worker_id, "cost": round(c.cost, 3), "prefill_blocks": c.prefill_blocks,
                      "matched_blocks": c.matched_blocks, "request_blocks": c.request_blocks,
                      "load_blocks": round(c.load_blocks, 3), "block_size": c.block_size,
                      "cache_info": c.cache_info} for c in costs])


class RoutePath:
    """Route requests in, work envelopes out (see the module doc)."""

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
            if self._expired(request, msg.reply, t0):
                return
            span = start_span("route", request.traceparent,
                              attributes={"infera.request_id": request.request_id, "infera.model": request.model})
            request.traceparent = traceparent(span)  # the engine call's parent
            handed_over = False  # the span is then ended by the task that continues the decision
            try:
                ask = self.core.kv_query(request)
                kv = without_index(ask[0]) if ask is not None else None
                if kv is not None:  # no full block to look up: the round trip would only add latency
                    self.metrics.kv_queries_skipped.inc()
                elif ask is not None and isinstance(self._kv, LocalKvIndex):  # --kv-index local: read in place
                    kv = self._kv.answer(*ask)
                elif ask is not None and self._kv is not None:
                    # the indexer round trip must not hold up the next route request: continue in a task
                    self._spawn(self._route_with_kv(request, msg.reply, t0, *ask, span))
                    handed_over = True
                    return
                elif getattr(self.core.policy, "needs_kv", False):
                    kv = KvView.failed("no_tokens" if not request.tokens else "no_block_size")
                handed_over = await self._route(request, msg.reply, t0, kv, span)
            finally:
                if not handed_over:
                    finish(span)
        except Exception as exc:  # never leave a requester without an answer
            log.exception("route_failed")
            await self._send(msg.reply, RouteReply(status=500, message=f"router failure: {type(exc).__name__}: {exc}",
                                                   router_id=self.router_id), t0)

    async def _route_with_kv(self, request: RouteRequest, reply_to: str, t0: float, query: OverlapQuery,
                             candidates: list[WorkerState], span: Span) -> None:
        handed_over = False
        try:
            assert self._kv is not None
            ask = start_span("kv query", request.traceparent, attributes={"infera.kv.workers": len(candidates)})
            try:
                kv = await self._kv.query(query, candidates, traceparent(ask))
                ask.set_attribute("infera.kv.ok", kv.ok)
            finally:
                finish(ask)
            kv.hashes = query.hashes  # for the in-flight view and the lease
            handed_over = await self._route(request, reply_to, t0, kv, span)
        except Exception as exc:  # never leave a requester without an answer
            log.exception("route_failed", request_id=request.request_id)
            await self._send(reply_to, RouteReply(status=500, message=f"router failure: {type(exc).__name__}: {exc}",
                                                  router_id=self.router_id), t0)
        finally:
            if not handed_over:
                finish(span)

    async def _route(self, request: RouteRequest, reply_to: str, t0: float, kv: KvView | None, span: Span) -> bool:
        """Plan and start handing the request over; True when ``span`` went to the routing, which
        ends it with the reply (the worker's ack may come later), False when the caller ends it."""
        if self._expired(request, reply_to, t0):  # (the indexer's answer may have taken the rest)
            span.set_attribute("infera.route.status", 504)
            return False
        try:
            plan = self.core.plan(request, kv, time.monotonic())
        except SessionIdError as exc:
            await self._send(reply_to, RouteReply(status=400, message=str(exc), router_id=self.router_id), t0)
            span.set_attribute("infera.route.status", 400)
            return False
        if plan.costs:
            span.set_attribute("infera.kv.matched_blocks", plan.costs[0].matched_blocks)
        routing = Routing(request, reply_to, plan.order, t0, plan=plan, span=span)
        try:
            if plan.all_open:
                self.metrics.breaker_all_open.labels(request.model).inc()
            if plan.status != 200:
                await self._reply(routing, plan.status, plan.message)
                return True
            if plan.costs:
                routing.costs = plan.costs
                routing.hashes = kv.hashes if kv is not None else {}
                account_pick(self.metrics, plan.costs, asked=kv is None or kv.asked)
                if self.settings.log_level == "debug":  # the breakdown costs a list build: only when shown
                    log_pick(request, plan.costs)
            if plan.disaggregated and self._pd is not None:
                async def reply(status: int, message: str, worker_id: str | None, lease_id: str | None) -> None:
                    await self._reply(routing, status, message, worker_id, lease_id)

                # two legs, each waiting for its broker ack: in a task, not in the subscription's callback
                self._spawn(self._pd_route(routing, reply))
                return True
            await self._try_next(routing)
        except BaseException:
            routing.span = None  # back to the caller, which ends it
            raise
        return True

    async def _pd_route(self, r: Routing, reply) -> None:  # noqa: ANN001 - pd_flow.Reply
        assert self._pd is not None and r.plan is not None
        try:
            await self._pd.route(r.request, r.plan, reply, r.hashes)
        except Exception as exc:  # never leave a requester without an answer
            log.exception("route_failed", request_id=r.request.request_id)
            if r.span is not None:  # (not answered yet)
                await self._reply(r, 500, f"router failure: {type(exc).__name__}: {exc}")

    @staticmethod
    def _end_span(r: Routing, status: int, worker_id: str | None = None) -> None:
        """End the request's ``route`` span (once) with the status its requester got."""
        span, r.span = r.span, None
        if span is not None:
            span.set_attribute("infera.route.status", status)
            if worker_id:
                span.set_attribute("infera.worker_id", worker_id)
            finish(span, status)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._route_tasks.add(task)
        task.add_done_callback(self._route_tasks.discard)

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
        hashes = r.hashes.get(worker.block_size or 0)
        lease = r.lease = self.core.acquire(worker, request, time.monotonic(), cached, hashes, r.plan)
        # no ``requester`` yet: a worker that leaves before its ack is another candidate's to answer
        # (``_on_published``), not a 502 to the requester, who would charge it to the worker named next
        self._lease_gauge(lease)
        try:
            env = WorkEnvelope(
                request_id=request.request_id, endpoint=request.endpoint,
                body=pin_bytes(request.body, worker.rank, worker.record.engine_model(request.model)),
                answer_model=worker.record.answer_model(request.model),
                stream=request.stream, reply_subject=request.reply_subject, deadline=request.deadline,
                lease_id=lease.lease_id, router_id=self.router_id, sequences=request.sequences,
                keepalive=request.keepalive, prefill_tokens=lease.prefill_tokens, decode_tokens=lease.decode_tokens,
                headers={**rank_headers(worker.rank), **engine_headers(request.traceparent)},
            )
            assert self._dispatcher is not None, "router stopped"
        except BaseException:
            self._drop(lease)
            raise
        try:
            await self._dispatcher.send(worker.base_id, env, self.settings.publish_timeout,
                                        lambda result: self._on_published(r, result))
        except Exception as exc:  # connection closed or draining: the request was not handed over
            self._drop(lease)
            await self._reply(r, 503, f"the request could not be handed to worker {worker.base_id}: "
                                      f"{type(exc).__name__}")

    async def _on_published(self, r: Routing, result: PubResult) -> None:
        try:
            wid = r.order[r.tried - 1].base_id
            lease = r.lease
            assert lease is not None
            if result.kind == "stored":
                lease.requester = r.request.reply_subject
                await self._reply(r, 200, worker_id=wid, lease_id=lease.lease_id)
                if lease.lease_id not in self.core.leases and self._dispatcher is not None:
                    # the worker left between the store and its ack: the requester, told of it only
                    # now (after the reply that names it), tries another worker
                    await self._dispatcher.worker_left(wid, [lease])
                return
            self._drop(lease)
            if result.kind == "timeout":
                # The envelope may or may not be stored; trying another worker could run it twice.
                await self._reply(r, 503, f"JetStream did not acknowledge the request for worker {wid} in time")
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

    def _expired(self, request: RouteRequest, reply_to: str, t0: float) -> bool:
        """Whether the requester stopped waiting for this route request before the router got to it
        (``route_deadline``, on the requester's wall clock, read with the offset measured to it:
        ``requester_clocks``; not checked while none is): then it is not placed, so no engine works
        for nobody; the requester has tried another router. A router frozen for 20 s (SIGSTOP, a
        stalled host) placed every request of those 20 s when it woke, the clients of all of them
        long gone (the HA audit of session 28)."""
        if request.route_deadline is None or self._clocks is None:
            return False
        offset = self._clocks.offset_for(request.reply_subject)
        if offset is None:
            return False
        late = time.time() - offset - request.route_deadline
        if late <= 0:
            return False
        self.metrics.route_expired.inc()
        held = self._refusals.let_through("expired", time.monotonic())
        if held is not None:
            log.warning("route_request_expired", request_id=request.request_id, late_s=round(late, 3),
                        clock_offset_s=round(offset, 3),
                        hint="the requester stopped waiting (--route-timeout) before this router got to the "
                             "request: the router was stalled or behind",
                        **({"repeated": held} if held else {}))
        self.metrics.routed_inc(request.model, "", 504)
        self._spawn(self._send(reply_to, RouteReply(
            status=504, message=f"route request reached router {self.router_id} {late:.3f}s after its "
                                "requester stopped waiting", router_id=self.router_id), t0))
        return True

    def _drop(self, lease: Lease) -> None:
        if self.core.release(lease.lease_id) is not None:
            self._lease_gauge(lease)

    async def _reply(self, r: Routing, status: int, message: str = "",
                     worker_id: str | None = None, lease_id: str | None = None) -> None:
        request = r.request
        if r.plan is not None:
            self.core.discard(r.plan)
        self.metrics.routed_inc(request.model, worker_id or "", status)
        if status == 429:  # a full fleet: counted (routed_total), not a line per request
            log.debug("route_refused", request_id=request.request_id, model=request.model, status=status,
                      message=message)
        elif status != 200:  # the first of a status, then one every REFUSALS_LOG_EVERY seconds (an outage)
            held = self._refusals.let_through(str(status), time.monotonic())
            if held is not None:
                log.info("route_refused", request_id=request.request_id, model=request.model, status=status,
                         message=message, **({"repeated": held} if held else {}))
        reply = RouteReply(status=status, message=message, worker_id=worker_id, lease_id=lease_id,
                           router_id=self.router_id,
                           frames_from=self._dispatcher.frames_from if self._dispatcher is not None else "worker")
        self._end_span(r, status, worker_id)
        await self._send(r.reply_to, reply, r.t0)

    async def _send(self, reply_to: str, reply: RouteReply, t0: float) -> None:
        if reply_to and self.nc is not None:
            try:
                await self.nc.publish(reply_to, encode(reply))
            except Exception as exc:  # requester or connection gone
                log.warning("route_reply_failed", error=str(exc))
        self.metrics.route_seconds.observe(time.perf_counter() - t0)
