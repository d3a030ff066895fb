"""When a serving engine counts as unhealthy, and healthy again (pure)."""

from __future__ import annotations

import pytest

from infera_common.schemas import Role
from infera_worker_agent.engine_watch import finds_hangs
from infera_worker_agent.liveness import CanaryReason as R
from infera_worker_agent.liveness import Liveness, RankStallCheck, StallCheck
from infera_worker_agent.settings import parse_agent_cli


def test_unhealthy_after_the_given_failures_in_a_row_and_healthy_again_after_one_pass():
    live = Liveness(3)
    assert [live.observe(ok) for ok in (False, False, True, False, False)] == [None] * 5  # never 3 in a row
    assert live.observe(False) is False and not live.healthy  # the third in a row
    assert [live.observe(False) for _ in range(5)] == [None] * 5  # told once, not per probe
    assert live.observe(True) is True and live.healthy
    assert live.observe(True) is None


def test_one_failure_is_enough_when_asked_and_zero_is_refused():
    live = Liveness(1)
    assert live.observe(False) is False
    with pytest.raises(ValueError):
        Liveness(0)


def test_a_stall_makes_the_engine_unhealthy_at_once_and_one_pass_ends_it():
    live = Liveness(3)
    assert live.stalled() is False and not live.healthy  # no three strikes needed
    assert live.stalled() is None  # told once
    assert live.observe(False) is None
    assert live.observe(True) is True and live.healthy


def test_a_canary_is_due_only_after_a_whole_round_with_work_and_no_token():
    check = StallCheck()
    assert check.canary_due(2, 100.0, 0) is None  # the first round has nothing to compare with
    assert check.canary_due(2, 100.0, 10) is R.STALLED  # work at both rounds, the counters still
    check.canary_done(silent=False, now=10)  # it answered
    assert check.canary_due(2, 101.0, 20) is None  # a token counted: progress
    assert check.canary_due(0, 101.0, 30) is None  # idle: nothing to wait for (no idle canaries asked)
    assert check.canary_due(3, 101.0, 40) is None  # work appeared this round: it has had no time yet
    assert check.canary_due(3, 101.0, 50) is R.STALLED


def test_no_counters_no_stall_canary():
    check = StallCheck()
    assert [check.canary_due(5, None, t) for t in range(4)] == [None] * 4


def test_after_an_unanswered_canary_every_round_tests_the_engine_even_once_it_holds_nothing():
    """What it held was handed back (and the engine dropped it): holding nothing proves nothing."""
    check = StallCheck()
    check.canary_due(2, 100.0, 0)
    assert check.canary_due(2, 100.0, 10) is R.STALLED
    check.canary_done(silent=True, now=40)
    assert check.canary_due(0, 100.0, 50) is R.SUSPECT
    check.canary_done(silent=True, now=80)
    assert check.canary_due(0, 100.0, 90) is R.SUSPECT
    check.canary_done(silent=False, now=90)  # answered at last
    assert check.canary_due(0, 102.0, 100) is None


def test_counters_moving_end_the_suspicion_without_a_canary():
    check = StallCheck()
    check.canary_due(2, 100.0, 0)
    check.canary_due(2, 100.0, 10)
    check.canary_done(silent=True, now=40)
    assert check.canary_due(1, 180.0, 50) is None  # tokens counted since: working again


def test_an_idle_engine_gets_a_canary_once_idle_for_long_enough():
    check = StallCheck(idle_after=30)
    assert check.canary_due(0, 100.0, 0) is None
    assert check.canary_due(0, 100.0, 20) is None
    assert check.canary_due(0, 100.0, 30) is R.IDLE
    check.canary_done(silent=False, now=31)
    assert check.canary_due(0, 101.0, 40) is None  # the canary's own tokens, seen at this round
    assert check.canary_due(0, 101.0, 60) is None
    assert check.canary_due(0, 101.0, 70) is R.IDLE  # 30 s since
    check.canary_done(silent=False, now=70)
    assert check.canary_due(4, 102.0, 80) is None  # work arrived
    assert check.canary_due(0, 109.0, 90) is None  # and made tokens: active until 90
    assert check.canary_due(0, 109.0, 110) is None
    assert check.canary_due(0, 109.0, 120) is R.IDLE
    check.canary_done(silent=True, now=150)  # hung while idle
    assert check.canary_due(0, 109.0, 160) is R.SUSPECT


def test_a_rank_is_due_after_a_whole_round_with_requests_and_no_frame_while_other_ranks_work():
    check = RankStallCheck()
    assert check.rank_due({0: (2, 10), 1: (1, 1)}) is None  # the first round only takes note
    assert check.rank_due({0: (2, 40), 1: (1, 1)}) == 1  # rank 0 sent 30 frames, rank 1 none
    assert check.rank_due({0: (2, 70), 1: (1, 2)}) is None  # rank 1 got a frame: it works
    assert check.rank_due({0: (0, 0), 1: (0, 0)}) is None  # nothing held
    assert check.rank_due({1: (1, 0)}) is None  # a new request: not yet a whole round
    assert check.rank_due({1: (1, 0)}) == 1


def test_after_a_silent_rank_canary_that_rank_is_tested_every_round_until_it_answers_or_moves():
    check = RankStallCheck()
    check.rank_due({1: (1, 1)})
    assert check.rank_due({1: (1, 1)}) == 1
    check.canary_done(1, silent=True)
    assert check.rank_due({}) == 1  # its requests were handed back: still under test
    assert check.rank_due({0: (1, 5)}) == 1
    check.canary_done(1, silent=False)  # answered
    assert check.rank_due({0: (1, 9)}) is None
    check.canary_done(1, silent=True)
    check.rank_due({1: (1, 3)})
    assert check.rank_due({1: (1, 4)}) is None and check.suspect is None  # its mark moved


def test_an_idle_canary_needs_no_counters():
    check = StallCheck(idle_after=5)
    assert [check.canary_due(0, None, t) for t in (0, 3, 6)] == [None, None, R.IDLE]


@pytest.mark.parametrize("flags, role, family, generates, finds", [
    ([], "aggregated", "vllm", False, True),  # the stall check (vLLM's /health does not generate)
    ([], "aggregated", "sglang", True, True),  # SGLang's generating /health
    (["--no-engine-stall-check"], "aggregated", "vllm", False, False),  # nothing would find a hang
    (["--no-engine-stall-check"], "aggregated", "sglang", True, True),
    (["--health-check-interval", "0"], "aggregated", "sglang", True, False),  # no probes at all
    # SGLang's /health generates on a leg too (its probe has a fake bootstrap host: no pair needed)
    ([], "decode", "sglang", True, True),
    ([], "prefill", "sglang", True, True),
    ([], "prefill", "sglang", False, False),  # a canary of the agent's would need a pair: none
    # a vLLM leg runs a request without kv_transfer_params as an ordinary one: the canary works
    ([], "decode", "vllm", False, True),
    ([], "prefill", "vllm", False, True),
    (["--no-engine-stall-check"], "decode", "vllm", False, False),
])
def test_requests_are_said_alive_only_where_a_hung_engine_would_be_found(flags, role, family, generates, finds):
    settings, _ = parse_agent_cli(["--engine", "mock", *flags])
    assert finds_hangs(settings, Role(role), family, generates) is finds
