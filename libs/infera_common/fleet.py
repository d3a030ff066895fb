"""The live fleet as seen from discovery: pure bookkeeping, no I/O.

Liveness is decided by the registrant: each record carries its ``ttl`` and the wall-clock
time of its last heartbeat. A record not refreshed within its ``ttl`` is expired by ``expire``.
"""

from __future__ import annotations

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


class FleetView:
    def __init__(self) -> None:
        self._records: dict[str, WorkerRecord] = {}
        self._deadline: dict[str, float] = {}  # monotonic time at which the entry ages out

    def put(self, record: WorkerRecord, now_mono: float, now_wall: float) -> Change:
        """Apply a registration or heartbeat received at ``now_mono``."""
        age = min(max(now_wall - record.heartbeat_at, 0.0), record.ttl)
        kind: ChangeKind = "update" if record.worker_id in self._records else "join"
        self._records[record.worker_id] = record
        self._deadline[record.worker_id] = now_mono - age + record.ttl
        return Change(kind, record)

    def delete(self, worker_id: str) -> Change | None:
        record = self._records.pop(worker_id, None)
        self._deadline.pop(worker_id, None)
        return Change("leave", record) if record is not None else None

    def expire(self, now_mono: float) -> list[Change]:
        gone = [wid for wid, deadline in self._deadline.items() if deadline <= now_mono]
        return [c for wid in gone if (c := self.delete(wid)) is not None]

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._records.get(worker_id)

    def workers(self) -> list[WorkerRecord]:
        return sorted(self._records.values(), key=lambda r: (r.model, r.worker_id))

    def active(self, model: str) -> list[WorkerRecord]:
        return [
            r for r in self._records.values() if r.model == model and r.status == WorkerStatus.ACTIVE
        ]

    def models(self) -> list[str]:
        """Models with at least one active worker."""
        return sorted({r.model for r in self._records.values() if r.status == WorkerStatus.ACTIVE})

    def known_model(self, model: str) -> bool:
        """True when any worker (in any status) serves ``model``."""
        return any(r.model == model for r in self._records.values())

    def __len__(self) -> int:
        return len(self._records)
