"""DP-attention ranks as routing targets: one target per rank, each with its own load and cache view."""

from __future__ import annotations

import json
import random


from infera_common.schemas import OverlapReply, WorkerOverlap

from infera_router.core import RouterCore
from infera_router.kv_view import kv_query, kv_view
from infera_router.policy_kv_aware import KvAware
from infera_router.policy_least_loaded import LeastLoaded
from infera_router.policy_round_robin import RoundRobin

from router_helpers import join, leave, route_request
from test_router_service import bench, eventually  # noqa: F401  (the fixture)

TOKENS = list(range(1000, 1640))


def dp_core(policy=None, dp_size: int = 4) -> RouterCore:
    c = RouterCore(policy or RoundRobin(), "r", 100.0)
    c.apply_change(join("w", dp_size=dp_size, kv_block_size=64))
    return c


def test_a_dp_worker_is_one_target_per_rank_and_its_record_keeps_the_real_id():
    c = dp_core()
    order = c.plan(route_request()).order
    assert [t.worker_id for t in order] == ["w#0", "w#1", "w#2", "w#3"]
    assert {t.base_id for t in order} == {"w"} and [t.rank for t in order] == [0, 1, 2, 3]
    pinned = RouterCore(RoundRobin(), "r", 100.0)
    pinned.apply_change(join("solo", dp_size=4, dp_rank=2))  # one rank per process: not expanded
    assert [t.worker_id for t in pinned.plan(route_request()).order] == ["solo"]


def test_each_rank_has_its_own_load_and_the_worker_sums_them():
    c = dp_core(LeastLoaded())
    w = c.fleet.get("w")
    firsts = []
    for i in range(4):
        target = c.plan(route_request(request_id=str(i), prompt_tokens=64)).order[0]
        firsts.append(target.rank)
        c.acquire(target, route_request(request_id=str(i), prompt_tokens=64), 0.0)
    assert sorted(firsts) == [0, 1, 2, 3]  # least-loaded spreads over the ranks
    assert w.in_flight == 4 and [t.in_flight for t in w.ranks] == [1, 1, 1, 1]
    lease = c.leases.held("w")[0]
    assert lease.target_id == f"w#{lease.dp_rank}"
    c.release(lease.lease_id)
    assert w.in_flight == 3 and w.ranks[lease.dp_rank].in_flight == 0


def test_kv_aware_reads_each_rank_s_depth_and_picks_the_rank_holding_the_prefix():
    c = dp_core(KvAware(rng=random.Random(1)))
    req = route_request(token_ids=TOKENS, prompt_tokens=len(TOKENS))
    targets = c.candidates(req).order
    query = kv_query(targets, req)
    assert query is not None and query.workers == ["w"]  # the indexer is asked about the worker once
    reply = OverlapReply(overlaps=[WorkerOverlap(worker_id="w", dp_rank=r, blocks=b) for r, b in ((0, 1), (2, 9))])
    view = kv_view(targets, reply)
    assert view.depth == {"w#0": 1, "w#2": 9}
    plan = c.plan(req, view)
    assert plan.order[0].worker_id == "w#2" and plan.costs[0].matched_blocks == 9


def test_a_leaving_dp_worker_takes_every_rank_s_leases():
    c = dp_core()
    for i in range(3):
        target = c.plan(route_request(request_id=str(i))).order[0]
        c.acquire(target, route_request(request_id=str(i), token_ids=TOKENS), 0.0, hashes=[1, 2, 3])
    c.apply_change(leave("w"), now=1.0)
    [(_, dropped)] = c.departures(1.0 + 6.0)
    assert len(dropped) == 3 and len(c.inflight) == 0


async def test_the_envelope_pins_the_chosen_rank_for_both_engines(bench):
    await bench.worker("w", dp_size=2)
    replies = [await bench.route(request_id=f"q{i}", body=b'{"prompt": "hi"}') for i in range(2)]
    assert [r.worker_id for r in replies] == ["w", "w"]  # the client and the frontend see the worker
    envs = await bench.pull("w")
    ranks = [json.loads(e.body)["routed_dp_rank"] for e in envs]  # SGLang reads the body
    assert sorted(ranks) == [0, 1]
    assert [e.headers["X-data-parallel-rank"] for e in envs] == [str(r) for r in ranks]  # vLLM the header
    assert bench.leases("w") == 2
