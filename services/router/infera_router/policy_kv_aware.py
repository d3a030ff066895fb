"""KV-aware: send a request where the least prefill work is left, counting the worker's load.

Cost of worker ``w`` for a request of ``T`` prompt tokens (lower is better), in KV blocks of
``w``'s own block size ``bs`` (so workers with different block sizes compare in the same unit of
work, roughly tokens / bs):

    prefill(w) = ceil(T / bs) - matched(w)          blocks the engine must still compute
    load(w)    = lease_tokens(w) / bs               KV blocks of this router's in-flight requests
               + others(w) * ceil(T / bs)           requests it cannot see, sized like this one
    cost(w)    = kv_overlap_weight * prefill(w) + load(w)

``matched(w)`` is the indexer's prefix depth for ``w`` (full blocks of the request's token ids
hashed at ``bs``). ``lease_tokens`` are the prompt tokens of this router's leases on ``w``: each
in-flight request holds about that many blocks for decode and, while prefilling, costs that much
compute, so one number stands for both. ``others(w) = max(0, reported_in_flight - leases) +
reported_engine_waiting`` are requests other routers sent (from the worker's load report), whose
sizes this router does not know; they are counted at this request's size.

Why ``kv_overlap_weight`` (default 1.0): at 1.0 a cached block saves exactly one block of work,
so a worker with a 10-block cache hit wins unless it carries more than 10 blocks of extra load.
Above 1 favours cache hits more (prefill-bound fleets, long shared prefixes); below 1 favours
spreading load (decode-bound fleets); 0 makes the policy load-only.

When the cache information is missing:
- for the whole request (``KvView.ok`` False: no token ids, indexer absent or too slow) the cost is
  ``load(w)`` only — the caller counts these requests;
- for one worker (block size unknown, or the indexer lists it ``unseen``) its ``matched`` is 0,
  i.e. it gets no cache bonus; the caller makes such workers visible in metrics.
A worker without a known block size uses ``DEFAULT_BLOCK_SIZE`` for its load units.

Ties: by ``load(w)``, then at random (a per-policy ``random.Random``; seed it in tests).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from infera_common.schemas import RouteRequest

from infera_router.kv_view import KvView
from infera_router.state import WorkerState

#: Block size assumed for a worker that does not publish its own (the mock engine's default page).
DEFAULT_BLOCK_SIZE = 64


@dataclass(slots=True, frozen=True)
class WorkerCost:
    """The cost breakdown of one candidate (for the decision, the debug log and the metrics)."""

    worker_id: str
    cost: float
    prefill_blocks: int  # blocks still to compute (0 when no cache info: load-only)
    matched_blocks: int
    request_blocks: int  # ceil(prompt tokens / block size)
    load_blocks: float
    block_size: int
    cache_info: str  # "ok", "unknown_block_size", "unseen", or the request-wide failure reason


def request_tokens(request: RouteRequest) -> int:
    return len(request.token_ids) if request.token_ids else request.prompt_tokens


def worker_cost(worker: WorkerState, tokens: int, kv: KvView, weight: float) -> WorkerCost:
    rec = worker.record
    bs = rec.kv_block_size or DEFAULT_BLOCK_SIZE
    req_blocks = -(-tokens // bs)
    others = 0
    if worker.load is not None:
        others = max(0, worker.load.in_flight - worker.in_flight) + worker.load.engine_waiting
    load = worker.in_flight_tokens / bs + others * req_blocks
    if not kv.ok:
        return WorkerCost(worker.worker_id, load, 0, 0, req_blocks, load, bs, kv.failure or "none")
    if rec.kv_block_size is None:
        info = "unknown_block_size"
    elif worker.worker_id in kv.unseen:
        info = "unseen"
    else:
        info = "ok"
    matched = min(kv.depth.get(worker.worker_id, 0), req_blocks) if info == "ok" else 0
    prefill = req_blocks - matched
    return WorkerCost(worker.worker_id, weight * prefill + load, prefill, matched, req_blocks, load, bs, info)


class KvAware:
    name = "kv-aware"
    needs_kv = True

    def __init__(self, overlap_weight: float = 1.0, rng: random.Random | None = None) -> None:
        if overlap_weight < 0:
            raise ValueError(f"kv overlap weight must be >= 0, got {overlap_weight}")
        self.overlap_weight = overlap_weight
        self._rng = rng or random.Random()

    def explain(self, candidates: list[WorkerState], request: RouteRequest, kv: KvView | None) -> list[WorkerCost]:
        """Every candidate's cost breakdown, cheapest first (ties: load, then random)."""
        view = kv if kv is not None else KvView.failed("none")
        tokens = request_tokens(request)
        rnd = self._rng.random
        costs = [worker_cost(w, tokens, view, self.overlap_weight) for w in candidates]
        keyed = sorted(((c.cost, c.load_blocks, rnd(), i) for i, c in enumerate(costs)))
        return [costs[i] for *_, i in keyed]

    def rank(self, candidates: list[WorkerState], request: RouteRequest, kv: KvView | None = None) -> list[str]:
        return [c.worker_id for c in self.explain(candidates, request, kv)]
