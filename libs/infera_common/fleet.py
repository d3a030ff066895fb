"""The live fleet as seen from discovery: pure bookkeeping, no I/O.

Liveness is decided by the registrant: each record carries its ``ttl`` and the wall-clock
time of its last heartbeat. A record not refreshed within its ``ttl`` is expired by ``expire``.

How late a heartbeat arrives (``put``) is read on the registrant's clock, which may be any distance
from this one: against the least late of the worker's last ``LATENESS_SAMPLES`` heartbeats, not
against zero. Read against zero, a worker whose host clock ran a TTL (6 s) behind the watcher's
was expired right after every heartbeat and listed again at the next: it flapped out of every
router's and frontend's view. What the difference measures is the part of the delay that is not
the clocks' offset: a watcher that was stalled, or read a heartbeat late, still ages it. A worker
seen for the first time (no history: a watcher's first snapshot, say) is read against zero but
given at least ``FIRST_SIGHT_SHARE`` of its ttl, more than one heartbeat period (``ttl/3``): a live
worker on a skewed clock beats again before that, and an entry its agent left stale (killed)
goes within half a TTL.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from infera_common.schemas import WorkerRecord, WorkerStatus

ChangeKind = Literal["join", "update", "leave"]


@dataclass(frozen=True, slots=True)
class Change:
    kind: ChangeKind
    record: WorkerRecord


def notify(on_change: Callable[[Change], None] | None, change: Change | None, log: Any) -> None:
    """Tell a watcher's callback of ``change`` (None: nothing changed); a callback that raises is
    logged on ``log``, and the watch goes on (one bad record never stops discovery)."""
    if change is not None and on_change is not None:
        try:
            on_change(change)
        except Exception:
            log.exception("discovery_callback_failed", worker_id=change.record.worker_id)


#: How many of a worker's latest heartbeats the offset of its clock is read from (the least late).
LATENESS_SAMPLES = 4
#: The share of its ttl a worker seen for the first time is given at least (more than the ttl/3
#: between two heartbeats), whatever its heartbeat time says.
FIRST_SIGHT_SHARE = 0.5


class FleetView:
    def __init__(self) -> None:
        self._records: dict[str, WorkerRecord] = {}
        self._deadline: dict[str, float] = {}  # monotonic time at which the entry ages out
        self._late: dict[str, deque[float]] = {}  # per worker: its last heartbeats' now_wall - heartbeat_at

    def put(self, record: WorkerRecord, now_mono: float, now_wall: float) -> Change:
        """Apply a registration or heartbeat received at ``now_mono`` (``now_wall`` on this clock)."""
        wid = record.worker_id
        late = now_wall - record.heartbeat_at
        seen = self._late.get(wid)
        if seen is None:
            seen = self._late[wid] = deque(maxlen=LATENESS_SAMPLES)
            age = min(max(late, 0.0), record.ttl * FIRST_SIGHT_SHARE)
        else:
            age = min(max(late - min(seen), 0.0), record.ttl)
        seen.append(late)
        kind: ChangeKind = "update" if wid in self._records else "join"
        self._records[wid] = record
        self._deadline[wid] = now_mono - age + record.ttl
        return Change(kind, record)

    def delete(self, worker_id: str) -> Change | None:
        record = self._records.pop(worker_id, None)
        self._deadline.pop(worker_id, None)
        self._late.pop(worker_id, None)
        return Change("leave", record) if record is not None else None

    def expire(self, now_mono: float) -> list[Change]:
        gone = [wid for wid, deadline in self._deadline.items() if deadline <= now_mono]
        return [c for wid in gone if (c := self.delete(wid)) is not None]

    def clock_offset(self, worker_id: str) -> float | None:
        """Seconds this clock reads ahead of ``worker_id``'s, from the least late of its last
        heartbeats (None: none seen): the offset plus the transit of that heartbeat, so a time the
        worker stamped, read here less this, gives the delay beyond that fastest transit."""
        seen = self._late.get(worker_id)
        return min(seen) if seen else None

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._records.get(worker_id)

    def workers(self) -> list[WorkerRecord]:
        return sorted(self._records.values(), key=lambda r: (r.model, r.worker_id))

    def active(self, model: str) -> list[WorkerRecord]:
        """The active workers serving ``model`` (as their model or an alias)."""
        return [
            r for r in self._records.values() if model in r.served_names and r.status == WorkerStatus.ACTIVE
        ]

    def models(self) -> list[str]:
        """Models (aliases included) with at least one active worker."""
        return sorted({name for r in self._records.values() if r.status == WorkerStatus.ACTIVE
                       for name in r.served_names})

    def known_model(self, model: str) -> bool:
        """True when any worker (in any status) serves ``model``."""
        return any(model in r.served_names for r in self._records.values())

    def __len__(self) -> int:
        return len(self._records)
