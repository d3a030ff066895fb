"""Discovery on the NATS plane: a JetStream KV bucket, one key per worker, kept alive by heartbeats.

``Registrar`` is used by a worker-agent to announce its worker; ``Watcher`` by every service that
needs the live fleet. Liveness bookkeeping itself is the pure ``FleetView``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from nats.js.api import KeyValueConfig, StorageType
from nats.js.client import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from infera_common.fleet import Change, FleetView, notify
from infera_common.logs import get_logger
from infera_common.schemas import WorkerRecord, WorkerStatus, decode, encode
from infera_common.subjects import DISCOVERY_BUCKET
from infera_common.tasks import stop_tasks
from infera_common.worker_claim import Entry, wait_until_free

log = get_logger("discovery")

#: The bucket only cleans storage; liveness comes from each record's own ttl.
BUCKET_MAX_AGE = 120.0


def bucket_stream() -> str:
    """The JetStream stream behind the discovery bucket (JetStream names a KV bucket's stream so)."""
    return f"KV_{DISCOVERY_BUCKET}"


async def open_bucket(js: JetStreamContext) -> KeyValue:
    try:
        return await js.key_value(DISCOVERY_BUCKET)
    except BucketNotFoundError:
        try:
            return await js.create_key_value(
                KeyValueConfig(bucket=DISCOVERY_BUCKET, history=1, ttl=BUCKET_MAX_AGE, storage=StorageType.MEMORY)
            )
        except Exception:  # another service created it first
            return await js.key_value(DISCOVERY_BUCKET)


def late_sweep(due: float, now: float, interval: float) -> bool:
    """Whether a sweep due at ``due`` woke so late (by more than its interval, and at least half a
    second) that its process was stalled: records it would expire may have fresh heartbeats queued."""
    return now - due > max(interval, 0.5)


class Registrar:
    """Keeps one worker record in discovery: put, heartbeat every ttl/3, delete on stop."""

    def __init__(self, js: JetStreamContext, record: WorkerRecord) -> None:
        self._js = js
        self.record = record
        self._kv: KeyValue | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Claim the worker id (``worker_claim``: raises ``WorkerIdTaken`` when a live agent holds it),
        then keep the record alive."""
        self._kv = await open_bucket(self._js)
        await self._claim()
        self._task = asyncio.create_task(self._heartbeat(), name="discovery-heartbeat")

    async def _claim(self) -> None:
        assert self._kv is not None
        while True:
            seen = await wait_until_free(self._read, refreshed_by_put=True)
            self.record = self.record.model_copy(update={"heartbeat_at": time.time()})
            try:
                if seen is None:
                    await self._kv.create(self.record.worker_id, encode(self.record))
                else:  # the entry left behind, unless someone wrote it since
                    await self._kv.update(self.record.worker_id, encode(self.record), last=seen.revision)
                return
            except KeyWrongLastSequenceError:  # another agent wrote it first: watch again
                continue

    async def _read(self) -> Entry[int] | None:
        assert self._kv is not None
        try:
            entry = await self._kv.get(self.record.worker_id)
        except KeyNotFoundError:
            return None
        try:
            return Entry(decode(WorkerRecord, entry.value), entry.revision)
        except ValueError:  # unreadable: taken for one left behind (silent from the start)
            return Entry(self.record.model_copy(update={"heartbeat_at": 0.0, "started_at": 0.0, "ttl": 0.0}),
                         entry.revision)

    async def restore(self) -> None:
        """After a reconnect: the bucket again (a restarted broker lost it) and the record in it now,
        not at the next heartbeat. Nothing once stopped."""
        if self._task is None:
            return
        self._kv = await open_bucket(self._js)
        await self._put()

    async def set_status(self, status: WorkerStatus) -> None:
        self.record = self.record.model_copy(update={"status": status})
        await self._put()

    async def stop(self, leave: bool = True) -> None:
        """Stop beating; ``leave``: delete the entry now (False when the broker cannot be reached: the
        entry then ages out within its TTL, and a delete would only wait out its timeout)."""
        task, self._task = self._task, None
        await stop_tasks(task)
        if self._kv is not None and leave:
            try:
                await self._kv.delete(self.record.worker_id)
            except Exception as exc:  # broker gone: the entry ages out on its own
                log.warning("deregister_failed", worker_id=self.record.worker_id, error=str(exc))

    async def _put(self) -> None:
        assert self._kv is not None
        self.record = self.record.model_copy(update={"heartbeat_at": time.time()})
        await self._kv.put(self.record.worker_id, encode(self.record))

    async def _heartbeat(self) -> None:
        interval = self.record.ttl / 3
        while True:
            await asyncio.sleep(interval)
            try:
                await self._put()
            except Exception as exc:  # keep beating through broker hiccups
                log.warning("heartbeat_failed", worker_id=self.record.worker_id, error=str(exc))
                try:  # the bucket itself may be gone (a restarted broker): the next beat puts it back
                    self._kv = await open_bucket(self._js)
                except Exception:  # still unreachable: try again next beat
                    pass


class Watcher:
    """Follows the discovery bucket into a ``FleetView``; calls ``on_change`` for joins/updates/leaves."""

    def __init__(
        self,
        js: JetStreamContext,
        on_change: Callable[[Change], None] | None = None,
        sweep_interval: float = 0.25,
    ) -> None:
        self._js = js
        self.view = FleetView()
        self._on_change = on_change
        self._sweep_interval = sweep_interval
        self._tasks: list[asyncio.Task] = []
        self._kv_watcher = None
        self._follower: asyncio.Task | None = None
        self._created = None  # when the watched bucket's stream was created (a new one: watch again)
        self.ready = asyncio.Event()

    async def start(self) -> None:
        await self._watch()
        self._tasks = [asyncio.create_task(self._sweep(), name="discovery-sweep")]

    async def restore(self) -> None:
        """After a reconnect: a bucket the broker no longer has, or has anew (it restarted), is
        created if need be and watched again from its start, since the old watch would resume
        at the old bucket's sequence numbers. Records not put back age out by their ttl."""
        if not self._tasks:
            return
        try:
            created = (await self._js.stream_info(bucket_stream())).created
        except NotFoundError:
            created = None
        following = self._follower is not None and not self._follower.done()
        if created is not None and created == self._created and following:
            return  # the same bucket: the watch resumes by itself
        log.info("discovery_rewatch", bucket=DISCOVERY_BUCKET, reason="bucket recreated" if created else "bucket lost")
        await self._unwatch()
        await self._watch()

    async def _watch(self) -> None:
        kv = await open_bucket(self._js)
        self._created = (await self._js.stream_info(bucket_stream())).created
        self._kv_watcher = await kv.watchall()
        self._follower = asyncio.create_task(self._follow(self._kv_watcher), name="discovery-watch")

    async def _unwatch(self) -> None:
        follower, self._follower = self._follower, None
        await stop_tasks(follower)
        kv_watcher, self._kv_watcher = self._kv_watcher, None
        if kv_watcher is not None:
            try:
                await kv_watcher.stop()
            except Exception:  # connection already closed
                pass

    async def stop(self) -> None:
        await stop_tasks(*self._tasks)
        self._tasks = []
        await self._unwatch()

    def _emit(self, change: Change | None) -> None:
        notify(self._on_change, change, log)

    async def _follow(self, kv_watcher) -> None:
        async for entry in kv_watcher:
            if entry is None:  # initial values delivered
                self.ready.set()
                continue
            if entry.operation in (KV_DEL, KV_PURGE):
                self._emit(self.view.delete(entry.key))
                continue
            try:
                record = decode(WorkerRecord, entry.value)
            except ValueError as exc:
                log.warning("bad_worker_record", key=entry.key, error=str(exc))
                continue
            self._emit(self.view.put(record, time.monotonic(), time.time()))

    async def _sweep(self) -> None:
        while True:
            due = time.monotonic() + self._sweep_interval
            await asyncio.sleep(self._sweep_interval)
            if late_sweep(due, time.monotonic(), self._sweep_interval):
                # this process's loop was stalled: heartbeats that came meanwhile wait unread behind
                # this sweep, and ageing the workers out now would take the whole fleet out of its view
                log.warning("discovery_sweep_late", late_s=round(time.monotonic() - due, 2),
                            note="expiry waits one more sweep for the heartbeats received meanwhile")
                continue
            for change in self.view.expire(time.monotonic()):
                log.info("worker_expired", worker_id=change.record.worker_id)
                self._emit(change)
