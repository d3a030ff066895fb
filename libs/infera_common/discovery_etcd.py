"""Discovery on etcd (``--discovery-backend etcd``): one key per worker, bound to a lease.

Same interface and behaviour as the NATS backend (``discovery.py``): ``EtcdRegistrar`` is used by a
worker-agent to announce its worker, ``EtcdWatcher`` by every service that needs the live fleet,
feeding the same pure ``FleetView`` and calling ``on_change`` with the same ``Change`` kinds.

Layout: key ``/infera/workers/<worker_id>`` (``WORKERS_PREFIX``), value the ``WorkerRecord`` as JSON
(readable with ``etcdctl get --prefix /infera/workers/``), attached to the registrar's lease.

Liveness is etcd's lease, not the record's ``heartbeat_at``: the lease TTL is the record's ``ttl``
(``--discovery-ttl``, default 6 s) rounded up to whole seconds, at least ``MIN_LEASE_TTL`` (etcd's
own floor) and at most ``MAX_LEASE_TTL`` = 30 s. The registrar refreshes the lease every TTL/3. A
clean stop revokes the lease, so watchers see the leave at once; a killed agent's key is deleted by
etcd when its lease expires, at most one TTL after its last refresh (after an etcd restart etcd
grants every lease a fresh TTL, so the count starts again then). A registrar that finds its lease
gone (it was cut off from etcd for longer than the TTL) grants a new one and puts its record again;
after any keepalive failure it re-puts its record as soon as etcd answers.

The watcher lists the prefix, sets ``ready``, then watches from the listed revision. After any
break (etcd restarted, connection cut, watch cancelled by compaction) it re-lists and diffs the
listing against what it knew (``diff_listing``), so a join or leave that happened while it was cut
off is reported, then watches again. While etcd is unreachable it keeps its last view (engines keep
serving; etcd decides liveness) and retries every ``retry_interval``. A cut that leaves the TCP
stream half-open is caught by a status probe every ``probe_interval``.

Client: etcd's own JSON gateway over aiohttp (``etcd_gateway.py``), not a PyPI etcd client. The
gateway is part of every etcd 3.5 server on the client URL, so nothing else needs to run; aiohttp is
already a dependency; the asyncio gRPC clients (aetcd and kin) pull grpcio + protobuf, which would
be the heaviest dependency of the whole plane for five calls, and the older ones (python-etcd3,
aioetcd3, etcd3-py) are sync or unmaintained. The watch semantics this module needs (list, watch
from revision, re-list after a break) would have to be written on top of any of them anyway.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping

from pydantic import ValidationError

from infera_common.subjects import ETCD_WORKERS_PREFIX as WORKERS_PREFIX
from infera_common.etcd_gateway import EtcdClient, EtcdError, EtcdUnavailable, KeyValue
from infera_common.fleet import Change, FleetView, notify
from infera_common.logs import get_logger
from infera_common.schemas import WorkerRecord, WorkerStatus
from infera_common.tasks import stop_tasks
from infera_common.worker_claim import Entry, wait_until_free

log = get_logger("discovery.etcd")

#: etcd refuses shorter leases (it raises them to ~2 s with its default election timeout).
MIN_LEASE_TTL = 2
#: The longest lease this backend takes: a killed worker is gone from every view within it.
MAX_LEASE_TTL = 30


def lease_ttl(record_ttl: float) -> int:
    """The etcd lease TTL (whole seconds) for a record whose ``ttl`` is ``record_ttl``."""
    return min(MAX_LEASE_TTL, max(MIN_LEASE_TTL, math.ceil(record_ttl)))


def diff_listing(known: Mapping[str, int], listed: Mapping[str, int]) -> tuple[list[str], list[str]]:
    """Compare what a watcher knew (id -> mod revision) with a fresh listing.

    Returns ``(gone, changed)``: ids known but no longer listed, and ids listed that are new or
    were modified since (their mod revision differs), each sorted.
    """
    gone = sorted(wid for wid in known if wid not in listed)
    changed = sorted(wid for wid, rev in listed.items() if known.get(wid) != rev)
    return gone, changed


def _client(endpoint: str | EtcdClient) -> tuple[EtcdClient, bool]:
    if isinstance(endpoint, EtcdClient):
        return endpoint, False
    return EtcdClient(endpoint), True


class EtcdRegistrar:
    """Keeps one worker record in etcd: put under a lease, refresh every TTL/3, revoke on stop."""

    def __init__(self, endpoint: str | EtcdClient, record: WorkerRecord, *, prefix: str = WORKERS_PREFIX,
                 retry_interval: float = 0.5) -> None:
        self._client, self._owns_client = _client(endpoint)
        self.record = record
        self.key = prefix + record.worker_id
        self.lease_id: int | None = None
        self.lease_ttl = lease_ttl(record.ttl)
        self._retry = retry_interval
        self._dirty = False  # the record in etcd may be stale: put it again when etcd answers
        self._task: asyncio.Task | None = None

    async def start(self, retry_for: float = 0.0) -> None:
        """Claim the worker id and register (``worker_claim``: raises ``WorkerIdTaken`` when a live
        agent holds the id); keep trying for ``retry_for`` seconds while etcd is unreachable, then raise."""
        deadline = time.monotonic() + retry_for
        while True:
            try:
                await self._register(claim=True)
                break
            except EtcdUnavailable:
                if time.monotonic() >= deadline:
                    await self._close()
                    raise
                await asyncio.sleep(self._retry)
            except BaseException:
                await self._close()
                raise
        log.info("etcd_registered", worker_id=self.record.worker_id, lease=self.lease_id, ttl=self.lease_ttl)
        self._task = asyncio.create_task(self._keepalive(), name="discovery-etcd-keepalive")

    async def set_status(self, status: WorkerStatus) -> None:
        """Publish a new status; if etcd is unreachable now, it is put as soon as etcd answers."""
        self.record = self.record.model_copy(update={"status": status})
        try:
            await self._put()
        except (EtcdUnavailable, EtcdError) as exc:
            self._dirty = True
            log.warning("etcd_put_deferred", worker_id=self.record.worker_id, status=str(status), error=str(exc))

    async def restore(self) -> None:
        """Nothing to redo when NATS reconnects: etcd keeps the fleet, and this class follows it itself."""

    async def stop(self, leave: bool = True) -> None:
        """Stop refreshing; ``leave``: revoke the lease now (False: it expires within its TTL)."""
        task, self._task = self._task, None
        await stop_tasks(task)
        if self.lease_id is not None and leave:
            try:
                await self._client.revoke(self.lease_id)
            except (EtcdUnavailable, EtcdError) as exc:  # etcd gone: the lease expires on its own
                log.warning("etcd_revoke_failed", worker_id=self.record.worker_id, error=str(exc))
            self.lease_id = None
        await self._close()

    async def _close(self) -> None:
        if self._owns_client:
            await self._client.close()

    async def _register(self, claim: bool = False) -> None:
        """A new lease and the record under it; ``claim``: only once no other live agent holds the id
        (a lease that expired under this agent is its own key: put again without asking)."""
        if claim:
            await wait_until_free(self._read, refreshed_by_put=False)
        self.lease_id, granted = await self._client.grant(lease_ttl(self.record.ttl))
        self.lease_ttl = granted
        self.record = self.record.model_copy(update={"ttl": float(granted)})
        while claim:
            self.record = self.record.model_copy(update={"heartbeat_at": time.time()})
            if await self._client.create(self.key, self.record.model_dump_json().encode(), self.lease_id):
                self._dirty = False
                return
            await wait_until_free(self._read, refreshed_by_put=False)  # another agent wrote it first
        await self._put()

    async def _read(self) -> Entry[int] | None:
        kv = await self._client.get(self.key)
        if kv is None:
            return None
        try:
            return Entry(WorkerRecord.model_validate_json(kv.value), kv.mod_revision)
        except ValueError:  # unreadable: the lease behind it decides, as for any other holder
            return Entry(self.record.model_copy(update={"heartbeat_at": 0.0, "started_at": 0.0}), kv.mod_revision)

    async def _put(self) -> None:
        self.record = self.record.model_copy(update={"heartbeat_at": time.time()})
        await self._client.put(self.key, self.record.model_dump_json().encode(), self.lease_id or 0)
        self._dirty = False

    async def _keepalive(self) -> None:
        healthy = True
        while True:
            await asyncio.sleep(self.lease_ttl / 3 if healthy else self._retry)
            try:
                if not self.lease_id or await self._client.keepalive(self.lease_id) <= 0:
                    log.warning("etcd_lease_lost", worker_id=self.record.worker_id, lease=self.lease_id)
                    await self._register()
                    log.info("etcd_registered", worker_id=self.record.worker_id, lease=self.lease_id)
                elif self._dirty or not healthy:
                    await self._put()
                if not healthy:
                    log.info("etcd_keepalive_resumed", worker_id=self.record.worker_id, lease=self.lease_id)
                healthy = True
            except Exception as exc:  # keep refreshing through etcd outages
                if healthy:
                    log.warning("etcd_keepalive_failed", worker_id=self.record.worker_id, error=str(exc))
                healthy = False


class EtcdWatcher:
    """Follows the workers' prefix into a ``FleetView``; calls ``on_change`` for joins/updates/leaves."""

    def __init__(
        self,
        endpoint: str | EtcdClient,
        on_change: Callable[[Change], None] | None = None,
        *,
        prefix: str = WORKERS_PREFIX,
        retry_interval: float = 0.5,
        probe_interval: float = 2.0,
    ) -> None:
        self._client, self._owns_client = _client(endpoint)
        self._prefix = prefix
        self._on_change = on_change
        self._retry = retry_interval
        self._probe_interval = probe_interval
        self.view = FleetView()
        self.ready = asyncio.Event()
        self.bad_records = 0  # values under the prefix that are not a WorkerRecord for their key
        self.relists = 0  # listings after the first (one per reconnect)
        self._revs: dict[str, int] = {}  # worker id -> mod revision of what the view holds
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """List the fleet (raises ``EtcdUnavailable`` if etcd cannot be reached), then follow it."""
        try:
            revision = await self._relist()
        except BaseException:
            if self._owns_client:
                await self._client.close()
            raise
        self.ready.set()
        self._task = asyncio.create_task(self._run(revision), name="discovery-etcd-watch")

    async def restore(self) -> None:
        """Nothing to redo when NATS reconnects: etcd keeps the fleet, and this class follows it itself."""

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_tasks(task)
        if self._owns_client:
            await self._client.close()

    def _emit(self, change: Change | None) -> None:
        notify(self._on_change, change, log)

    async def _run(self, revision: int | None) -> None:
        while True:
            try:
                if revision is None:
                    revision = await self._relist()
                    self.relists += 1
                    log.info("etcd_watch_resumed", workers=len(self.view), revision=revision)
                await self._follow(revision + 1)
            except (EtcdUnavailable, EtcdError) as exc:
                if revision is not None:  # first failure of this outage
                    log.warning("etcd_watch_lost", error=str(exc))
                revision = None
                await asyncio.sleep(self._retry)
            except Exception:  # a bug or a surprise from the wire: never stop following
                log.exception("etcd_watch_failed")
                revision = None
                await asyncio.sleep(self._retry)

    async def _follow(self, start_revision: int) -> None:
        """Apply watch events until the stream breaks or the status probe fails; always raises."""
        watch = asyncio.create_task(self._consume(start_revision))
        probe = asyncio.create_task(self._probe())
        try:
            done, _ = await asyncio.wait({watch, probe}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (watch, probe):
                t.cancel()
            await asyncio.gather(watch, probe, return_exceptions=True)
        for t in done:
            t.result()
        raise EtcdUnavailable("watch ended")

    async def _consume(self, start_revision: int) -> None:
        async for batch in self._client.watch_prefix(self._prefix, start_revision):
            for event in batch:
                wid = event.kv.key[len(self._prefix):]
                if event.kind == "delete":
                    self._revs.pop(wid, None)
                    self._emit(self.view.delete(wid))
                else:
                    self._apply(wid, event.kv)

    async def _probe(self) -> None:
        while True:
            await asyncio.sleep(self._probe_interval)
            await self._client.status()

    async def _relist(self) -> int:
        revision, kvs = await self._client.range_prefix(self._prefix)
        listed = {kv.key[len(self._prefix):]: kv for kv in kvs}
        gone, changed = diff_listing(self._revs, {wid: kv.mod_revision for wid, kv in listed.items()})
        for wid in gone:
            self._revs.pop(wid, None)
            self._emit(self.view.delete(wid))
        for wid in changed:
            self._apply(wid, listed[wid])
        return revision

    def _apply(self, wid: str, kv: KeyValue) -> None:
        self._revs[wid] = kv.mod_revision
        try:
            record = WorkerRecord.model_validate_json(kv.value)
            if record.worker_id != wid:
                raise ValueError(f"record names worker {record.worker_id!r}")
        except (ValidationError, ValueError) as exc:
            self.bad_records += 1
            log.warning("bad_worker_record", key=kv.key, error=str(exc)[:300])
            return
        self._emit(self.view.put(record, time.monotonic(), time.time()))
