"""The routing policies alone, in simulated time: the router's own policy objects in front of the
mock engine's own scheduler and prefix cache, with no processes, no NATS and no wall clock.

What it isolates: the routing decision. Each policy sees what the full stack's router would see
(the lease table of in-flight requests, which of them have produced their first token, and the
indexer's prefix depths — here exact and without lag: each engine's cache is asked directly) and
each engine runs the mock engine's continuous-batching scheduler and paged LRU prefix cache with the
same timing curves. A run is deterministic and takes seconds, so policy settings can be compared
side by side; `bench/trace_replay.py` then measures the chosen settings through the real stack.

Same window and settings as trace_replay.py (issue 3's standard settings): Mooncake conversation
trace requests 2000-2999, token-id prompts <= 16,384 tokens, outputs <= 256, 4 engines x 8,192
blocks of 64. Simulated time runs at the trace's own pace (trace_replay compresses arrivals 4x and
speeds the engines up 4x: the same thing in simulated ms).

    .venv/bin/python bench/policy_sim.py [--policies round-robin sglang-cache-aware kv-aware]
                                         [--decode-weights 0 0.25 1] [--overlap-weights 1 2] [--slowdown 2]

`sglang-cache-aware` is not an Infera policy: it is our model of the public sglang-router's
`cache_aware` policy (bench/sglang_cache_aware.py), run in the same simulated fleet so that the two
routers' decisions compare without their processes.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from infera_common.block_hash import block_hashes, pack_tokens  # noqa: E402
from infera_common.schemas import Endpoint, RouteRequest  # noqa: E402
from infera_mock_engine.block_hasher import BlockHasher  # noqa: E402
from infera_mock_engine.kv_events import BlockRemoved, BlockStored  # noqa: E402
from infera_mock_engine.prefix_cache import PrefixCache  # noqa: E402
from infera_mock_engine.scheduler import FINISHED, Scheduler, SchedulerConfig, Sequence  # noqa: E402
from infera_mock_engine.timing import TimingModel  # noqa: E402
from infera_router.core import RouterCore  # noqa: E402
from infera_router.kv_view import KvView  # noqa: E402
from infera_router.policies import POLICY_NAMES, create_policy  # noqa: E402
from infera_router.policy_kv_aware import DEFAULT_DECODE_WEIGHT, DEFAULT_EVICT_WEIGHT, DEFAULT_OVERLAP_WEIGHT  # noqa: E402
from infera_common.fleet import Change  # noqa: E402
from infera_common.schemas import WorkerRecord  # noqa: E402

import trace_replay as tr  # noqa: E402
from sglang_cache_aware import MAX_TREE_SIZE, SglangCacheAwareModel  # noqa: E402


def chain_hashes(hasher: BlockHasher, ids: list[int], bs: int) -> list[int]:
    out, parent = [], None
    for i in range(len(ids) // bs):
        parent = hasher.digest(parent, ids[i * bs:(i + 1) * bs])
        out.append(hasher.external(parent))
    return out


def prefix_depth(cached: set[int], chain: list[int]) -> int:
    n = 0
    for h in chain:
        if h not in cached:
            break
        n += 1
    return n


def idle_ttft_ms(timing: TimingModel, budget: int, uncached: int) -> float:
    """A request's TTFT alone on an idle engine: its uncached prompt prefilled in chunks of ``budget``."""
    left, total = max(1, uncached), 0.0
    while left > 0:
        chunk = min(left, budget)
        total += timing.prefill_ms(chunk)
        left -= chunk
    return total


def make_policy(name: str, overlap_weight: float, decode_weight: float, evict_weight: float = DEFAULT_EVICT_WEIGHT):
    """A router policy by name, or the model of the public sglang-router's cache_aware policy."""
    if name == SglangCacheAwareModel.name:
        return SglangCacheAwareModel()
    return create_policy(name, overlap_weight, decode_weight, evict_weight)


def simulate(policy_name: str, prompts: list[list[int]], outputs: list[int], arrivals_ms: list[float], *,
             workers: int, kv_blocks: int, block_size: int, overlap_weight: float = 1.0,
             decode_weight: float = 0.25, evict_weight: float = DEFAULT_EVICT_WEIGHT, seed: int = 1,
             index_lag_ms: float = 0.0, slowdown: float = 1.0, policy: object | None = None) -> dict:
    """Replay the window through one policy (``policy``, if given, instead of ``policy_name``: an
    experimental policy object). Returns the summary figures plus per-request TTFT / cache hit /
    worker (``ttft_by``, ``cached_by``, ``worker_of``, keyed by request index) and the policy."""
    policy = policy if policy is not None else make_policy(policy_name, overlap_weight, decode_weight, evict_weight)
    if hasattr(policy, "_rng"):
        policy._rng = random.Random(seed)
    core = RouterCore(policy, "sim", 1e12)
    engines: dict[str, Scheduler] = {}
    for i in range(workers):
        wid = f"w{i}"
        core.apply_change(Change("join", WorkerRecord(
            worker_id=wid, model="m", engine="mock", url="http://sim", advertise_host="sim",
            status="active", kv_block_size=block_size, kv_capacity_tokens=kv_blocks * block_size)))
        engines[wid] = Scheduler(SchedulerConfig(), PrefixCache(kv_blocks, block_size), TimingModel(speedup=1.0 / slowdown))
    rng = random.Random(seed)
    # the index: per engine, the external hashes of its cached blocks, as its KV events arrive
    index: dict[str, set[int]] = {wid: set() for wid in engines}
    hasher = BlockHasher()
    events: list[tuple[float, int, str, object]] = []  # (time ms, tiebreak, kind, payload)
    tick = itertools.count()
    for i, t in enumerate(arrivals_ms):
        heapq.heappush(events, (t, next(tick), "arrive", i))
    busy: dict[str, bool] = dict.fromkeys(engines, False)
    live: dict[int, tuple[Sequence, str, str, float]] = {}  # key -> (seq, worker, lease, arrival)
    ttft: list[float] = []
    ttft_by: dict[int, float] = {}  # request index -> TTFT (for per-request comparisons)
    e2e: list[float] = []
    split = dict.fromkeys(engines, 0)
    worker_of: dict[int, str] = {}
    cached_by: dict[int, int] = {}  # request index -> prompt tokens reused from the engine's cache
    cached = prompt = 0

    def kick(wid: str, now: float) -> None:
        sched = engines[wid]
        if busy[wid] or not (sched.running or sched.waiting):
            return
        step = sched.plan_step()
        if step.empty:
            return
        busy[wid] = True
        heapq.heappush(events, (now + step.seconds * 1000.0, next(tick), "step", (wid, step)))

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            i = payload
            req = RouteRequest(request_id=str(i), model="m", endpoint=Endpoint.COMPLETIONS, body=b"{}",
                               stream=True, reply_subject="sim", deadline=0, prompt_tokens=len(prompts[i]),
                               tokens=pack_tokens(prompts[i]))
            chain = chain_hashes(hasher, prompts[i], block_size)
            depth = {wid: prefix_depth(index[wid], chain) for wid in engines}
            router_chain = block_hashes(prompts[i], block_size)  # what the router hashes (the indexer's hash)
            held = {wid: len(blocks) for wid, blocks in index.items()}  # what the indexer's reply lists
            plan = core.plan(req, KvView(ok=True, depth=depth, hashes={block_size: router_chain}, held=held))
            worker = plan.order[0]
            best = plan.costs[0] if plan.costs else None
            lease = core.acquire(worker, req, now, best.matched_blocks * block_size if best else 0, router_chain)
            seq = Sequence(str(i), prompts[i], outputs[i], "length", lambda: rng.randrange(100, tr.VOCAB))
            live[seq.key] = (seq, worker.worker_id, lease.lease_id, now)
            split[worker.worker_id] += 1
            worker_of[i] = worker.worker_id
            engines[worker.worker_id].add(seq)
            kick(worker.worker_id, now)
        elif kind == "index":
            wid, batch = payload
            for ev in batch:
                if isinstance(ev, BlockStored):
                    index[wid].update(ev.block_hashes)
                elif isinstance(ev, BlockRemoved):
                    index[wid].difference_update(ev.block_hashes)
                else:
                    index[wid].clear()
        else:
            wid, step = payload
            sched = engines[wid]
            before = {s.key: s.generated for s, _ in step.prefill}
            sched.finish_step(step)
            heapq.heappush(events, (now + index_lag_ms, next(tick), "index", (wid, sched.kv.take_events())))
            for key, gen in before.items():
                seq, _, lease_id, t0 = live.get(key, (None, None, None, 0.0))
                if seq is not None and gen == 0 and seq.generated > 0:
                    ttft.append(now - t0)
                    ttft_by[int(seq.rid)] = now - t0
                    core.prefilled(lease_id)
            for key in [k for k, (s, w, _, _) in live.items() if w == wid and s.state == FINISHED]:
                seq, _, lease_id, t0 = live.pop(key)
                e2e.append(now - t0)
                cached += seq.cached_tokens
                cached_by[int(seq.rid)] = seq.cached_tokens
                prompt += seq.prompt_len
                core.release(lease_id)
            busy[wid] = False
            kick(wid, now)
    q = statistics.quantiles(ttft, n=10)
    timing, budget = TimingModel(), SchedulerConfig().max_num_batched_tokens
    floor = [idle_ttft_ms(timing, budget, len(prompts[i]) - c) * slowdown for i, c in cached_by.items()]
    shares = list(split.values())
    return {"hit": cached / max(1, prompt), "ttft_mean": statistics.fmean(ttft), "ttft_p50": statistics.median(ttft),
            "ttft_p90": q[8], "e2e_p50": statistics.median(e2e), "max_share": max(shares) / statistics.fmean(shares),
            "split": shares, "ttft_p99": statistics.quantiles(ttft, n=100)[98], "ttft_by": ttft_by,
            "worker_of": worker_of, "cached_by": cached_by, "policy": policy,
            "floor_p90": statistics.quantiles(floor, n=10)[8]}


DEFAULT_POLICIES = ("round-robin", "least-loaded", SglangCacheAwareModel.name, "kv-aware")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--start", type=int, default=2000)
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=16384)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES),
                    choices=[*POLICY_NAMES, SglangCacheAwareModel.name],
                    help="policies to run, in this order (kv-aware: once per overlap x decode x evict weight); "
                         f"{SglangCacheAwareModel.name} is a model of the public sglang-router's cache_aware "
                         "policy with its default thresholds (bench/sglang_cache_aware.py)")
    ap.add_argument("--decode-weights", type=float, nargs="+", default=[DEFAULT_DECODE_WEIGHT])
    ap.add_argument("--overlap-weights", type=float, nargs="+", default=[DEFAULT_OVERLAP_WEIGHT])
    ap.add_argument("--evict-weights", type=float, nargs="+", default=[DEFAULT_EVICT_WEIGHT])
    ap.add_argument("--load", type=float, default=1.0,
                    help="compress the trace's arrivals by this factor on top of the standard pace (2 = twice the load)")
    ap.add_argument("--index-lag-ms", type=float, default=0.0,
                    help="simulated ms between an engine's step and its KV events reaching the index")
    ap.add_argument("--slowdown", type=float, default=1.0,
                    help="engines run this many times slower than their timing model (CPU contention)")
    ap.add_argument("--trace", type=Path, default=tr.TRACE)
    args = ap.parse_args()
    trace = tr.load_trace(args.trace, args.start, args.count)
    cache: dict[int, list[int]] = {}
    prompts = [tr.prompt_ids(r, cache, args.max_prompt) for r in trace]
    outputs = [max(1, min(r["output_length"], args.max_tokens)) for r in trace]
    arrivals_ms = [t * 1000.0 for t in tr.arrivals(trace, args.load)]
    common = dict(workers=args.workers, kv_blocks=args.kv_blocks, block_size=args.block_size,
                  index_lag_ms=args.index_lag_ms, slowdown=args.slowdown)
    runs: list[tuple[str, dict]] = []
    for p in args.policies:
        if p != "kv-aware":
            label = "sglang cache_aware (model)" if p == SglangCacheAwareModel.name else p
            runs.append((label, simulate(p, prompts, outputs, arrivals_ms, **common)))
            continue
        for ow in args.overlap_weights:
            for dw in args.decode_weights:
                for ew in args.evict_weights:
                    runs.append((f"kv-aware o={ow:g} d={dw:g} e={ew:g}", simulate(
                        "kv-aware", prompts, outputs, arrivals_ms, overlap_weight=ow, decode_weight=dw,
                        evict_weight=ew, **common)))
    base = runs[0]
    print(f"policy simulation: Mooncake requests {args.start}-{args.start + args.count - 1}, {args.workers} engines x "
          f"{args.kv_blocks} blocks of {args.block_size}; load x{args.load:g}; index lag {args.index_lag_ms:g} ms; "
          f"slowdown {args.slowdown:g}; simulated ms\n")
    print(f"{'policy':<27} {'hit':>6} {'TTFT mean':>9} {'p50':>6} {'p90':>6} {'p99':>6} {'floor p90':>9} "
          f"{'e2e p50':>8} {'max/mean':>8} | vs {base[0][:12]}: {'hit':>5} {'p90':>6}")
    print("-" * 122)
    for name, r in runs:
        print(f"{name:<27} {r['hit']:>6.3f} {r['ttft_mean']:>9.0f} {r['ttft_p50']:>6.0f} {r['ttft_p90']:>6.0f} "
              f"{r['ttft_p99']:>6.0f} {r['floor_p90']:>9.0f} {r['e2e_p50']:>8.0f} {r['max_share']:>8.2f} | "
              f"{'':>16} {r['hit'] / base[1]['hit']:>5.2f}x {r['ttft_p90'] / base[1]['ttft_p90']:>5.2f}x")
    capacity = args.workers * args.kv_blocks
    print(f"{'fleet LRU (reference)':<27} {tr.reference_hits(prompts, args.block_size, capacity):>6.3f}")
    print(f"{'  the same, outputs cached':<27} {tr.reference_hits(prompts, args.block_size, capacity, outputs):>6.3f}")
    print("\nfloor p90: the p90 of each request's TTFT alone on an idle engine with the cache hit it got "
          "(its own chunked prefill): no routing can go below it without more cache hits.")
    for name, r in runs:
        model = r["policy"]
        if isinstance(model, SglangCacheAwareModel):
            st = model.stats
            print(f"{name}: {st.tree} requests to the holder of a match > {model.cache_threshold:g} of their text, "
                  f"{st.low_match} below it (least in flight), {st.imbalanced} in imbalanced mode; largest tree "
                  f"{model.max_tenant_chars:,} characters per worker (its bound: {MAX_TREE_SIZE:,})")


if __name__ == "__main__":
    main()
