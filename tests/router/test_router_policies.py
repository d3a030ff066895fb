import random
from collections import Counter

import pytest

from infera_common.schemas import LoadReport
from infera_router.policies import POLICY_NAMES, create_policy
from infera_router.policy_least_loaded import LeastLoaded
from infera_router.policy_round_robin import RoundRobin
from infera_router.state import WorkerState

from router_helpers import load, record, route_request


def workers(*ids: str, model: str = "m") -> list[WorkerState]:
    return [WorkerState(record(wid, model)) for wid in ids]


def test_registry_knows_both_policies_and_refuses_others():
    assert set(POLICY_NAMES) == {"kv-aware", "round-robin", "least-loaded"}
    assert isinstance(create_policy("round-robin"), RoundRobin)
    assert isinstance(create_policy("least-loaded"), LeastLoaded)
    with pytest.raises(ValueError, match="round-robin"):
        create_policy("kv-aware-typo")


def test_round_robin_rotates_and_ranks_every_candidate():
    rr = RoundRobin()
    cands = workers("a", "b", "c")
    ranks = [rr.rank(cands, route_request()) for _ in range(4)]
    assert ranks == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_round_robin_rotation_is_per_model():
    rr = RoundRobin()
    m1, m2 = workers("a", "b", model="m1"), workers("x", "y", model="m2")
    firsts = [rr.rank(m1, route_request("m1"))[0], rr.rank(m2, route_request("m2"))[0],
              rr.rank(m1, route_request("m1"))[0], rr.rank(m2, route_request("m2"))[0]]
    assert firsts == ["a", "x", "b", "y"]


def test_round_robin_survives_fleet_shrinking():
    rr = RoundRobin()
    for _ in range(3):
        rr.rank(workers("a", "b", "c"), route_request())
    assert rr.rank(workers("a"), route_request()) == ["a"]
    assert sorted(rr.rank(workers("a", "b"), route_request())) == ["a", "b"]


def test_least_loaded_prefers_fewer_router_leases():
    cands = workers("a", "b", "c")
    cands[0].in_flight_sequences, cands[1].in_flight_sequences, cands[2].in_flight_sequences = 3, 1, 2
    assert LeastLoaded(random.Random(1)).rank(cands, route_request()) == ["b", "c", "a"]


def test_least_loaded_uses_reported_in_flight_and_engine_queue():
    cands = workers("a", "b", "c")
    cands[0].in_flight_sequences = 2        # our leases: 2 sequences, nobody else's
    cands[1].load = load("b", in_flight=5)  # other routers keep b busier
    cands[2].load = load("c", in_flight=1, waiting=2)  # 1 + 2 waiting = 3
    assert LeastLoaded(random.Random(1)).rank(cands, route_request()) == ["a", "c", "b"]


def test_least_loaded_counts_sequences_not_requests():
    """One request for 8 samples keeps an engine busier than three single ones: the engine runs 8."""
    cands = workers("a", "b")
    cands[0].load = LoadReport(worker_id="a", in_flight=1, in_flight_sequences=8)
    cands[1].load = LoadReport(worker_id="b", in_flight=3, in_flight_sequences=3)
    assert LeastLoaded(random.Random(1)).rank(cands, route_request()) == ["b", "a"]
    # an agent too old to say its sequences: its requests are all there is to go by
    cands[0].load = LoadReport(worker_id="a", in_flight=1)
    assert LeastLoaded(random.Random(1)).rank(cands, route_request()) == ["a", "b"]


def test_least_loaded_breaks_equal_counts_by_prompt_tokens_then_kv_usage():
    cands = workers("a", "b", "c")
    for w in cands:
        w.in_flight = w.in_flight_sequences = 1
    cands[0].in_flight_tokens = 900
    cands[1].in_flight_tokens = 100
    cands[2].in_flight_tokens = 100
    cands[1].load = load("b", in_flight=1, kv=0.9)
    cands[2].load = load("c", in_flight=1, kv=0.1)
    assert LeastLoaded(random.Random(1)).rank(cands, route_request()) == ["c", "b", "a"]


def test_least_loaded_breaks_full_ties_at_random_reproducibly():
    cands = workers("a", "b", "c")
    firsts = Counter(LeastLoaded(random.Random(seed)).rank(cands, route_request())[0] for seed in range(60))
    assert set(firsts) == {"a", "b", "c"}
    same = [LeastLoaded(random.Random(7)).rank(cands, route_request()) for _ in range(2)]
    assert same[0] == same[1] and sorted(same[0]) == ["a", "b", "c"]
