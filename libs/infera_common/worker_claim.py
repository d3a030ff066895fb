"""One worker id, one live agent: a worker-agent claims its id in discovery before its engine starts.

Two agents given the same ``--worker-id`` (one runbook line copied to two nodes) would share one
discovery entry, one request queue and one entry of the KV index: each overwrote the other's
record, and when one stopped it took the entry of the other with it (on etcd for good: the key
went with the stopped agent's lease while the other kept refreshing its own). So the first put of
a record is a claim. An entry already there is a live agent's, or what a stopped one left (one
killed before it could deregister, restarted under the same id before its entry aged out). The
two are told apart by watching the entry for one TTL (``verdict``, pure): a live agent refreshes
it (NATS: every heartbeat, TTL/3, puts the record again; etcd: keep-alives hold the key, which a
dead agent's lease drops within its TTL). Then the record is written only if nobody wrote it in
between (NATS: create, or update at the revision seen; etcd: a transaction on the key's version),
so two agents started at the same moment cannot both win.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from infera_common.logs import get_logger
from infera_common.schemas import WorkerRecord

log = get_logger("worker_claim")

Verdict = Literal["free", "taken", "wait"]
#: Seconds past an entry's TTL before a silent one counts as left behind (a heartbeat's own delay).
MARGIN = 1.0
#: Seconds between looks at an entry while telling the two apart.
POLL = 0.25

R = TypeVar("R")  # a backend's revision of an entry


class WorkerIdTaken(Exception):
    """Another live agent holds this worker id."""

    def __init__(self, holder: WorkerRecord) -> None:
        self.holder = holder
        age = max(0.0, time.time() - holder.started_at)
        super().__init__(
            f"worker id {holder.worker_id!r} is held by another live worker-agent (its engine at {holder.url}, "
            f"{holder.engine}, status {holder.status}, started {age:.0f} s ago): give every agent its own --worker-id "
            "(or none: the default is a random one)")


@dataclass(frozen=True, slots=True)
class Entry(Generic[R]):
    record: WorkerRecord
    revision: R


def verdict(first: WorkerRecord | None, latest: WorkerRecord | None, waited: float, *,
            refreshed_by_put: bool) -> Verdict:
    """Whether the id whose entry read ``first`` when the watch began and ``latest`` now (None: no
    entry), ``waited`` seconds later, is free to claim. ``refreshed_by_put``: the backend's live
    holders put their record again to stay listed (NATS), rather than keep a lease (etcd)."""
    if latest is None:
        return "free"
    if first is None or (latest.heartbeat_at, latest.started_at) != (first.heartbeat_at, first.started_at):
        return "taken"  # written while we watched: its agent is alive
    if waited < latest.ttl + MARGIN:
        return "wait"
    # one TTL and nothing: a record that is refreshed by puts was left behind; a key still held
    # by its lease has a live agent keeping it
    return "free" if refreshed_by_put else "taken"


async def wait_until_free(read: Callable[[], Awaitable[Entry[R] | None]], *, refreshed_by_put: bool,
                          clock: Callable[[], float] = time.monotonic) -> Entry[R] | None:
    """Watch the id's entry until ``verdict`` decides: the entry seen last when it is free (None: there
    is none), ``WorkerIdTaken`` when another live agent holds it."""
    t0 = clock()
    first = await read()
    latest = first
    while True:
        decided = verdict(first.record if first else None, latest.record if latest else None, clock() - t0,
                          refreshed_by_put=refreshed_by_put)
        if decided == "free":
            return latest
        if decided == "taken":
            assert latest is not None
            raise WorkerIdTaken(latest.record)
        if latest is first:
            assert latest is not None
            log.info("worker_id_in_discovery", worker_id=latest.record.worker_id, url=latest.record.url,
                     ttl=latest.record.ttl, note="an entry holds this worker id: waiting up to its ttl to tell "
                     "a live agent from one left behind")
        await asyncio.sleep(POLL)
        latest = await read()
