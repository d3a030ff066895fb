"""The kv-indexer query adapter: one NATS request on ``KV_QUERY`` with a short timeout, carrying the
caller's trace context (``traceparent`` header) when there is one, so the indexer's span joins the trace.

Never raises: any failure becomes ``KvView.failed(reason)`` (reason ``no_indexer``, ``timeout``,
``error`` or ``bad_reply``), counted in ``infera_router_kv_query_failures_total{reason}`` and
logged at most once per reason per ``FAILURE_LOG_INTERVAL`` seconds, so the caller routes that
request by load only and the fallback is visible.
"""

from __future__ import annotations

import time

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError

from infera_common.logs import get_logger
from infera_common.schemas import OverlapQuery, OverlapReply, decode, encode
from infera_common.subjects import KV_QUERY
from infera_common.tracing import engine_headers

from infera_router.kv_view import KvView, kv_view
from infera_router.metrics import RouterMetrics
from infera_router.state import WorkerState

log = get_logger("router.kv")

FAILURE_LOG_INTERVAL = 30.0


class KvClient:
    def __init__(self, nc: NATS, timeout: float, metrics: RouterMetrics) -> None:
        self.nc = nc
        self.timeout = timeout
        self.metrics = metrics
        self._logged: dict[str, float] = {}

    async def query(self, query: OverlapQuery, candidates: list[WorkerState],
                    trace_context: str | None = None) -> KvView:
        t0 = time.perf_counter()
        try:
            msg = await self.nc.request(KV_QUERY, encode(query), timeout=self.timeout,
                                        headers=engine_headers(trace_context) or None)
        except NoRespondersError:
            return self._failed("no_indexer", "no kv-indexer subscribed")
        except TimeoutError:
            return self._failed("timeout", f"no answer within {self.timeout}s")
        except Exception as exc:  # connection closed, draining, ...
            return self._failed("error", f"{type(exc).__name__}: {exc}")
        finally:
            self.metrics.kv_query_seconds.observe(time.perf_counter() - t0)
        try:
            reply = decode(OverlapReply, msg.data)
        except ValueError as exc:
            return self._failed("bad_reply", str(exc)[:300])
        return kv_view(candidates, reply)

    def _failed(self, reason: str, detail: str) -> KvView:
        self.metrics.kv_query_failures.labels(reason).inc()
        now = time.monotonic()
        if now - self._logged.get(reason, -FAILURE_LOG_INTERVAL) >= FAILURE_LOG_INTERVAL:
            self._logged[reason] = now
            log.warning("kv_query_failed", reason=reason, detail=detail,
                        fallback="load-only routing for the affected requests")
        return KvView.failed(reason)
