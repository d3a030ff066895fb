"""When a serving engine counts as unhealthy, and healthy again (pure)."""

from __future__ import annotations

import pytest

from infera_worker_agent.liveness import Liveness


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
