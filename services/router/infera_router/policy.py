"""The routing-policy interface: rank the candidate workers of one request. Pure, no I/O."""

from __future__ import annotations

from typing import Protocol

from infera_common.schemas import RouteRequest

from infera_router.kv_view import KvView
from infera_router.state import WorkerState


class Policy(Protocol):
    """A routing strategy.

    ``rank`` gets the active, non-excluded workers of the request's model (a non-empty list,
    sorted by worker id, not to be mutated) and returns their ids, most preferred first. The
    router tries them in that order until one worker's queue accepts the request, so every
    candidate should appear once. A policy may keep its own state (e.g. a rotation counter),
    but must not do I/O.

    ``kv`` is the kv-indexer's answer for this request, given only to policies whose
    ``needs_kv`` is True (the others ignore it). A policy with an ``explain`` method
    (``candidates, request, kv -> list[WorkerCost]``, cheapest first) gives the router its cost
    breakdown for metrics and the debug log.
    """

    name: str
    needs_kv: bool

    def rank(self, candidates: list[WorkerState], request: RouteRequest, kv: KvView | None = None) -> list[str]: ...
