"""KV-aware: send a request where the least prefill work is left, counting the worker's load.

Cost of worker ``w`` for a request of ``T`` prompt tokens (lower is better), in KV blocks of
``w``'s own block size ``bs`` (so workers with different block sizes compare in the same unit of
work, roughly tokens / bs):

    prefill(w) = ceil(T / bs) - matched(w)          blocks the engine must still compute
    load(w)    = prefilling(w) / bs                 uncached prompt blocks of this router's requests
                                                    on w still waiting for (or in) their prefill
               + kv_decode_weight * decoding(w) / bs   KV blocks its decoding requests read per step
                                                    (each prompt once per sample: ``n``)
               + others(w) * ceil(T / bs)           requests whose size it does not know, sized like this one
    fill(w)    = blocks the index lists on w / w's KV capacity in blocks, at most 1 (0: unknown)
    cost(w)    = (kv_overlap_weight + kv_evict_weight * fill(w)) * prefill(w) + load(w)

``matched(w)`` is the indexer's prefix depth for ``w`` (full blocks of the request's token ids
hashed at ``bs``). A request this router sent stays ``prefilling`` until the worker-agent reports
its first streamed token (``Prefilled``), then counts as ``decoding`` until its release (a unary
request has no first-token report and counts as prefilling throughout); its prefill work is the
prompt less what the policy saw cached on ``w`` when it picked ``w``. The split matters: a new
request's first token waits behind every prompt still being prefilled on that worker, but a
decoding request only slows each engine step a little (and holds KV blocks), so counting it at
full size keeps a busy conversation away from the worker that holds its cache.
``prefilling(w)`` and ``decoding(w)`` include the other routers' requests on ``w`` when the agent's
load report sizes them (``LoadReport.by_router_work``: the tokens each router put in its
envelopes, split by first token as this router splits its own). Before, each of them weighed as
much as the request being placed, while this router's own decoding request weighed a tenth of its
prompt: with two routers, a worker holding a prefix and two of the other router's decoding
requests cost more than an empty one, and the prefix was computed again elsewhere (the HA audit
of session 28: 16-17 prefix misses in 60 s with two routers against 6 with one).
``others(w)`` = the requests other routers leased on ``w`` that the report does not size (the
agent's load report splits its in-flight count by router; older reports: agent in-flight - this
router's leases) + the report's
``engine_unseen`` (clients going straight to the engine; older reports: ``max(0, engine running +
waiting - agent in-flight sequences)``): requests whose sizes this router does not know, counted at this
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

Why ``kv_evict_weight`` (default DEFAULT_EVICT_WEIGHT = 0.75): the blocks a request stores are
free on a worker whose cache has room, but on a full one they evict as many blocks of reusable
prefixes (LRU). Without the term every fresh prompt prefers the workers that already hold the
fleet's common first blocks (a system prompt; the Mooncake trace's shared first 512 tokens) however
full their caches are, and a worker that missed the first requests never gets one while the others
keep up. With long outputs the decode load spreads requests anyway; with short ones (prefill-heavy
traffic) it does not: in the simulator (``bench/policy_sim.py``, the Mooncake window) one output
token per request sent all 1,000 requests to two of four engines, hit ratio 0.088 (round-robin
0.084), and 16 output tokens gave 0.109 with a 1.58 share; with the term, 0.148 and 0.149 with all
four engines in use (the fleet-sized LRU reference is 0.152). At the standard settings it changes
nothing (0.150 either way; at twice the load 0.146 either way). 0.25, 0.5 and 1.0 do about as well
(0.144-0.150 across those runs), 0.75 was never below 0. ``fill`` comes from the record's
``kv_capacity_tokens`` (the engine's own figure, per DP rank) and the blocks the index holds for the
worker (``KvView.held``); either unknown: 0, no term. 0 turns it off.

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
from infera_router.state import WorkerState, reported_sequences

#: Block size assumed for a worker that does not publish its own (the mock engine's default page).
DEFAULT_BLOCK_SIZE = 64
#: Work units one cached prefix block is worth against one block of load (see the module doc).
DEFAULT_OVERLAP_WEIGHT = 2.0
#: What one KV block of a decoding request weighs against one block of pending prefill (module doc).
DEFAULT_DECODE_WEIGHT = 0.1
#: What storing one block on a full cache costs (it evicts a block of reusable prefix; module doc).
DEFAULT_EVICT_WEIGHT = 0.75


@dataclass(slots=True)
class WorkerCost:
    """The cost breakdown of one candidate (for the decision, the debug log and the metrics). Not
    frozen: one is built per candidate per request, and a frozen one takes four times as long."""

    worker_id: str
    cost: float
    prefill_blocks: int  # blocks still to compute (0 when no cache info: load-only)
    matched_blocks: int
    request_blocks: int  # ceil(prompt tokens / block size)
    load_blocks: float
    block_size: int
    cache_info: str  # "ok", "unknown_block_size", "unseen", or the request-wide failure reason
    fill: float = 0.0  # how full the worker's cache is, 0..1 (0 also when unknown)


def request_tokens(request: RouteRequest) -> int:
    return request.token_count or request.prompt_tokens


def unseen_requests(worker: WorkerState) -> int:
    """Requests on the worker that this router holds no lease for (from its latest load report)."""
    report = worker.load
    if report is None:
        return 0
    beside_agent = report.engine_unseen  # counted by the agent around its scrape (LoadReport)
    if beside_agent is None:
        beside_agent = max(0, report.engine_running + report.engine_waiting - reported_sequences(report))
    if worker.others is not None:  # the agent said which requests are other routers'
        return worker.others + beside_agent
    return max(0, report.in_flight - worker.in_flight) + beside_agent


def cache_fill(worker: WorkerState, kv: KvView) -> float:
    """How full the worker's KV cache is, 0..1: the blocks the index lists there over its capacity
    (``WorkerState.capacity_blocks``); 0 when either is unknown."""
    capacity = worker.capacity_blocks
    if not capacity:
        return 0.0
    held = kv.held.get(worker.worker_id)
    return 0.0 if held is None else min(1.0, held / capacity)


def worker_costs(candidates: list[WorkerState], tokens: int, kv: KvView, weight: float, decode_weight: float,
                 evict_weight: float) -> list[WorkerCost]:
    """Each candidate's cost (the module doc's formula) for a prompt of ``tokens`` tokens.

    One loop with the per-worker steps written out: a route request weighs every candidate (a
    worker, or each DP rank), so at hundreds of targets this loop is most of the router's work."""
    out = []
    append = out.append
    ok, failure = kv.ok, kv.failure or "none"
    depth, unseen, held = kv.depth, kv.unseen, kv.held
    for w in candidates:
        wid = w.worker_id
        known_bs = w.block_size
        bs = known_bs or DEFAULT_BLOCK_SIZE
        req_blocks = -(-tokens // bs)
        load = (w.prefill_tokens + w.others_prefill + decode_weight * (w.decode_tokens + w.others_decode)) / bs
        if w.load is not None:
            load += unseen_requests(w) * req_blocks
        if not ok:  # no cache information for the request: load alone
            append(WorkerCost(wid, load, 0, 0, req_blocks, load, bs, failure))
            continue
        matched = 0
        if known_bs is None:
            info = "unknown_block_size"
        elif unseen and w.base_id in unseen:
            info = "unseen"
        else:
            info = "ok"
            matched = depth.get(wid, 0)
            if matched:
                # an engine computes at least the prompt's last token (its logits start the answer): of a
                # prompt ending on a block boundary it reuses one block less than it holds (SGLang, vLLM, the mock)
                matched = min(matched, max(0, (tokens - 1) // bs))
        prefill = req_blocks - matched
        fill = 0.0
        if evict_weight and w.capacity_blocks:
            blocks = held.get(wid)
            if blocks is not None:
                fill = min(1.0, blocks / w.capacity_blocks)
        append(WorkerCost(wid, (weight + evict_weight * fill) * prefill + load, prefill, matched, req_blocks, load,
                          bs, info, fill))
    return out


def worker_cost(worker: WorkerState, tokens: int, kv: KvView, weight: float, decode_weight: float,
                evict_weight: float) -> WorkerCost:
    return worker_costs([worker], tokens, kv, weight, decode_weight, evict_weight)[0]


class KvAware:
    name = "kv-aware"
    needs_kv = True

    def __init__(self, overlap_weight: float = DEFAULT_OVERLAP_WEIGHT, rng: random.Random | None = None,
                 decode_weight: float = DEFAULT_DECODE_WEIGHT, evict_weight: float = DEFAULT_EVICT_WEIGHT) -> None:
        for what, value in (("overlap", overlap_weight), ("decode", decode_weight), ("evict", evict_weight)):
            if value < 0:
                raise ValueError(f"kv {what} weight must be >= 0, got {value}")
        self.overlap_weight = overlap_weight
        self.decode_weight = decode_weight
        self.evict_weight = evict_weight
        self._rng = rng or random.Random()

    def explain(self, candidates: list[WorkerState], request: RouteRequest, kv: KvView | None) -> list[WorkerCost]:
        """Every candidate's cost breakdown, cheapest first (ties: load, then random)."""
        view = kv if kv is not None else KvView.failed("none")
        tokens = request_tokens(request)
        rnd = self._rng.random
        costs = worker_costs(candidates, tokens, view, self.overlap_weight, self.decode_weight, self.evict_weight)
        keyed = sorted([(c.cost, c.load_blocks, rnd(), i) for i, c in enumerate(costs)])
        return [costs[i] for *_, i in keyed]

    def rank(self, candidates: list[WorkerState], request: RouteRequest, kv: KvView | None = None) -> list[str]:
        return [c.worker_id for c in self.explain(candidates, request, kv)]
