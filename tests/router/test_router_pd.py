"""Disaggregated serving without I/O: pool pairing, the two protocols' bodies, and the pair rules."""

from __future__ import annotations


import pytest

from infera_common.schemas import PdParams, Role

from infera_router.core import RouterCore
from infera_router.pd_pairs import Action, PdPairs
from infera_router.pd_protocol import PdContext, several_sequences
from infera_router.pd_sglang import SglangBootstrap, aligned_room
from infera_router.pd_vllm import VllmMooncake
from infera_router.policy_round_robin import RoundRobin
from infera_router.state import WorkerState

from router_helpers import join, record, route_request


def pd_join(wid: str, role: Role, protocol: str = "sglang-bootstrap", **kw):
    return join(wid, role=role, pd=PdParams(protocol=protocol, bootstrap_port=8998, engine_id="eng-" + wid), **kw)


def core(*changes) -> RouterCore:
    c = RouterCore(RoundRobin(), "r", 100.0)
    for ch in changes:
        c.apply_change(ch)
    return c


# --- pairing from discovery ------------------------------------------------------------------
def test_a_complete_pair_is_disaggregated_and_aggregated_workers_serve_otherwise():
    c = core(pd_join("p1", Role.PREFILL), pd_join("d1", Role.DECODE), join("agg"))
    plan = c.plan(route_request())
    assert plan.disaggregated and [w.worker_id for w in plan.order] == ["p1"]
    assert [w.worker_id for w in plan.decode] == ["d1"]
    only_prefill = core(pd_join("p1", Role.PREFILL), join("agg"))
    plan = only_prefill.plan(route_request())
    assert not plan.disaggregated and [w.worker_id for w in plan.order] == ["agg"]


def test_several_sequences_go_to_aggregated_workers_beside_a_pair():
    c = core(pd_join("p1", Role.PREFILL), pd_join("d1", Role.DECODE), join("agg"))
    plan = c.plan(route_request(sequences=4))
    assert not plan.disaggregated and [w.worker_id for w in plan.order] == ["agg"]
    pair_only = core(pd_join("p1", Role.PREFILL), pd_join("d1", Role.DECODE))
    assert pair_only.plan(route_request(sequences=4)).disaggregated  # then the pair refuses it, saying why


@pytest.mark.parametrize("role,missing", [(Role.PREFILL, "decode"), (Role.DECODE, "prefill")])
def test_one_pool_without_aggregated_workers_is_503_naming_the_missing_pool(role, missing):
    plan = core(pd_join("x", role)).plan(route_request())
    assert plan.status == 503 and f"no active {missing} worker" in plan.message


def test_excluded_workers_leave_their_pool():
    c = core(pd_join("p1", Role.PREFILL), pd_join("d1", Role.DECODE), join("agg"))
    plan = c.plan(route_request(exclude=["d1"]))
    assert not plan.disaggregated and [w.worker_id for w in plan.order] == ["agg"]


# --- protocol bodies ---------------------------------------------------------------------------
def target(rec, rank=None) -> WorkerState:
    w = WorkerState(rec)
    w.set_record(rec)
    return w if rank is None else w.ranks[rank]


def test_sglang_legs_carry_the_same_room_and_the_prefill_bootstrap_address():
    prefill = target(record("p1", role=Role.PREFILL, pd=PdParams(protocol="sglang-bootstrap", bootstrap_port=9001)))
    decode = target(record("d1", role=Role.DECODE))
    ctx = PdContext(room=12345)
    body = {"messages": [], "stream": True, "stream_options": {"include_usage": True}}
    p, d = SglangBootstrap().prefill_body(body, prefill, ctx), SglangBootstrap().decode_body(body, prefill, decode, ctx)
    for leg in (p, d):
        assert (leg["bootstrap_host"], leg["bootstrap_port"], leg["bootstrap_room"]) == ("127.0.0.1", 9001, 12345)
        assert "routed_dp_rank" not in leg and "disagg_prefill_dp_rank" not in leg
    assert p["stream"] is False and "stream_options" not in p  # drained by the router
    assert d["stream"] is True and d["stream_options"] == {"include_usage": True}
    assert body == {"messages": [], "stream": True, "stream_options": {"include_usage": True}}  # untouched
    assert 0 <= SglangBootstrap().context(prefill).room < 2**63


def test_sglang_dp_ranks_are_pinned_on_both_legs_and_the_room_points_at_the_prefill_rank():
    prefill = target(record("p1", role=Role.PREFILL, dp_size=8, pd=PdParams(protocol="sglang-bootstrap")), rank=5)
    decode = target(record("d1", role=Role.DECODE, dp_size=8), rank=2)
    ctx = SglangBootstrap().context(prefill)
    assert ctx.room % 8 == 5 and 0 <= ctx.room < 2**63
    p, d = SglangBootstrap().prefill_body({}, prefill, ctx), SglangBootstrap().decode_body({}, prefill, decode, ctx)
    assert p["routed_dp_rank"] == 5
    assert (d["routed_dp_rank"], d["disagg_prefill_dp_rank"]) == (2, 5)
    assert all(aligned_room(r, 8) % 8 == r for r in range(8))


def test_vllm_prefill_asks_for_a_remote_decode_and_the_decode_pulls_by_transfer_id():
    rec = record("p1", role=Role.PREFILL,
                 pd=PdParams(protocol="vllm-mooncake", bootstrap_host="10.0.0.5", bootstrap_port=8998, engine_id="e1"))
    prefill, decode = target(rec), target(record("d1", role=Role.DECODE))
    ctx = PdContext(transfer_id="t-1")
    body = {"prompt": "hi", "max_tokens": 64, "stream": True}
    p, d = VllmMooncake().prefill_body(body, prefill, ctx), VllmMooncake().decode_body(body, prefill, decode, ctx)
    assert p["max_tokens"] == 1 and p["stream"] is False
    assert p["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "t-1"}
    assert d["max_tokens"] == 64 and d["stream"] is True
    assert d["kv_transfer_params"] == {"do_remote_prefill": True, "do_remote_decode": False,
                                       "remote_bootstrap_addr": "http://10.0.0.5:8998", "remote_engine_id": "e1",
                                       "transfer_id": "t-1"}
    assert VllmMooncake.sequential and not SglangBootstrap.sequential
    ranked = target(rec.model_copy(update={"dp_size": 4}), rank=3)
    assert VllmMooncake().decode_body(body, ranked, decode, ctx)["kv_transfer_params"]["remote_engine_id"] == "e1_dp3"


# --- the pair rules ----------------------------------------------------------------------------
def kinds(actions: list[Action]) -> list[tuple[str, str]]:
    return [(a.kind, a.lease_id) for a in actions]


def pair(guard="hold") -> PdPairs:
    t = PdPairs(guard)
    t.start("req", "P", "p1")
    assert t.add_decode("P", "D", "d1", "req") == []
    return t


def test_hold_keeps_the_prefill_load_until_decode_ends():
    t = pair()
    assert t.prefill_drained("P", ok=True) == []  # answer complete: still held
    assert t.released("P", "ok") == []
    assert kinds(t.released("D", "ok")) == [("release", "D"), ("release", "P")]
    assert len(t) == 0


def test_completion_releases_the_prefill_once_drained_but_not_on_headers():
    t = pair("completion")
    assert kinds(t.prefill_drained("P", ok=True)) == [("release", "P")]
    assert t.released("P", "ok") == []  # already released: nothing twice
    assert kinds(t.released("D", "ok")) == [("release", "D")]


def test_completion_also_releases_on_the_agents_release_when_the_router_missed_the_last_frame():
    t = pair("completion")
    assert kinds(t.released("P", "ok")) == [("release", "P")]


@pytest.mark.parametrize("guard", ["hold", "completion"])
def test_a_failed_prefill_cancels_the_decode_and_releases_both(guard):
    t = pair(guard)
    acts = t.prefill_drained("P", ok=False)
    assert ("cancel", "D") in kinds(acts) and ("release", "D") in kinds(acts) and ("release", "P") in kinds(acts)
    assert len(t) == 0 and t.released("D", "cancelled") == []  # the decode's own release finds nothing


def test_a_prefill_refusing_the_request_releases_it_ok_and_hands_its_refusal_to_the_decode_cancel():
    t = pair()
    acts = t.prefill_drained("P", ok=False, status=400, message="prompt too long")
    [cancel] = [a for a in acts if a.kind == "cancel"]
    assert (cancel.lease_id, cancel.status, cancel.why) == ("D", 400, "prompt too long")
    assert [a.outcome for a in acts if a.kind == "release" and a.lease_id == "P"] == ["ok"]  # not the worker's fault
    t = pair()
    [cancel] = [a for a in t.prefill_drained("P", ok=False, status=503, message="busy") if a.kind == "cancel"]
    assert cancel.status == 502 and cancel.why.endswith("failed on worker p1: busy")


@pytest.mark.parametrize("outcome", ["error", "cancelled"])
def test_a_decode_that_fails_or_whose_client_left_cancels_a_running_prefill(outcome):
    t = pair()
    acts = t.released("D", outcome)
    assert kinds(acts) == [("release", "D"), ("cancel", "P"), ("release", "P")]
    assert all(a.request_id == "req" for a in acts)


def test_a_decode_ending_after_the_prefill_completed_cancels_nothing():
    t = pair()
    t.prefill_drained("P", ok=True)
    assert [a.kind for a in t.released("D", "error")] == ["release", "release"]


def test_a_vanished_worker_stops_its_partner():
    t = pair()
    acts = t.worker_left("d1", ["D"])
    assert kinds(acts) == [("cancel", "P"), ("release", "P")]
    t = pair()
    assert kinds(t.worker_left("p1", ["P"])) == [("cancel", "D"), ("release", "D")]  # no answer yet: no KV


def test_a_prefill_worker_that_leaves_after_its_answer_leaves_the_decode_running():
    """Its KV is handed over: a stream already decoding was cut when the prefill engine died."""
    t = pair()
    t.prefill_drained("P", ok=True)
    assert t.worker_left("p1", ["P"]) == []
    assert kinds(t.released("D", "ok")) == [("release", "D")] and len(t) == 0


def test_no_decode_placed_abandons_the_prefill_and_a_late_decode_is_stopped():
    t = PdPairs()
    t.start("req", "P", "p1")
    assert kinds(t.abandon("P")) == [("cancel", "P"), ("release", "P")]
    assert kinds(t.add_decode("P", "D", "d1", "req")) == [("cancel", "D"), ("release", "D")]


def test_unknown_guard_is_refused():
    with pytest.raises(ValueError, match="hold, completion"):
        PdPairs("later")


def test_a_pair_serves_one_sequence_per_request():
    assert several_sequences({"messages": [], "n": 1}) is None
    assert several_sequences({"prompt": ["only one"]}) is None
    assert several_sequences({"prompt": [1, 2, 3]}) is None  # token ids: one prompt
    assert several_sequences({"messages": [], "n": 3}) == "n=3"
    assert several_sequences({"prompt": [[1, 2], [3]]}) == "a batch of 2 prompts"
