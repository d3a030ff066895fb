"""The kv-aware policy without I/O: cost = weight x uncached prefill blocks + load blocks."""

from __future__ import annotations

import random
from collections import Counter

import msgpack
import pytest

from infera_common.block_hash import adapter_root, block_hashes, salted_root
from infera_common.schemas import LoadReport, OverlapReply, WorkerOverlap, encode

from infera_router.core import RouterCore
from infera_router.inflight_blocks import LINGER
from infera_router.kv_view import KvView, kv_query, kv_view, read_reply, without_index
from infera_router.policy_kv_aware import KvAware, cache_fill
from infera_router.state import WorkerState

from router_helpers import join, leave, load, record, route_request

TOKENS = list(range(1000, 1640))  # 640 tokens: 10 blocks of 64, 20 of 32


def worker(wid: str, bs: int | None = 64, leases: int = 0, lease_tokens: int = 0, decoding_tokens: int = 0,
           **kw) -> WorkerState:
    """``lease_tokens`` of prompts still prefilling, ``decoding_tokens`` of prompts past their first token."""
    w = WorkerState(record(wid, kv_block_size=bs, **kw))
    w.in_flight, w.in_flight_tokens = leases, lease_tokens + decoding_tokens
    w.prefill_tokens, w.decode_tokens = lease_tokens, decoding_tokens
    return w


def request(tokens=TOKENS):
    return route_request(token_ids=tokens, prompt_tokens=len(tokens))


def view(depth: dict[str, int], unseen=()) -> KvView:
    return KvView(ok=True, depth=depth, unseen=frozenset(unseen))


def test_deepest_overlap_wins_on_an_idle_fleet():
    ws = [worker("a"), worker("b"), worker("c")]
    assert KvAware(rng=random.Random(1)).rank(ws, request(), view({"b": 8, "c": 3})) == ["b", "c", "a"]


def test_overlap_beats_load_only_up_to_the_weight():
    # b holds 8 of 10 blocks but carries 4 requests' worth of leases (5 blocks of load): 2 + 5 = 7 < 10
    busy_b = [worker("a"), worker("b", leases=1, lease_tokens=5 * 64)]
    assert KvAware(1.0).rank(busy_b, request(), view({"b": 8}))[0] == "b"
    # with 9 blocks of load b costs 11 > a's 10: load wins
    busier_b = [worker("a"), worker("b", leases=2, lease_tokens=9 * 64)]
    assert KvAware(1.0).rank(busier_b, request(), view({"b": 8}))[0] == "a"
    # a heavier weight makes the same cache hit worth more than that load: 2*2 + 9 = 13 < 2*10
    assert KvAware(2.0).rank(busier_b, request(), view({"b": 8}))[0] == "b"
    # weight 0: load only
    assert KvAware(0.0).rank(busy_b, request(), view({"b": 10}))[0] == "a"


def test_reported_requests_of_other_routers_count_as_load():
    ws = [worker("a"), worker("b")]
    ws[1].load = load("b", in_flight=1)  # another router's request, counted at this request's size
    assert KvAware(1.0).rank(ws, request(), view({"b": 5})) == ["a", "b"]  # a: 10, b: 5 + 10


def test_requests_beside_the_agent_count_once_and_waiting_ones_are_not_counted_twice():
    ws = [worker("a", leases=2, lease_tokens=2 * 64), worker("b")]
    ws[0].load = load("a", in_flight=2, waiting=1)  # our own two requests, one queued in the engine
    assert KvAware(1.0).explain(ws, request(), view({}))[1].load_blocks == 2
    ws[1].load = LoadReport(worker_id="b", in_flight=0, engine_running=1)  # a client straight at the engine
    assert {c.worker_id: c.load_blocks for c in KvAware(1.0).explain(ws, request(), view({}))}["b"] == 10


def test_the_agents_own_count_of_requests_beside_it_is_used_when_it_reports_one():
    ws = [worker("a"), worker("b")]
    # the engine's figures include a request that ended as they were read: the agent says none is beside it
    ws[1].load = LoadReport(worker_id="b", in_flight=0, engine_running=1, engine_unseen=0)
    assert {c.worker_id: c.load_blocks for c in KvAware(1.0).explain(ws, request(), view({}))}["b"] == 0
    ws[1].load = LoadReport(worker_id="b", in_flight=0, engine_running=1, engine_unseen=1)
    assert {c.worker_id: c.load_blocks for c in KvAware(1.0).explain(ws, request(), view({}))}["b"] == 10


def test_decoding_requests_weigh_the_decode_weight_per_block():
    # b holds 8 of 10 blocks; its 16 blocks of leases are past their first token
    ws = [worker("a"), worker("b", leases=1, decoding_tokens=16 * 64)]
    assert KvAware(1.0, decode_weight=0.25).rank(ws, request(), view({"b": 8}))[0] == "b"  # 2 + 4 < 10
    assert KvAware(1.0, decode_weight=1.0).rank(ws, request(), view({"b": 8}))[0] == "a"  # 2 + 16 > 10
    # the same 16 blocks still prefilling count in full whatever the decode weight
    still = [worker("a"), worker("b", leases=1, lease_tokens=16 * 64)]
    assert KvAware(1.0, decode_weight=0.0).rank(still, request(), view({"b": 8}))[0] == "a"


def test_a_prefilled_note_moves_the_lease_from_prefill_to_decode_load_once():
    c = RouterCore(KvAware(rng=random.Random(1)), "r", 100.0)
    c.apply_change(join("a", kv_block_size=64))
    a = c.fleet.get("a")
    first = c.acquire(a, route_request(request_id="1", prompt_tokens=640), 0.0, cached_tokens=512)
    second = c.acquire(a, route_request(request_id="2", prompt_tokens=128), 0.0)
    # prefill work is what was not cached; decode holds the whole prompt
    assert (a.in_flight_tokens, a.prefill_tokens, a.decode_tokens) == (768, 128 + 128, 0)
    assert c.prefilled(first.lease_id) is first and (a.prefill_tokens, a.decode_tokens) == (128, 640)
    assert c.prefilled(first.lease_id) is None and a.prefill_tokens == 128  # a duplicate changes nothing
    assert c.prefilled("r-unknown") is None
    c.release(first.lease_id)
    c.release(second.lease_id)  # released before any first token
    assert (a.in_flight, a.in_flight_tokens, a.prefill_tokens, a.decode_tokens) == (0, 0, 0, 0)


def test_equal_costs_break_by_load_then_at_random():
    # a: 10 uncached, no load; b: 4 uncached + 6 blocks of load -> both cost 10, a has less load
    ws = [worker("a"), worker("b", leases=1, lease_tokens=6 * 64)]
    assert KvAware(1.0, rng=random.Random(3)).rank(ws, request(), view({"b": 6})) == ["a", "b"]
    same = [worker("a"), worker("b"), worker("c")]
    firsts = Counter(KvAware(rng=random.Random(s)).rank(same, request(), view({}))[0] for s in range(60))
    assert set(firsts) == {"a", "b", "c"}


def test_unknown_block_size_and_unseen_workers_get_no_cache_bonus_and_are_labelled():
    ws = [worker("a", bs=None), worker("b"), worker("c")]
    costs = KvAware(rng=random.Random(1)).explain(ws, request(), view({"a": 10, "b": 9, "c": 10}, unseen=["c"]))
    by_id = {c.worker_id: c for c in costs}
    assert costs[0].worker_id == "b"
    assert (by_id["a"].cache_info, by_id["a"].matched_blocks) == ("unknown_block_size", 0)
    assert (by_id["c"].cache_info, by_id["c"].matched_blocks) == ("unseen", 0)
    assert by_id["b"].cache_info == "ok" and by_id["b"].prefill_blocks == 1


def test_different_block_sizes_compare_in_their_own_blocks():
    ws = [worker("small", bs=32), worker("big", bs=64)]
    # small holds 18 of its 20 blocks (2 left), big 4 of its 10 (6 left)
    costs = KvAware().explain(ws, request(), view({"small": 18, "big": 4}))
    assert [(c.worker_id, c.request_blocks, c.prefill_blocks) for c in costs] == [("small", 20, 2), ("big", 10, 6)]
    query = kv_query(ws, request())
    assert query is not None and sorted(query.hashes) == [32, 64]
    assert (len(query.hashes[32]), len(query.hashes[64])) == (20, 10) and query.workers == ["small", "big"]


def test_a_request_naming_an_adapter_asks_for_the_blocks_that_adapter_computed():
    ws = [worker("a", aliases=["m-latest"], adapters=["sql", "m-old"]), worker("b", adapters=["sql"])]
    base = kv_query(ws, request())
    for model in ("m", "m-latest"):  # the model by any of its names: the base model's chains
        asked = kv_query(ws, route_request(model=model, token_ids=TOKENS, prompt_tokens=len(TOKENS)))
        assert asked.hashes == base.hashes == {64: block_hashes(TOKENS, 64)}
    sql = kv_query(ws, route_request(model="sql", token_ids=TOKENS, prompt_tokens=len(TOKENS)))
    assert sql.model == "m" and sql.hashes == {64: block_hashes(TOKENS, 64, adapter_root("sql"))}
    assert not set(sql.hashes[64]) & set(base.hashes[64])
    assert ws[0].record.served_names == ["m", "m-latest", "sql", "m-old"]
    salted = kv_query(ws, route_request(model="sql", token_ids=TOKENS, prompt_tokens=len(TOKENS), cache_salt="t1"))
    assert salted.hashes == {64: block_hashes(TOKENS, 64, salted_root(adapter_root("sql"), "t1"))}
    assert not set(salted.hashes[64]) & set(sql.hashes[64])


def test_failed_query_falls_back_to_load_only():
    ws = [worker("a", leases=1, lease_tokens=64), worker("b")]
    costs = KvAware().explain(ws, request(), KvView.failed("timeout"))
    assert [c.worker_id for c in costs] == ["b", "a"] and {c.cache_info for c in costs} == {"timeout"}
    assert [c.cost for c in costs] == [0.0, 1.0]


def test_no_query_without_tokens_or_block_sizes():
    assert kv_query([worker("a")], route_request()) is None
    assert kv_query([worker("a", bs=None)], request()) is None


def test_a_prompt_without_a_full_block_needs_no_indexer():
    ws = [worker("small", bs=32), worker("big", bs=64)]
    short = route_request(token_ids=list(range(31)), prompt_tokens=31)
    query = kv_query(ws, short)
    assert query is not None and query.hashes == {32: [], 64: []}
    view_ = without_index(query)
    assert view_ is not None and view_.ok and not view_.asked and view_.depth == {}
    costs = KvAware().explain(ws, short, view_)
    assert {(c.matched_blocks, c.prefill_blocks, c.cache_info) for c in costs} == {(0, 1, "ok")}
    # one full block at the smaller size: the indexer is asked
    assert without_index(kv_query(ws, route_request(token_ids=list(range(32)), prompt_tokens=32))) is None


def test_reply_is_read_per_worker_and_pinned_dp_rank():
    ws = [worker("a"), worker("b", dp_rank=1)]
    reply = OverlapReply(overlaps=[WorkerOverlap(worker_id="a", dp_rank=0, blocks=2),
                                   WorkerOverlap(worker_id="a", dp_rank=1, blocks=5),
                                   WorkerOverlap(worker_id="b", dp_rank=0, blocks=9),
                                   WorkerOverlap(worker_id="b", dp_rank=1, blocks=3),
                                   WorkerOverlap(worker_id="zz", dp_rank=0, blocks=9)],
                         unseen=["q"])
    v = kv_view(ws, reply)
    assert v.ok and v.depth == {"a": 5, "b": 3} and v.unseen == {"q"}
    assert v.held == {}  # an indexer that says nothing of holdings: unknown, not empty


def test_reply_bytes_read_without_models_say_what_the_schema_says():
    c = RouterCore(KvAware(rng=random.Random(1)), "r", 100.0)
    c.apply_change(join("dp", kv_block_size=64, dp_size=2))
    c.apply_change(join("a", kv_block_size=64))
    targets = [t for w in c.fleet.workers() for t in w.targets]
    reply = OverlapReply(overlaps=[WorkerOverlap(worker_id="dp", dp_rank=1, blocks=4),
                                   WorkerOverlap(worker_id="a", dp_rank=None, blocks=2)],
                         unseen=["q"], held=[WorkerOverlap(worker_id="dp", dp_rank=0, blocks=10),
                                             WorkerOverlap(worker_id="a", blocks=7)])
    fast, slow = read_reply(targets, encode(reply)), kv_view(targets, reply)
    assert (fast.depth, fast.unseen, fast.held) == (slow.depth, slow.unseen, slow.held)
    assert fast.depth == {"dp#1": 4, "a": 2} and fast.held == {"dp#0": 10, "a": 7}
    # a field a newer indexer adds to an entry is ignored, as the schema ignores it
    newer = {"overlaps": [{"worker_id": "a", "dp_rank": None, "blocks": 3, "tier": "gpu"}], "unseen": []}
    assert read_reply(targets, msgpack.packb(newer)).depth == {"a": 3}
    # what the schema would coerce or refuse, it decides: a depth as text is refused
    with pytest.raises(ValueError):
        read_reply(targets, msgpack.packb({"overlaps": [{"worker_id": "a", "blocks": "many"}]}))
    with pytest.raises(ValueError):
        read_reply(targets, b"\xc1 not msgpack")
    assert read_reply(targets, msgpack.packb({})).depth == {}  # an empty reply: nothing known


def test_a_records_change_reaches_what_the_policy_reads():
    c = RouterCore(KvAware(rng=random.Random(1)), "r", 100.0)
    c.apply_change(join("a", kv_block_size=16, kv_capacity_tokens=16 * 100))
    [a] = c.fleet.workers()
    assert (a.block_size, a.capacity_blocks, [t.worker_id for t in a.targets]) == (16, 100, ["a"])
    c.apply_change(join("a", kv_block_size=64, kv_capacity_tokens=64 * 10, dp_size=2))  # restarted otherwise
    assert (a.block_size, [t.worker_id for t in a.targets]) == (64, ["a#0", "a#1"])
    assert [t.capacity_blocks for t in a.targets] == [10, 10] and a.capacity_blocks == 20


def test_held_blocks_are_read_per_rank_target_and_summed_for_a_whole_worker():
    c = RouterCore(KvAware(rng=random.Random(1)), "r", 100.0)
    c.apply_change(join("dp", kv_block_size=64, dp_size=2))  # routed per rank: dp#0, dp#1
    c.apply_change(join("pinned", kv_block_size=64, dp_rank=1))
    # a worker taken as one target (the engine places requests on its ranks) spans its ranks' caches
    whole = worker("whole", dp_size=2, kv_capacity_tokens=64 * 100)
    targets = [t for w in c.fleet.workers() for t in w.targets] + [whole]
    held = [WorkerOverlap(worker_id=w, dp_rank=r, blocks=b)
            for w, r, b in (("dp", 0, 10), ("dp", 1, 20), ("whole", 0, 30), ("whole", 1, 40), ("pinned", 1, 7))]
    v = kv_view(targets, OverlapReply(held=held))
    assert v.held == {"dp#0": 10, "dp#1": 20, "pinned": 7, "whole": 70}
    assert cache_fill(whole, v) == 70 / 200  # capacity per rank x 2 ranks


def full(wid: str, capacity_blocks: int = 100) -> WorkerState:
    """A worker whose engine said its KV cache holds ``capacity_blocks`` blocks of 64."""
    return worker(wid, kv_capacity_tokens=capacity_blocks * 64)


def test_a_fresh_prompt_goes_where_storing_it_evicts_nothing():
    """``a`` holds the fleet's common first block and a full cache; ``b`` an empty one. Storing the
    other 9 blocks on ``a`` would evict 9 blocks of reusable prefixes."""
    ws = [full("a"), full("b")]
    kv = KvView(ok=True, depth={"a": 1}, held={"a": 100, "b": 0})
    assert KvAware(2.0, evict_weight=0.0).rank(ws, request(), kv)[0] == "a"  # 2 x 9 = 18 < 2 x 10
    costs = {c.worker_id: c for c in KvAware(2.0, evict_weight=0.25).explain(ws, request(), kv)}
    assert (costs["a"].fill, costs["b"].fill) == (1.0, 0.0)
    assert (costs["a"].cost, costs["b"].cost) == (2.25 * 9, 20)  # b wins
    # half full: half the penalty (2.125 x 9 = 19.1 < 20: a again)
    kv.held["a"] = 50
    assert KvAware(2.0, evict_weight=0.25).rank(ws, request(), kv)[0] == "a"


def test_a_continuing_conversation_still_goes_to_its_cache_however_full():
    ws = [full("a"), full("b")]
    kv = KvView(ok=True, depth={"a": 8}, held={"a": 100, "b": 0})
    assert KvAware(2.0, evict_weight=0.25).rank(ws, request(), kv)[0] == "a"  # 2.25 x 2 against 2 x 10


def test_no_eviction_term_when_the_capacity_or_the_holding_is_unknown():
    kv = KvView(ok=True, depth={"a": 1}, held={"a": 100})
    for ws in ([worker("a"), worker("b")],  # records without kv_capacity_tokens
               [full("a"), full("b")]):  # b's holding not in the reply: a's fill is known, b's 0
        costs = {c.worker_id: c for c in KvAware(2.0, evict_weight=0.25).explain(ws, request(), kv)}
        assert costs["b"].fill == 0.0
    assert costs["a"].fill == 1.0
    assert [c.fill for c in KvAware(2.0).explain([worker("a")], request(), kv)] == [0.0]  # no capacity


def test_a_prompt_ending_on_a_block_boundary_counts_one_block_less_than_held():
    """The engine computes the prompt's last token whatever it holds: of 10 full blocks held it
    reuses 9 (cached_tokens 576 of 640); one token more and all 10 count."""
    policy = KvAware(2.0, rng=random.Random(0))
    exact = policy.explain([worker("a")], request(), view({"a": 10}))[0]
    longer = policy.explain([worker("a")], request(TOKENS + [7]), view({"a": 10}))[0]
    assert (exact.matched_blocks, exact.request_blocks) == (9, 10)
    assert (longer.matched_blocks, longer.request_blocks) == (10, 11)


def test_core_plans_with_costs_and_asks_only_for_kv_aware():
    c = RouterCore(KvAware(rng=random.Random(1)), "r", 100.0)
    c.apply_change(join("a", kv_block_size=64))
    c.apply_change(join("b", kv_block_size=64))
    assert c.kv_query(request()) is not None
    plan = c.plan(request(), view({"b": 3}))
    assert [w.worker_id for w in plan.order] == ["b", "a"] and plan.costs[0].matched_blocks == 3


def test_in_flight_prompts_deepen_the_indexer_view_until_released():
    c = RouterCore(KvAware(rng=random.Random(1)), "r", 100.0)
    c.apply_change(join("a", kv_block_size=64))
    c.apply_change(join("b", kv_block_size=64))
    chain = list(range(10))
    hashed = KvView(ok=True, depth={"b": 3}, hashes={64: chain})
    assert [w.worker_id for w in c.plan(request(), hashed).order] == ["b", "a"]
    lease = c.acquire(c.fleet.get("a"), request(), 0.0, hashes=chain)  # the same prompt, just sent to a
    plan = c.plan(request(), hashed)
    assert plan.order[0].worker_id == "a" and plan.costs[0].matched_blocks == 9  # (10 held: the last recomputed)
    c.release(lease.lease_id)
    assert c.plan(request(), hashed).order[0].worker_id == "b"
    assert len(c.inflight) == 0


def test_a_stale_report_does_not_count_this_router_s_finished_requests_as_other_load():
    c = RouterCore(KvAware(1.0, rng=random.Random(1)), "r1", 100.0)
    c.apply_change(join("a", kv_block_size=64))
    c.apply_change(join("b", kv_block_size=64))
    # a's report, taken while two of r1's requests ran there (since finished) and one of r2's
    c.apply_load(LoadReport(worker_id="a", in_flight=3, by_router={"r1": 2, "r2": 1}))
    costs = {x.worker_id: x for x in c.plan(request(), view({"a": 4})).costs}
    assert costs["a"].load_blocks == 10  # r2's request only, at this request's 10 blocks
    assert c.plan(request(), view({"a": 4})).order[0].worker_id == "b"  # 6 + 10 > 10
    c.apply_load(LoadReport(worker_id="a", in_flight=2, by_router={"r1": 2}))
    assert c.plan(request(), view({"a": 4})).order[0].worker_id == "a"  # nothing of anyone else's
    c.apply_load(LoadReport(worker_id="a", in_flight=2))  # an agent that does not split: the old estimate
    assert {x.worker_id: x for x in c.plan(request(), view({})).costs}["a"].load_blocks == 20


def test_another_routers_decoding_requests_weigh_as_this_routers_own_when_the_report_sizes_them():
    """Two routers: a's cache holds the prefix, and two of r2's conversations decode there. Sized by
    the agent's report they weigh a tenth of their prompts, as r1's own would, and the prefix wins;
    counted as requests the size of this one they outweighed it, and the prefix was computed again
    on b (the HA audit of session 28)."""
    c = RouterCore(KvAware(rng=random.Random(1)), "r1", 100.0)
    c.apply_change(join("a", kv_block_size=64))
    c.apply_change(join("b", kv_block_size=64))
    c.apply_load(LoadReport(worker_id="a", in_flight=2, by_router={"r2": 2}))  # an agent that does not size
    assert c.plan(request(), view({"a": 9})).order[0].worker_id == "b"  # 2 x 1 + 2 x 10 > 2 x 10
    c.apply_load(LoadReport(worker_id="a", in_flight=2, by_router={"r2": 2}, by_router_work={"r2": (0, 2 * 640)}))
    costs = {x.worker_id: x for x in c.plan(request(), view({"a": 9})).costs}
    assert costs["a"].load_blocks == 0.1 * 2 * 640 / 64 and c.plan(request(), view({"a": 9})).order[0].worker_id == "a"
    # still prefilling, they weigh in full (and a router that did not size its requests: by count)
    c.apply_load(LoadReport(worker_id="a", in_flight=3, by_router={"r2": 2, "r3": 1},
                            by_router_work={"r2": (2 * 640, 0)}))
    assert {x.worker_id: x for x in c.plan(request(), view({"a": 9})).costs}["a"].load_blocks == 20 + 10


def test_a_prompt_that_ended_ok_stays_counted_a_moment_for_its_events_to_reach_the_index():
    """A follow-up sent the moment the answer arrives can beat the engine's KV events to the index:
    the prompt's blocks stay counted on its worker for LINGER seconds after a release ``ok``."""
    c = RouterCore(KvAware(rng=random.Random(1)), "r", 100.0)
    c.apply_change(join("a", kv_block_size=64))
    c.apply_change(join("b", kv_block_size=64))
    chain = list(range(10))
    blind = KvView(ok=True, depth={}, hashes={64: chain})  # the index has not heard of it yet
    lease = c.acquire(c.fleet.get("b"), request(), 0.0, hashes=chain)
    c.release(lease.lease_id, "ok", now=50.0)
    plan = c.plan(request(), blind, now=50.0 + LINGER / 2)
    assert plan.order[0].worker_id == "b" and plan.costs[0].matched_blocks == 9
    assert c.plan(request(), blind, now=50.0 + LINGER + 0.01).costs[0].matched_blocks == 0
    assert len(c.inflight) == 0
    failed = c.acquire(c.fleet.get("b"), request(), 0.0, hashes=chain)
    c.release(failed.lease_id, "error", now=60.0)  # an answer that failed: nothing said about its cache
    assert c.plan(request(), blind, now=60.0).costs[0].matched_blocks == 0


def test_a_worker_that_leaves_takes_its_lingering_blocks_with_it():
    c = RouterCore(KvAware(rng=random.Random(1)), "r", 100.0)
    c.apply_change(join("a", kv_block_size=64))
    lease = c.acquire(c.fleet.get("a"), request(), 0.0, hashes=list(range(10)))
    c.release(lease.lease_id, "ok", now=1.0)
    c.apply_change(leave("a"))
    c.apply_change(join("a", kv_block_size=64))
    again = c.acquire(c.fleet.get("a"), request(), 0.0, hashes=list(range(10)))
    c.plan(request(), KvView(ok=True, depth={}, hashes={64: list(range(10))}), now=1.0 + LINGER + 1)
    assert len(c.inflight) == 10  # the new lease's count, untouched by the old lease's expiry
    c.release(again.lease_id)
    assert len(c.inflight) == 0
