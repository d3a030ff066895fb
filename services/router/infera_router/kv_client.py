"""The kv-indexer query adapter: one NATS request on ``KV_QUERY`` with a short timeout, carrying the
caller's trace context (``traceparent`` header) when there is one, so the indexer's span joins the trace.

Never raises: any failure becomes ``KvView.failed(reason)`` (reason ``no_indexer``, ``timeout``,
``error`` or ``bad_reply``), counted in ``infera_router_kv_query_failures_total{reason}`` and
logged at most once per reason per ``FAILURE_LOG_INTERVAL`` seconds, so the caller routes that
request by load only and the fallback is visible.

"No responders" from a fleet whose indexer answered within ``RECENT`` seconds is asked again every
``NO_INDEXER_PAUSE`` seconds for up to ``NO_INDEXER_WAIT``: after a broker restart each service
reconnects in its own time (nats-py tries every 0.5 s), and a kv-indexer back half a second after
the router had its first prompts routed blind, their cached prefixes computed again elsewhere (a
broker-restart test). An indexer that stays away costs each request that wait only until the
indexer has been silent for ``RECENT`` seconds.

A query that times out may have gone to a frozen indexer, which the queue group goes on handing
its share of the queries until nats-server drops it (20-30 s): each routed on load alone, its
cached prefix missed. So for ``answering.WARY_FOR`` seconds after a timeout the queries go to the
first indexer that answers ``KV_PING`` (asked again every ``PICK_FOR`` seconds), on its own
subject (``infera_router_kv_queries_direct_total``); to the queue group when none answers.
"""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError

from infera_common.answering import Wary, first_to_answer
from infera_common.logs import get_logger
from infera_common.schemas import OverlapQuery, encode
from infera_common.subjects import KV_PING, KV_QUERY, kv_query_subject
from infera_common.tracing import engine_headers

from infera_router.kv_view import KvView, read_reply
from infera_router.metrics import RouterMetrics
from infera_router.state import WorkerState

log = get_logger("router.kv")

FAILURE_LOG_INTERVAL = 30.0
NO_INDEXER_WAIT = 1.0
NO_INDEXER_PAUSE = 0.05
RECENT = 30.0
#: Seconds one indexer's answer to the ping is used for, while wary.
PICK_FOR = 1.0


class KvClient:
    def __init__(self, nc: NATS, timeout: float, metrics: RouterMetrics) -> None:
        self.nc = nc
        self.timeout = timeout
        self.metrics = metrics
        self._logged: dict[str, float] = {}
        self._answered = float("-inf")  # when an indexer last answered (monotonic)
        self._wary = Wary()  # after a query timed out: to an indexer that answers the ping
        self._pick: tuple[str | None, float] = (None, float("-inf"))  # that indexer, and until when

    async def query(self, query: OverlapQuery, candidates: list[WorkerState],
                    trace_context: str | None = None) -> KvView:
        t0 = time.perf_counter()
        data, headers = encode(query), engine_headers(trace_context) or None
        wait_until: float | None = None
        subject = await self._subject(time.monotonic())
        try:
            while True:
                try:
                    msg = await self.nc.request(subject, data, timeout=self.timeout, headers=headers)
                    self._answered = time.monotonic()
                    break
                except NoRespondersError:
                    if subject != KV_QUERY:  # the indexer picked left in the meantime: the queue group
                        subject, self._pick = KV_QUERY, (None, float("-inf"))
                        continue
                    now = time.monotonic()
                    if wait_until is None:
                        wait_until = now + (NO_INDEXER_WAIT if now - self._answered < RECENT else 0.0)
                    if now >= wait_until:
                        return self._failed("no_indexer", "no kv-indexer subscribed")
                    await asyncio.sleep(NO_INDEXER_PAUSE)
        except TimeoutError:
            self._wary.silence(time.monotonic())
            self._pick = (None, float("-inf"))
            return self._failed("timeout", f"no answer within {self.timeout}s")
        except Exception as exc:  # connection closed, draining, ...
            return self._failed("error", f"{type(exc).__name__}: {exc}")
        finally:
            self.metrics.kv_query_seconds.observe(time.perf_counter() - t0)
        try:
            return read_reply(candidates, msg.data)
        except ValueError as exc:
            return self._failed("bad_reply", str(exc)[:300])

    async def _subject(self, now: float) -> str:
        """Where to send a query: the queue group, or while wary the indexer that answers the ping."""
        if not self._wary.active(now):
            return KV_QUERY
        indexer, until = self._pick
        if now >= until:
            indexer = await first_to_answer(self.nc, KV_PING, self.timeout)
            self._pick = (indexer, now + PICK_FOR)
        if indexer is None:
            return KV_QUERY
        self.metrics.kv_queries_direct.inc()
        return kv_query_subject(indexer)

    def _failed(self, reason: str, detail: str) -> KvView:
        self.metrics.kv_query_failures.labels(reason).inc()
        now = time.monotonic()
        if now - self._logged.get(reason, -FAILURE_LOG_INTERVAL) >= FAILURE_LOG_INTERVAL:
            self._logged[reason] = now
            log.warning("kv_query_failed", reason=reason, detail=detail,
                        fallback="load-only routing for the affected requests")
        return KvView.failed(reason)
