"""The NATS side of disaggregated serving: hand a request to a prefill and a decode worker.

``PdFlow`` is called by the router service for a plan with both pools. It takes a lease per leg,
publishes the prefill leg (its answer comes back to this router on ``router_pd_subject`` and is
drained here) and the decode leg (its answer goes to the requester), and replies with the decode
worker. The lifetime rules of the pair (who is cancelled, which lease is released when) are
``PdPairs``'; this module executes its actions.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from infera_common.logs import get_logger
from infera_common.nats_conn import unsubscribe_quietly
from infera_common.openai_errors import error_message
from infera_common.frames import decode_frame, encode_frame
from infera_common.schemas import Cancel, RouteRequest, WorkEnvelope, encode
from infera_common.subjects import cancel_subject, router_pd_subject, router_pd_subjects
from infera_common.tracing import engine_headers

from infera_router.core import Plan, RouterCore
from infera_router.dispatch import Dispatcher
from infera_router.jetstream import PubResult
from infera_router.leases import Lease
from infera_router.metrics import RouterMetrics
from infera_router.pd_pairs import Action, PdPairs
from infera_common.dp_pin import rank_headers
from infera_router.pd_protocol import several_sequences
from infera_router.pd_protocols import PROTOCOLS
from infera_router.state import WorkerState

log = get_logger("router.pd")

#: A sequential pair's prefill answer with one of these statuses (engine overloaded, gone or
#: draining) is tried on the model's next prefill worker: nothing was handed over to a decode yet.
#: Not 504: that prefill has taken the requester's whole upstream timeout already.
RETRIED_PREFILL_STATUSES = frozenset({429, 502, 503})

Reply = Callable[[int, str, str | None, str | None], Awaitable[None]]  # status, message, worker, lease


@dataclass(slots=True)
class Drained:
    ok: bool
    status: int
    message: str = ""


class PdFlow:
    def __init__(self, nc: NATS, router_id: str, core: RouterCore, pairs: PdPairs, dispatcher: Dispatcher,
                 metrics: RouterMetrics, publish_timeout: float, on_lease_change: Callable[[Lease], None],
                 offset: Callable[[str], float | None] = lambda _: None) -> None:
        self._nc, self._router_id, self._core, self.pairs = nc, router_id, core, pairs
        self._offset = offset  # this host's clock against the requester's (``requester_clocks``): deadlines
        self._dispatcher, self._metrics, self._publish_timeout = dispatcher, metrics, publish_timeout
        self._on_lease_change = on_lease_change  # the service's bookkeeping after a lease is taken or dropped
        self._waiters: dict[str, asyncio.Future[Drained]] = {}
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(router_pd_subjects(self._router_id), cb=self._on_frame)

    async def stop(self) -> None:
        if self._sub is not None:
            await unsubscribe_quietly(self._sub)
            self._sub = None

    # --- one request -------------------------------------------------------------------------
    async def route(self, request: RouteRequest, plan: Plan, reply: Reply, hashes: dict[int, list[int]]) -> None:
        try:
            body = json.loads(request.body)
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            await reply(400, f"request body is not a JSON object: {exc}", None, None)
            return
        if (several := several_sequences(body)) is not None:
            await reply(400, f"{several} is not served by disaggregated prefill/decode workers (one KV handover "
                        "per request): send one request per sequence", None, None)
            return
        full = 0
        failed: tuple[int, str] | None = None  # the last prefill leg that failed where another worker may not
        failed_workers: set[str] = set()
        for i, prefill in enumerate(plan.order):
            if prefill.base_id in failed_workers:  # another DP rank of a worker whose prefill just failed
                continue
            pd = prefill.record.pd
            protocol = PROTOCOLS.get(pd.protocol) if pd is not None else None
            if protocol is None:
                log.warning("pd_worker_without_protocol", worker_id=prefill.base_id)
                continue
            ctx = protocol.context(prefill)
            cached = 0
            if plan.costs is not None:
                cached = plan.costs[i].matched_blocks * plan.costs[i].block_size
            lease = self._core.acquire(prefill, request, time.monotonic(), cached,
                                       hashes.get(prefill.block_size or 0), plan)
            self._on_lease_change(lease)  # the gauge follows the lease count
            self.pairs.start(request.request_id, lease.lease_id, prefill.base_id)
            waiter = asyncio.get_running_loop().create_future() if protocol.sequential else None
            if waiter is not None:
                self._waiters[lease.lease_id] = waiter
            env = WorkEnvelope(
                request_id=request.request_id, endpoint=request.endpoint, stream=False,
                body=json.dumps(protocol.prefill_body(for_engine(body, prefill), prefill, ctx)).encode(),
                reply_subject=router_pd_subject(self._router_id, lease.lease_id), deadline=request.deadline,
                clock_of=request.reply_subject,
                lease_id=lease.lease_id, router_id=self._router_id, prefill_tokens=lease.prefill_tokens,
                decode_tokens=lease.decode_tokens,
                headers={**rank_headers(prefill.rank), **engine_headers(request.traceparent)},
            )
            result = await self._publish(prefill, env)
            if result.kind != "stored":
                self._waiters.pop(lease.lease_id, None)
                self._drop_pair(lease)
                full += result.kind == "full"
                continue
            if waiter is not None:
                drained = await self._await_prefill(lease, waiter, request)
                if not drained.ok:
                    failed = (drained.status, f"prefill worker {prefill.base_id} failed: {drained.message}")
                    if drained.status in RETRIED_PREFILL_STATUSES:  # nothing was handed over: try the next
                        failed_workers.add(prefill.base_id)
                        log.info("pd_prefill_retried", request_id=request.request_id, failed_worker=prefill.base_id,
                                 status=drained.status)
                        continue
                    await reply(*failed, None, None)
                    return
            def decode_body(decode: WorkerState) -> bytes:
                return json.dumps(protocol.decode_body(for_engine(body, decode), prefill, decode, ctx)).encode()

            await self._send_decode(request, plan, lease, decode_body, reply)
            return
        if failed is not None:
            await reply(*failed, None, None)
        elif full:
            await reply(429, f"all prefill workers of model {request.model!r} are at their pending limit", None, None)
        else:
            await reply(503, f"no prefill worker of model {request.model!r} could take the request", None, None)

    async def _send_decode(self, request: RouteRequest, plan: Plan, prefill_lease: Lease,
                           body: Callable[[WorkerState], bytes], reply: Reply) -> None:
        full = 0
        for worker in plan.decode:
            # the decode leg computes no prompt (its KV arrives from the prefill) but holds it
            lease = self._core.acquire(worker, request, time.monotonic(), cached_tokens=request.prompt_tokens,
                                       plan=plan)
            lease.requester = request.reply_subject
            self._on_lease_change(lease)
            env = WorkEnvelope(
                request_id=request.request_id, endpoint=request.endpoint, body=body(worker), stream=request.stream,
                answer_model=worker.record.answer_model(request.model),
                reply_subject=request.reply_subject, deadline=request.deadline, lease_id=lease.lease_id,
                router_id=self._router_id, keepalive=request.keepalive, prefill_tokens=lease.prefill_tokens,
                decode_tokens=lease.decode_tokens,
                headers={**rank_headers(worker.rank), **engine_headers(request.traceparent)},
            )
            result = await self._publish(worker, env)
            if result.kind == "stored":
                await self.execute(self.pairs.add_decode(prefill_lease.lease_id, lease.lease_id, worker.base_id,
                                                          request.request_id))
                self._metrics.pd_pairs.inc()
                await reply(200, "", worker.base_id, lease.lease_id)
                return
            if self._core.release(lease.lease_id) is not None:
                self._on_lease_change(lease)
            full += result.kind == "full"
        await self.execute(self.pairs.abandon(prefill_lease.lease_id))
        if full:
            await reply(429, f"all decode workers of model {request.model!r} are at their pending limit", None, None)
        else:
            await reply(503, f"no decode worker of model {request.model!r} could take the request", None, None)

    async def _publish(self, worker: WorkerState, env: WorkEnvelope) -> PubResult:
        done: asyncio.Future[PubResult] = asyncio.get_running_loop().create_future()

        async def settle(result: PubResult) -> None:
            if not done.done():
                done.set_result(result)

        try:
            await self._dispatcher.send(worker.base_id, env, self._publish_timeout, settle)
        except Exception as exc:  # connection closed or draining
            return PubResult("error", description=type(exc).__name__)
        result = await done
        if result.kind != "stored":
            self._metrics.publish_refused.labels(worker.base_id, result.kind if result.kind in ("full", "gone") else "error").inc()
        return result

    async def _await_prefill(self, lease: Lease, waiter: asyncio.Future[Drained], request: RouteRequest) -> Drained:
        """The prefill leg's answer, before the route reply can name the decode worker. The requester
        hears ``alive`` frames meanwhile (when it asked for them), so that its route timeout, meant for
        a router that does not answer, does not end a long prefill; the wait is then its upstream
        timeout, as for any answer the requester waits for."""
        wait = max(0.0, request.deadline + (self._offset(request.reply_subject) or 0.0) - time.time())
        if request.upstream_timeout is not None:
            wait = min(wait, request.upstream_timeout)
        alive = None
        if request.keepalive is not None:
            alive = asyncio.create_task(self._say_alive(request.reply_subject, request.keepalive))
        try:
            return await asyncio.wait_for(waiter, wait)
        except TimeoutError:
            await self.execute(self.pairs.abandon(lease.lease_id))
            return Drained(False, 504, f"no prefill answer within {wait:g}s")
        finally:
            self._waiters.pop(lease.lease_id, None)
            if alive is not None:
                alive.cancel()

    async def _say_alive(self, subject: str, every: float) -> None:
        """An ``alive`` frame now and every ``every`` seconds (cancelled when the prefill answered)."""
        frame = encode_frame("alive", 0)
        while True:
            try:
                await self._nc.publish(subject, frame)
            except Exception as exc:  # the connection is closing: the route's own reply fails too
                log.warning("alive_frame_failed", subject=subject, error=str(exc) or type(exc).__name__)
                return
            await asyncio.sleep(every)

    def _drop_pair(self, lease: Lease) -> None:
        self.pairs.abandon(lease.lease_id)  # nothing was published: nothing to cancel
        if self._core.release(lease.lease_id) is not None:
            self._on_lease_change(lease)

    # --- the drained prefill answers ---------------------------------------------------------
    async def _on_frame(self, msg: Msg) -> None:
        lease_id = msg.subject.rsplit(".", 1)[-1]
        try:
            frame = decode_frame(msg.data)
        except ValueError as exc:
            self._metrics.bad_messages.labels("pd_frame").inc()
            log.warning("bad_pd_frame", error=str(exc)[:300])
            return
        if frame.kind == "error" or (frame.kind == "head" and frame.status >= 400):
            status = frame.status or 502
            outcome = Drained(False, status, frame.message or error_message(status, frame.body)[:500])
        elif frame.kind == "end" or (frame.kind == "head" and frame.final):
            outcome = Drained(True, frame.status)
        else:
            return  # headers or a chunk: not the end of the answer
        if not outcome.ok:
            self._metrics.pd_leg_failures.labels("prefill").inc()
            log.info("pd_prefill_failed", lease_id=lease_id, status=outcome.status, message=outcome.message)
        waiter = self._waiters.pop(lease_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(outcome)
        await self.execute(self.pairs.prefill_drained(lease_id, outcome.ok, outcome.status, outcome.message))

    # --- actions -----------------------------------------------------------------------------
    async def execute(self, actions: list[Action]) -> None:
        for action in actions:
            if action.kind == "release":
                lease = self._core.release(action.lease_id, action.outcome, time.monotonic())
                if lease is not None:
                    self._on_lease_change(lease)
            else:
                self._metrics.pd_legs_cancelled.inc()
                try:
                    cancel = (Cancel(request_id=action.request_id, status=action.status, message=action.why,
                                     failed_worker=action.failed_worker, lease_id=action.lease_id)
                              if action.why
                              else Cancel(request_id=action.request_id, lease_id=action.lease_id))
                    await self._nc.publish(cancel_subject(action.worker_id), encode(cancel))
                except Exception as exc:  # connection gone: the leg ends by its deadline
                    log.warning("pd_cancel_failed", worker_id=action.worker_id, error=str(exc))


def for_engine(body: dict, worker: WorkerState) -> dict:
    """``body`` with the ``model`` the worker's engine takes for it (an SGLang engine's name for an adapter)."""
    model = body.get("model")
    named = worker.record.engine_model(model) if isinstance(model, str) else None
    return body if named is None else {**body, "model": named}
