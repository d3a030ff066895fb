"""The router's CPU per route request as the fleet grows: kv-aware against round-robin.

Every route request the kv-aware policy places costs the router work per candidate target (a
worker, or each DP rank of a DP-attention worker): the overlap query names the candidates, the
kv-indexer's reply lists what each of them holds, and the policy weighs each one. This bench times
that work in process (no bus; the NATS round trip is the same for every fleet size and is measured
by `bench/overhead.py`), at several fleet sizes, and states it against round-robin's route in the
same run: what routing costs the router when the decision looks at no cache at all.

One route request, as `routing.py` handles it:

- kv-aware: `RouterCore.kv_query` (candidates, the prompt's block hashes, the query) and its
  encoding; the reply read as the router reads it (`kv_view.read_reply`); `RouterCore.plan` (the
  candidates again, after the round trip, and the ranking); the pick's metrics (`account_pick`).
  The reply is the kv-indexer's own answer (`query.answer` on a real `KvIndex`), computed once per
  fleet size: the indexer's time is its own column, since it runs in another process.
- round-robin: `RouterCore.plan` (the candidates and the next in turn).

The fleet: every target holds `--held` blocks of 64 tokens, among them a system prompt of 8 blocks
that all share; a quarter of the targets hold part of the request's conversation (different depths);
each worker has a load report and two of this router's requests in flight (their prompts counted as
about to be cached). The request is a 4,096-token prompt (64 blocks).

    .venv/bin/python bench/route_cost.py [--targets 8 64 256] [--dp 1 8] [--held 2000] [--seconds 3]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable

from infera_common.block_hash import block_hashes, pack_tokens
from infera_common.fleet import Change
from infera_common.kv_index.index import KvIndex
from infera_common.schemas import Endpoint, LoadReport, RouteRequest, WorkerRecord, WorkerStatus, encode
from infera_kv_indexer.query import answer, held_sections
from infera_router.core import RouterCore
from infera_router.kv_view import read_reply
from infera_router.metrics import RouterMetrics, account_pick
from infera_router.policy_kv_aware import KvAware
from infera_router.policy_round_robin import RoundRobin

MODEL = "m"
BLOCK = 64
PROMPT_TOKENS = 4096
SYSTEM_BLOCKS = 8


def record(wid: str, dp: int) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, model=MODEL, engine="mock", advertise_host="127.0.0.1",
                        url="http://127.0.0.1:1", status=WorkerStatus.ACTIVE, kv_block_size=BLOCK,
                        kv_capacity_tokens=8192 * BLOCK, dp_size=dp)


def request(tokens: list[int], n: int) -> RouteRequest:
    return RouteRequest(request_id=f"r{n}", model=MODEL, endpoint=Endpoint.COMPLETIONS, body=b'{"x":1}',
                        reply_subject="_INBOX.bench.1", deadline=time.time() + 600,
                        prompt_tokens=len(tokens), token_count=len(tokens), tokens=pack_tokens(tokens))


class Fleet:
    """One router core over ``targets`` targets (``dp`` ranks per worker), and the index of what they hold."""

    def __init__(self, targets: int, dp: int, held: int, policy, seed: int = 1) -> None:
        rng = random.Random(seed)
        self.tokens = [rng.randrange(1, 49_000) for _ in range(PROMPT_TOKENS)]
        chain = block_hashes(self.tokens, BLOCK)
        self.core = RouterCore(policy, "rt-bench", 600.0)
        self.index = KvIndex()
        now = time.monotonic()
        workers = [f"w{i:04d}" for i in range(max(1, targets // dp))]
        target_no = 0
        for wid in workers:
            self.core.apply_change(Change("join", record(wid, dp)), now)
            self.index.worker_joined(wid, MODEL)
            for rank in range(dp):
                # a quarter of the targets hold part of the conversation, the rest the system prompt only
                depth = rng.randint(SYSTEM_BLOCKS + 1, len(chain)) if target_no % 4 == 0 else SYSTEM_BLOCKS
                own = [rng.getrandbits(64) for _ in range(held - depth)]
                self.index.apply_blocks(wid, rank, 1, True, {BLOCK: chain[:depth] + own}, {}, now)
                target_no += 1
            self.core.apply_load(LoadReport(worker_id=wid, in_flight=2, engine_running=2), now)
        for k, worker in enumerate(self.core.fleet.active(MODEL)):  # two requests of this router in flight each
            for target in worker.targets[:2]:
                req = request(self.tokens[: BLOCK * (2 + k % 8)], k)
                self.core.acquire(target, req, now, 0, block_hashes(req.token_ids, BLOCK))
        self.holdings = held_sections(self.index, time.monotonic)

    def n_targets(self) -> int:
        return sum(len(w.targets) for w in self.core.fleet.active(MODEL))


def timed(steps: list[Callable[[], object]], seconds: float) -> list[tuple[float, float]]:
    """Median and p99 µs per call of each step, the steps called in turn for ``seconds`` (so that the
    machine's slow spells fall on all of them alike)."""
    for _ in range(5):
        for step in steps:
            step()
    samples: list[list[float]] = [[] for _ in steps]
    gc.collect()
    gc.freeze()  # the fleets' and the index's objects: a router's heap holds no index (it asks the kv-indexer)
    end = time.perf_counter() + seconds
    clock = time.perf_counter
    while clock() < end or len(samples[0]) < 20:
        for step, out in zip(steps, samples):
            t0 = clock()
            step()
            out.append((clock() - t0) * 1e6)
    gc.unfreeze()
    result = []
    for out in samples:
        out.sort()
        result.append((statistics.median(out), out[min(len(out) - 1, int(len(out) * 0.99))]))
    return result


def kv_aware_step(fleet: Fleet, metrics: RouterMetrics) -> tuple[Callable[[], object], Callable[[], object]]:
    """The router's work for one kv-aware route request, and the kv-indexer's for its query."""
    core = fleet.core
    req = request(fleet.tokens, 0)
    ask = core.kv_query(req)
    assert ask is not None
    reply = answer(fleet.index, encode(ask[0]), fleet.holdings)

    def router() -> None:
        query, candidates = core.kv_query(req)
        encode(query)
        kv = read_reply(candidates, reply)
        kv.hashes = query.hashes
        plan = core.plan(req, kv, time.monotonic())
        account_pick(metrics, plan.costs)
        core.discard(plan)

    data = encode(ask[0])
    return router, lambda: answer(fleet.index, data, fleet.holdings)


def round_robin_step(fleet: Fleet) -> Callable[[], object]:
    core = fleet.core
    req = request(fleet.tokens, 0)

    def router() -> None:
        core.discard(core.plan(req, None, time.monotonic()))

    return router


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 8], help="DP ranks per worker (targets per worker)")
    ap.add_argument("--held", type=int, default=2000, help="blocks each target holds")
    ap.add_argument("--seconds", type=float, default=3.0, help="timing per fleet size")
    args = ap.parse_args()
    rows = []
    for dp in args.dp:
        for targets in args.targets:
            if targets < dp:
                continue
            kv_fleet = Fleet(targets, dp, args.held, KvAware(rng=random.Random(1)))
            rr_fleet = Fleet(targets, dp, args.held, RoundRobin())
            router, indexer = kv_aware_step(kv_fleet, RouterMetrics())
            rr, kv, ix = timed([round_robin_step(rr_fleet), router, indexer], args.seconds)
            n = kv_fleet.n_targets()
            rows.append((dp, n, rr, kv, ix))
            print(f"  dp {dp}, {n} targets: round-robin {rr[0]:.0f} µs, kv-aware {kv[0]:.0f} µs, "
                  f"indexer {ix[0]:.0f} µs", file=sys.stderr)
    print("| DP ranks per worker | targets | round-robin µs p50 / p99 | kv-aware router µs p50 / p99 "
          "| kv-aware / round-robin | kv-aware µs per target | kv-indexer answer µs p50 |")
    print("|---|---|---|---|---|---|---|")
    for dp, n, rr, kv, ix in rows:
        print(f"| {dp} | {n} | {rr[0]:.0f} / {rr[1]:.0f} | {kv[0]:.0f} / {kv[1]:.0f} | {kv[0] / rr[0]:.1f}× "
              f"| {kv[0] / n:.2f} | {ix[0]:.0f} |")


if __name__ == "__main__":
    main()
