"""The router's own copy of the KV index (``--kv-index local``): no kv-indexer round trip per request.

The JetStream KV event stream is replayed from its start and then followed in this process, with
the kv-indexer's own code (``infera_common.kv_index``); the router's discovery watcher tells it who
joins and leaves. A kv-aware pick then reads the index directly, so the request skips the NATS
request/reply to the kv-indexer and the wake-ups of two more processes (at concurrency 1 on the
NATS plane that round trip is ~1.3 ms; under load each wake-up waits for a core too). The price:
every router holds the whole index and applies every event itself. The kv-indexer service is the
default (``--kv-index remote``) and the place for index metrics per worker; both answer the same.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from nats.js.client import JetStreamContext

from infera_common.fleet import Change
from infera_common.kv_index.held import HeldCache
from infera_common.kv_index.index import UNATTACHED_GRACE, KvIndex
from infera_common.kv_index.ingest import ingest
from infera_common.kv_index.stream import StreamFollower
from infera_common.logs import get_logger
from infera_common.schemas import OverlapQuery

from infera_router.kv_view import KvView, depth_view
from infera_router.metrics import RouterMetrics
from infera_router.state import WorkerState

log = get_logger("router.kv_local")



class LocalKvIndex:
    """The KV index kept in the router; ``answer`` is its overlap query, answered in place."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.index = KvIndex()
        self._held = HeldCache(self.index, list, time.monotonic)  # each worker's holding, reused a moment
        self.metrics = metrics
        self._stream: StreamFollower | None = None

    async def start(self, js: JetStreamContext, resync: Callable[[], Awaitable[None]] | None = None) -> None:
        """Replay the stream's history (returns once applied), then keep following it; ``resync``
        asks the worker-agents for their whole holding (``StreamFollower``)."""
        self._stream = StreamFollower(js, self._on_message, self.metrics.kv_index_replaying, resync)
        await self._stream.prepare(None, None)  # the stream's limits are the kv-indexer's to set
        await self._stream.replay()

    async def restore(self) -> None:
        """After a reconnect: follow the stream again if the broker lost or recreated it."""
        if self._stream is not None:
            await self._stream.restore()

    async def stop(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None

    def on_change(self, change: Change) -> None:
        record = change.record
        if change.kind == "leave":
            self.index.worker_left(record.worker_id, time.time())
        else:
            self.index.worker_joined(record.worker_id, record.model, record.kv_index_block_size, record.started_at)

    def expire(self) -> None:
        """Drop the blocks of workers discovery has not listed within ``UNATTACHED_GRACE``."""
        for worker_id in self.index.expire_unattached(time.time(), UNATTACHED_GRACE):
            log.info("unattached_worker_dropped", worker_id=worker_id, grace=UNATTACHED_GRACE)

    def answer(self, query: OverlapQuery, candidates: list[WorkerState]) -> KvView:
        overlaps, unseen = self.index.depths(query.model, query.hashes, query.workers)
        view = depth_view(candidates, overlaps, unseen, self._held.get(query.model, query.workers))
        view.hashes = query.hashes
        return view

    def _on_message(self, subject: str, data: bytes) -> None:
        try:
            result = ingest(self.index, subject, data, time.time())
        except Exception:  # a bug must not stop the follower
            self.metrics.kv_index_messages.labels("failed").inc()
            log.exception("kv_event_failed", subject=subject)
            return
        if result.malformed is not None:
            self.metrics.kv_index_messages.labels("malformed").inc()
            log.warning("kv_event_malformed", kind=result.malformed, error=result.error, subject=subject)
        else:
            self.metrics.kv_index_messages.labels("applied").inc()
