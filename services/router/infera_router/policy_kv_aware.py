"""KV-aware: send a request where the least prefill work is left, counting the worker's load.

Cost of worker ``w`` for a request of ``T`` prompt tokens (lower is better), in KV blocks of
``w``'s own block size ``bs`` (so workers with different block sizes compare in the same unit of
work, roughly tokens / bs):

    prefill(w) = ceil(T / bs) - matched(w)          blocks the engine must still compute
    load(w)    = prefilling(w) / bs                 uncached prompt blocks of this router's requests
                                                    on w still waiting for (or in) their prefill
               + kv_decode_weight * decoding(w) / bs   KV blocks of its requests now decoding
               + others(w) * ceil(T / bs)           requests it cannot see, sized like this one
    cost(w)    = kv_overlap_weight * prefill(w) + load(w)

``matched(w)`` is the indexer's prefix depth for ``w`` (full blocks of the request's token ids
hashed at ``bs``). A request this router sent stays ``prefilling`` until the worker-agent reports
its first streamed token (``Prefilled``), then counts as ``decoding`` until its release (a unary
request has no first-token report and counts as prefilling throughout); its prefill work is the
prompt less what the policy saw cached on ``w`` when it picked ``w``. The split matters: a new
request's first token waits behind every prompt still being prefilled on that worker, but a
decoding request only slows each engine step a little (and holds KV blocks), so counting it at
full size keeps a busy conversation away from the worker that holds its cache.
``others(w)`` = the requests other routers leased on ``w`` (the agent's load report splits its
in-flight count by router; older reports: agent in-flight - this router's leases) + the report's
``engine_unseen`` (clients going straight to the engine; older reports: ``max(0, engine running +
waiting - agent in-flight)``): requests whose sizes this router does not know, counted at this
request's size. Each weighs as much as the whole request being placed, so both counts are taken
where they cannot go stale. The split by router: a report is up to a second old, and subtracting
this router's current leases from it would count each of its requests that finished since as
someone else's. ``engine_unseen``: the agent subtracts its in-flight count from before and after
its scrape; the count from after alone made every request that ended during the scrape an unseen
one until the next report.

Why ``kv_overlap_weight`` (default DEFAULT_OVERLAP_WEIGHT = 2.0): at 1.0 a cached block would save
exactly one block of work; above 1 favours cache hits more (prefill-bound fleets, long shared
prefixes), below 1 spreads load (decode-bound fleets), 0 makes the policy load-only. Why
``kv_decode_weight`` (default DEFAULT_DECODE_WEIGHT = 0.1): a new request's first token waits behind
queued prefill, while decoding requests only lengthen each engine step a little. Both defaults were
chosen with ``bench/policy_sim.py`` (the router's own policy in front of the mock engine's own
scheduler and cache, on the Mooncake trace): at (2, 0.1) the hit ratio is 0.150 at the standard load
and 0.146 at twice the load, against 0.122 for (1, 1) and 0.146/0.141 for (1, 0.1), with the
request split within 1.04x of even; ``kv_decode_weight`` 0 piles decodes onto one engine (1.79x
share). The figures and their commands: docs/benchmarks.md.

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
#: Work units one cached prefix block is worth against one block of load (see the module doc).
DEFAULT_OVERLAP_WEIGHT = 2.0
#: What one KV block of a decoding request weighs against one block of pending prefill (module doc).
DEFAULT_DECODE_WEIGHT = 0.1


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
    return request.token_count or request.prompt_tokens


def unseen_requests(worker: WorkerState) -> int:
    """Requests on the worker that this router holds no lease for (from its latest load report)."""
    report = worker.load
    if report is None:
        return 0
    if report.engine_unseen is not None:  # counted by the agent around its scrape (LoadReport)
        beside_agent = report.engine_unseen
    else:
        beside_agent = max(0, report.engine_running + report.engine_waiting - report.in_flight)
    if worker.others is not None:  # the agent said which requests are other routers'
        return worker.others + beside_agent
    return max(0, report.in_flight - worker.in_flight) + beside_agent


def worker_load(worker: WorkerState, bs: int, req_blocks: int, decode_weight: float) -> float:
    return (worker.prefill_tokens + decode_weight * worker.decode_tokens) / bs + unseen_requests(worker) * req_blocks


def worker_cost(worker: WorkerState, tokens: int, kv: KvView, weight: float,
                decode_weight: float = DEFAULT_DECODE_WEIGHT) -> WorkerCost:
    rec = worker.record
    bs = rec.index_block_size or DEFAULT_BLOCK_SIZE
    req_blocks = -(-tokens // bs)
    load = worker_load(worker, bs, req_blocks, decode_weight)
    if not kv.ok:
        return WorkerCost(worker.worker_id, load, 0, 0, req_blocks, load, bs, kv.failure or "none")
    if rec.index_block_size is None:
        info = "unknown_block_size"
    elif worker.base_id in kv.unseen:
        info = "unseen"
    else:
        info = "ok"
    matched = min(kv.depth.get(worker.worker_id, 0), req_blocks) if info == "ok" else 0
    prefill = req_blocks - matched
    return WorkerCost(worker.worker_id, weight * prefill + load, prefill, matched, req_blocks, load, bs, info)


class KvAware:
    name = "kv-aware"
    needs_kv = True

    def __init__(self, overlap_weight: float = DEFAULT_OVERLAP_WEIGHT, rng: random.Random | None = None,
                 decode_weight: float = DEFAULT_DECODE_WEIGHT) -> None:
        if overlap_weight < 0:
            raise ValueError(f"kv overlap weight must be >= 0, got {overlap_weight}")
        if decode_weight < 0:
            raise ValueError(f"kv decode weight must be >= 0, got {decode_weight}")
        self.overlap_weight = overlap_weight
        self.decode_weight = decode_weight
        self._rng = rng or random.Random()

    def explain(self, candidates: list[WorkerState], request: RouteRequest, kv: KvView | None) -> list[WorkerCost]:
        """Every candidate's cost breakdown, cheapest first (ties: load, then random)."""
        view = kv if kv is not None else KvView.failed("none")
        tokens = request_tokens(request)
        rnd = self._rng.random
        costs = [worker_cost(w, tokens, view, self.overlap_weight, self.decode_weight) for w in candidates]
        keyed = sorted(((c.cost, c.load_blocks, rnd(), i) for i, c in enumerate(costs)))
        return [costs[i] for *_, i in keyed]

    def rank(self, candidates: list[WorkerState], request: RouteRequest, kv: KvView | None = None) -> list[str]:
        return [c.worker_id for c in self.explain(candidates, request, kv)]
