"""When a serving engine counts as unhealthy, and healthy again (pure)."""

from __future__ import annotations

import pytest

from infera_worker_agent.liveness import Liveness, StallCheck


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
    assert check.canary_due(2, 100.0) is False  # the first round has nothing to compare with
    assert check.canary_due(2, 100.0) is True  # work at both rounds, the counters still
    assert check.canary_due(2, 101.0) is False  # a token counted: progress
    assert check.canary_due(0, 101.0) is False  # idle: nothing to wait for
    assert check.canary_due(3, 101.0) is False  # work appeared this round: it has had no time yet
    assert check.canary_due(3, 101.0) is True


def test_no_counters_no_canary():
    check = StallCheck()
    assert [check.canary_due(5, None) for _ in range(4)] == [False] * 4
