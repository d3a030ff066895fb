"""Following the ZMQ KV-event publishers of the workers on ``--kv-event-transport zmq`` (an adapter).

Driven by discovery: ``on_record`` for every join/update, ``on_leave`` for every leave (both
synchronous, as discovery calls them). Each followed worker has one ``KvZmqReader`` (one SUB socket
per DP rank on one shared ZMQ context) whose in-order batches go to ``apply``; its first replay
from seq 0 rebuilds what the engine published before the indexer (or the worker's record) came.
``zmq_plan.decide`` says what a record change means; an engine restart, from discovery (a new
``started_at``) or from the publisher (its seq went back), goes to ``clear`` before the new
engine's batches are applied.

The engine's replay buffer holds only its last batches (``buffer_steps``): blocks stored before
them, and every block later stored on top of them (their parent unknown), would stay unknown to an
index that starts following a worker late (a restarted ``infera.server``). So when the record
names the agent's ``kv_state_url`` (the agent follows the same events with the same translation),
the index reads it first (``restore``: each rank's translator and the seq of its last batch) and
opens the publishers after: their replay then brings only the batches after that seq, which
continue from that translator.

A reader that was replaced or whose worker left is closed in the background; its batches still in
flight are dropped (only the current reader of a worker applies anything), so a worker that left is
never re-created in the index by a late batch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import aiohttp
import msgpack
import zmq.asyncio

from infera_common.kv_zmq import KvReadObserver, KvZmqReader, ZmqKvSource
from infera_common.logs import get_logger
from infera_common.schemas import WorkerRecord

from infera_kv_indexer.metrics import KvIndexerMetrics
from infera_kv_indexer.zmq_plan import WorkerFeed, decide, feed_for

log = get_logger("kv_indexer.zmq")

#: ``apply(worker_id, dp_rank, seq, payload)``: one in-order engine batch of the worker's publisher of
#: rank ``dp_rank``, applied as the returned iterator is consumed (the loop runs other work between its items)
Apply = Callable[[str, int, int, bytes], Iterator[None]]
#: ``clear(worker_id, dp_rank or None for every rank, reason)``: the worker's engine restarted empty
Clear = Callable[[str, int | None, str], None]
#: ``restore(worker_id, states)``: the worker-agent's ``{"dp_rank", "seq", "translator"}`` per rank
#: (its ``/kv_state``); returns how many ranks were restored
Restore = Callable[[str, list[dict]], int]


class _Followed(KvReadObserver):
    """One followed worker: its feed, its reader, and the reader's reports as metrics."""

    def __init__(self, follower: ZmqFollower, worker_id: str, feed: WorkerFeed) -> None:
        self.follower = follower
        self.worker_id = worker_id
        self.feed = feed
        self.connected_count = 0
        self._begin: asyncio.Task | None = None  # reading the agent's state before the publishers
        self.reader = KvZmqReader(
            feed.sources, self._on_batch, on_restart=self._on_restart, observer=self,
            replay_timeout=follower.replay_timeout, context=follower.context(), monitor=True,
            log_fields={"worker_id": worker_id},
        )

    @property
    def current(self) -> bool:
        return self.follower.followed.get(self.worker_id) is self

    def begin(self, with_state: bool) -> None:
        """Start reading the publishers; first, when ``with_state`` and the record names one, the
        agent's state of the engine."""
        if with_state and self.feed.state_url and self.follower.restore is not None:
            self._begin = asyncio.create_task(self._state_then_read(self.feed.state_url),
                                              name=f"kv-state-{self.worker_id}")
        else:
            self.reader.start()

    async def _state_then_read(self, url: str) -> None:
        t0 = time.monotonic()
        try:
            states = await self.follower.fetch_state(url)
            if self.current and self.follower.restore is not None:
                restored = self.follower.restore(self.worker_id, states)
                self.follower.metrics.zmq_states.labels("read").inc()
                log.info("kv_state_read", worker_id=self.worker_id, url=url, ranks=len(states), restored=restored,
                         seconds=round(time.monotonic() - t0, 3))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an older agent, or unreachable: the engine's replay buffer is what there is
            self.follower.metrics.zmq_states.labels("failed").inc()
            log.warning("kv_state_unread", worker_id=self.worker_id, url=url, error=str(exc) or type(exc).__name__,
                        hint="blocks stored before the engine's replay buffer stay unknown until evicted")
        if self.current:
            self.reader.start()

    async def close(self) -> None:
        if self._begin is not None:
            self._begin.cancel()
            await asyncio.gather(self._begin, return_exceptions=True)
        await self.reader.close()

    async def _on_batch(self, source: ZmqKvSource, seq: int, payload: bytes) -> None:
        if self.current:
            self.follower.metrics.zmq_batches.inc()
            steps = self.follower.apply(self.worker_id, source.dp_rank, seq, payload)
            try:
                for _ in steps:
                    await asyncio.sleep(0)
            except asyncio.CancelledError:  # the reader is closing (replaced): apply the rest at once, or
                for _ in steps:  # the seq counts as applied with half its blocks missing
                    pass
                raise

    async def _on_restart(self, source: ZmqKvSource, seq: int) -> None:
        if self.current:
            self.follower.metrics.zmq_restarts.labels("seq").inc()
            self.follower.clear(self.worker_id, source.dp_rank, "engine_restarted_seq")

    # --- KvReadObserver ---
    def connected(self, source: ZmqKvSource, up: bool) -> None:
        self.connected_count += 1 if up else -1
        if self.current:
            self.follower.metrics.set_zmq_endpoints(self.worker_id, self.connected_count)

    def malformed(self, source: ZmqKvSource, reason: str) -> None:
        self.follower.metrics.malformed.labels("zmq").inc()

    def gap_detected(self, source: ZmqKvSource, missing: range) -> None:
        self.follower.metrics.zmq_gaps.labels("detected").inc()

    def gap_closed(self, source: ZmqKvSource, missing: range, lost: int) -> None:
        m = self.follower.metrics
        if lost:
            m.zmq_gaps.labels("unrecoverable").inc()
            m.zmq_lost.inc(lost)
        else:
            m.zmq_gaps.labels("filled").inc()

    def replayed(self, source: ZmqKvSource, batches: int) -> None:
        self.follower.metrics.zmq_replayed.inc(batches)


class ZmqFollower:
    def __init__(self, apply: Apply, clear: Clear, metrics: KvIndexerMetrics, replay_timeout: float,
                 restore: Restore | None = None) -> None:
        self.apply = apply
        self.clear = clear
        self.restore = restore
        self._session: aiohttp.ClientSession | None = None
        self.metrics = metrics
        self.replay_timeout = replay_timeout
        self.followed: dict[str, _Followed] = {}
        self._closing: set[asyncio.Task] = set()
        self._ctx: zmq.asyncio.Context | None = None

    def context(self) -> zmq.asyncio.Context:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        return self._ctx

    # --- discovery (synchronous: called from the watcher's callback) --------------------------------
    def on_record(self, record: WorkerRecord) -> None:
        worker_id = record.worker_id
        old = self.followed.get(worker_id)
        new = feed_for(record)
        action = decide(old.feed if old is not None else None, new)
        if action == "keep":
            return
        if old is not None:
            self._retire(worker_id)
        if action == "restart":
            self.metrics.zmq_restarts.labels("record").inc()
            self.clear(worker_id, None, "engine_restarted_record")
        if new is not None:
            followed = self.followed[worker_id] = _Followed(self, worker_id, new)
            self.metrics.set_zmq_endpoints(worker_id, 0)
            followed.begin(with_state=action != "restart")  # (a restarted engine holds nothing yet)
        else:
            self.metrics.forget_zmq_worker(worker_id)
        self.metrics.zmq_workers.set(len(self.followed))
        log.info("kv_zmq_follow", worker_id=worker_id, action=action, started_at=record.started_at,
                 sources=[(s.dp_rank, s.endpoint, s.replay_endpoint) for s in new.sources] if new else [])

    def on_leave(self, worker_id: str) -> None:
        if worker_id in self.followed:
            self._retire(worker_id)
            self.metrics.zmq_workers.set(len(self.followed))
            log.info("kv_zmq_follow", worker_id=worker_id, action="leave")
        self.metrics.forget_zmq_worker(worker_id)

    async def fetch_state(self, url: str) -> list[dict]:
        """The agent's per-rank states at ``url`` (within the replay timeout); raises when unreadable."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        timeout = aiohttp.ClientTimeout(total=self.replay_timeout)
        async with self._session.get(url, timeout=timeout) as resp:
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            states = msgpack.unpackb(await resp.read(), raw=False, strict_map_key=False)
        if not isinstance(states, list) or not all(isinstance(state, dict) for state in states):
            raise ValueError("not a msgpack array of rank states")
        return states

    def _retire(self, worker_id: str) -> None:
        followed = self.followed.pop(worker_id)
        task = asyncio.create_task(followed.close(), name=f"kv-zmq-close-{worker_id}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    # --- lifecycle ---------------------------------------------------------------------------------
    async def wait_ready(self, timeout: float) -> list[str]:
        """Wait (at most ``timeout`` s) until every followed worker's first replay is over; returns the
        workers still replaying."""
        pending = {wid: f.reader.ready for wid, f in self.followed.items() if not f.reader.ready.is_set()}
        if pending:
            waits = [asyncio.create_task(ready.wait()) for ready in pending.values()]
            _, late = await asyncio.wait(waits, timeout=timeout)
            for task in late:
                task.cancel()
        return sorted(wid for wid, ready in pending.items() if not ready.is_set())

    async def close(self) -> None:
        for worker_id in list(self.followed):
            self._retire(worker_id)
        await asyncio.gather(*list(self._closing), return_exceptions=True)
        self.metrics.zmq_workers.set(0)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
        if self._session is not None:
            await self._session.close()
            self._session = None
