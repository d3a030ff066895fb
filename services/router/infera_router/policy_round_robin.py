"""Round-robin: each model rotates through its active workers, one step per request."""

from __future__ import annotations

from infera_common.schemas import RouteRequest

from infera_router.kv_view import KvView
from infera_router.state import WorkerState


class RoundRobin:
    """Rotation per model over the candidates in worker-id order.

    Request k of a model starts at candidate ``k mod n`` and falls back to the following ones
    in order (wrapping around), so refusals by full workers do not disturb the rotation.
    """

    name = "round-robin"
    needs_kv = False

    def __init__(self) -> None:
        self._turn: dict[str, int] = {}

    def rank(self, candidates: list[WorkerState], request: RouteRequest, kv: KvView | None = None) -> list[str]:
        n = len(candidates)
        turn = self._turn.get(request.model, 0)
        start = turn % n
        self._turn[request.model] = start + 1
        return [w.worker_id for w in candidates[start:]] + [w.worker_id for w in candidates[:start]]
