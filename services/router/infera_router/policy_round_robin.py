"""Round-robin: each model rotates through its active workers, one step per request."""

from __future__ import annotations

from infera_common.schemas import RouteRequest

from infera_router.kv_view import KvView
from infera_router.state import WorkerState


class RoundRobin:
    """Rotation per model and pool (aggregated, prefill, decode) over the candidates in worker-id order.

    Request k of a model starts at candidate ``k mod n`` and falls back to the following ones
    in order (wrapping around), so refusals by full workers do not disturb the rotation.
    """

    name = "round-robin"
    needs_kv = False

    def __init__(self) -> None:
        self._turn: dict[tuple[str, str], int] = {}

    def rank(self, candidates: list[WorkerState], request: RouteRequest, kv: KvView | None = None) -> list[str]:
        n = len(candidates)
        key = (request.model, candidates[0].record.role.value)  # a pool's candidates share one role
        start = self._turn.get(key, 0) % n
        self._turn[key] = start + 1
        return [w.worker_id for w in candidates[start:]] + [w.worker_id for w in candidates[:start]]
