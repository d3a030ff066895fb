"""Workers that are running but not in this frontend's discovery: a plane mix that cannot work. Pure.

Every worker-agent reports its load on NATS (``infera.load.<worker>``) once a second, whatever its
discovery backend, and says in the report which backend it registered with. A worker that reports
load but is not listed by this frontend's discovery is registered somewhere else (the other backend,
or another etcd cluster): the frontend can never route to it. Instead of answering "model does not
exist" (or waiting for it to appear), the frontend names the flags to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from infera_common.schemas import LoadReport

#: Seconds a load report keeps a worker on the unlisted list (reports come every second or so).
WINDOW = 5.0


@dataclass(frozen=True, slots=True)
class Unlisted:
    worker_id: str
    model: str
    discovery_backend: str  # "" when the worker did not say
    etcd_endpoint: str
    seen: float  # monotonic time of its last report

    def where(self) -> str:
        if self.discovery_backend == "etcd":
            return f"etcd at {self.etcd_endpoint}" if self.etcd_endpoint else "etcd"
        return self.discovery_backend or "an unknown discovery backend"

    def as_json(self) -> dict[str, str]:
        return {"worker_id": self.worker_id, "model": self.model, "discovery_backend": self.discovery_backend,
                "etcd_endpoint": self.etcd_endpoint}


class UnlistedWorkers:
    """Follows load reports of workers discovery has never listed; forgets them ``window`` s after the last.

    A worker discovery listed once and no longer lists is leaving (its last reports may trail its
    deregistration), not registered elsewhere: it is never counted.
    """

    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self._workers: dict[str, Unlisted] = {}
        self._ever_listed: set[str] = set()

    def saw(self, report: LoadReport, listed: bool, now: float) -> bool:
        """Note a load report; True when it makes a worker newly unlisted (worth one log line)."""
        if listed or report.worker_id in self._ever_listed:
            self._workers.pop(report.worker_id, None)
            return False
        old = self._workers.get(report.worker_id)
        self._workers[report.worker_id] = Unlisted(
            report.worker_id, report.model, report.discovery_backend or "", report.etcd_endpoint, now,
        )
        return old is None or now - old.seen > self.window

    def listed(self, worker_id: str) -> None:
        """Discovery lists this worker now."""
        self._workers.pop(worker_id, None)
        self._ever_listed.add(worker_id)

    def current(self, now: float, model: str | None = None) -> list[Unlisted]:
        """Workers reported within the window (of ``model`` when given), by id."""
        for wid in [w for w, u in self._workers.items() if now - u.seen > self.window]:
            del self._workers[wid]
        return sorted((u for u in self._workers.values() if model is None or u.model == model),
                      key=lambda u: u.worker_id)


def mismatch_message(model: str, unlisted: list[Unlisted], here: str) -> str:
    """The 503 a client gets for ``model`` when only unlisted workers serve it; ``here`` is our discovery."""
    shown = ", ".join(u.worker_id for u in unlisted[:5]) + (" ..." if len(unlisted) > 5 else "")
    wheres = sorted({u.where() for u in unlisted})
    return (
        f"No worker in this frontend's discovery ({here}) serves the model `{model}`, but {len(unlisted)} "
        f"running worker(s) serving it ({shown}) are registered in {' and '.join(wheres)}: start the "
        "frontend, router, kv-indexer and worker-agents with the same --discovery-backend (and, for etcd, "
        "an --etcd-endpoint of the same etcd cluster)."
    )
