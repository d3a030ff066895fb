import pytest

from infera_router.breaker import BreakerState, CircuitBreaker, Outcome, Transition

F, S, N = Outcome.FAULT, Outcome.SUCCESS, Outcome.NEUTRAL


def faults(breaker, key, n, now=0.0):
    return [breaker.record(breaker.begin(key, now), F, now) for _ in range(n)]


# --- tripping ----------------------------------------------------------------------------------------


def test_defaults():
    b = CircuitBreaker()
    assert (b.failure_threshold, b.cooldown_s, b.max_cooldown_s) == (3, 5.0, 60.0)


def test_threshold_consecutive_faults_open_the_worker():
    b = CircuitBreaker()
    assert faults(b, "w1", 2) == [None, None]
    assert b.state("w1", 0.0) is BreakerState.CLOSED and b.allows("w1", 0.0)
    assert faults(b, "w1", 1) == [Transition.TRIPPED]
    assert b.state("w1", 0.0) is BreakerState.OPEN and not b.allows("w1", 0.0)
    assert b.snapshot(0.0)["w1"].trips == 1


def test_an_engine_that_refused_the_connection_opens_its_breaker_at_once():
    b = CircuitBreaker()
    faults(b, "w1", 1)  # one ordinary fault already counted, or none: the same
    assert b.record(b.begin("w2", 0.0), Outcome.UNREACHABLE, 0.0) is Transition.TRIPPED
    assert b.state("w2", 0.0) is BreakerState.OPEN and b.state("w1", 0.0) is BreakerState.CLOSED
    # its half-open probe refused again: open again, for twice as long
    assert b.record(b.begin("w2", 5.0), Outcome.UNREACHABLE, 5.0) is Transition.REOPENED
    assert b.state("w2", 14.9) is BreakerState.OPEN and b.state("w2", 15.0) is BreakerState.HALF_OPEN


def test_success_resets_the_consecutive_count():
    b = CircuitBreaker()
    faults(b, "w1", 2)
    b.record(b.begin("w1", 0.0), S, 0.0)
    assert faults(b, "w1", 2) == [None, None]
    assert b.state("w1", 0.0) is BreakerState.CLOSED


@pytest.mark.parametrize("outcome", [N, "neutral"])
def test_neutral_outcomes_neither_count_nor_reset(outcome):
    b = CircuitBreaker()
    faults(b, "w1", 2)
    for _ in range(10):
        b.record(b.begin("w1", 0.0), outcome, 0.0)
    assert faults(b, "w1", 1) == [Transition.TRIPPED]


def test_neutral_outcomes_never_trip():
    b = CircuitBreaker(failure_threshold=1)
    for _ in range(5):  # what a 4xx, a 429 or a client cancel reports
        b.record(b.begin("w1", 0.0), N, 0.0)
    assert b.state("w1", 0.0) is BreakerState.CLOSED and b.snapshot(0.0) == {}


def test_workers_are_independent_and_keys_are_opaque():
    b = CircuitBreaker(failure_threshold=1)
    faults(b, ("w1", 0), 1)
    assert b.state(("w1", 0), 0.0) is BreakerState.OPEN
    assert b.state(("w1", 1), 0.0) is BreakerState.CLOSED
    assert b.state("w1", 0.0) is BreakerState.CLOSED


# --- cooldown, half-open, probes ------------------------------------------------------------------


def test_open_worker_turns_half_open_after_the_cooldown():
    b = CircuitBreaker(cooldown_s=5)
    faults(b, "w1", 3, now=100.0)
    assert b.state("w1", 104.9) is BreakerState.OPEN and not b.allows("w1", 104.9)
    assert b.state("w1", 105.0) is BreakerState.HALF_OPEN and b.allows("w1", 105.0)


def test_half_open_allows_exactly_one_probe_at_a_time():
    b = CircuitBreaker(cooldown_s=5)
    faults(b, "w1", 3)
    probe = b.begin("w1", 5.0)
    assert probe.probe
    assert not b.allows("w1", 5.0)  # the slot is taken
    assert b.filter(["w1", "w2"], 5.0).candidates == ["w2"]
    other = b.begin("w1", 5.0)  # e.g. routed anyway: not a second probe
    assert not other.probe
    assert b.record(other, S, 6.0) is None and b.state("w1", 6.0) is BreakerState.HALF_OPEN


def test_probe_success_closes_the_breaker():
    b = CircuitBreaker(cooldown_s=5)
    faults(b, "w1", 3)
    assert b.record(b.begin("w1", 5.0), S, 6.0) is Transition.CLOSED
    assert b.state("w1", 6.0) is BreakerState.CLOSED and b.allows("w1", 6.0)
    assert faults(b, "w1", 2, now=7.0) == [None, None]  # the count starts over


def test_probe_failure_reopens_with_doubling_cooldown_up_to_the_max():
    b = CircuitBreaker(cooldown_s=5, max_cooldown_s=60)
    faults(b, "w1", 3, now=0.0)
    now, expected = 5.0, [10, 20, 40, 60, 60]
    for cooldown in expected:
        assert b.record(b.begin("w1", now), F, now) is Transition.REOPENED
        assert b.state("w1", now + cooldown - 0.01) is BreakerState.OPEN
        assert b.state("w1", now + cooldown) is BreakerState.HALF_OPEN
        assert b.snapshot(now)["w1"].cooldown_s == cooldown
        now += cooldown
    assert b.snapshot(now)["w1"].trips == 1 + len(expected)


def test_cooldown_resets_after_the_breaker_closes():
    b = CircuitBreaker(cooldown_s=5)
    faults(b, "w1", 3, now=0.0)
    b.record(b.begin("w1", 5.0), F, 5.0)  # cooldown 10
    b.record(b.begin("w1", 15.0), S, 15.0)
    faults(b, "w1", 3, now=20.0)
    assert b.state("w1", 25.0) is BreakerState.HALF_OPEN


def test_a_neutral_probe_frees_the_slot_for_the_next_probe():
    b = CircuitBreaker(cooldown_s=5)
    faults(b, "w1", 3)
    assert b.record(b.begin("w1", 5.0), N, 5.0) is None
    assert b.state("w1", 5.0) is BreakerState.HALF_OPEN and b.allows("w1", 5.0)
    assert b.begin("w1", 5.0).probe


def test_a_lost_probe_is_replaced_after_the_probe_timeout():
    b = CircuitBreaker(cooldown_s=5, probe_timeout_s=100)
    faults(b, "w1", 3)
    lost = b.begin("w1", 5.0)
    assert not b.allows("w1", 104.0)
    assert b.allows("w1", 105.0)
    second = b.begin("w1", 105.0)
    assert second.probe and second.probe != lost.probe
    assert b.record(lost, S, 106.0) is None  # the stale probe no longer decides
    assert b.record(second, S, 106.0) is Transition.CLOSED


def test_outcomes_of_requests_sent_before_the_trip_are_ignored_while_open():
    b = CircuitBreaker(cooldown_s=5)
    in_flight = [b.begin("w1", 0.0) for _ in range(5)]
    for t in in_flight[:3]:
        b.record(t, F, 1.0)
    assert b.state("w1", 1.0) is BreakerState.OPEN
    assert b.record(in_flight[3], S, 2.0) is None  # during the cooldown
    probe = b.begin("w1", 6.0)
    assert b.record(in_flight[4], F, 7.0) is None  # during the probe
    assert b.snapshot(7.0)["w1"].trips == 1
    assert b.record(probe, S, 8.0) is Transition.CLOSED


def test_a_bare_key_records_a_non_probe_request():
    b = CircuitBreaker()
    for _ in range(3):
        b.record("w1", "fault", 0.0)
    assert b.state("w1", 0.0) is BreakerState.OPEN
    assert b.record("w1", S, 10.0) is None and b.state("w1", 10.0) is BreakerState.HALF_OPEN


# --- filtering ---------------------------------------------------------------------------------------


def test_filter_drops_open_workers_and_keeps_order():
    b = CircuitBreaker()
    faults(b, "w2", 3)
    allowed = b.filter(["w3", "w2", "w1"], 1.0)
    assert allowed.candidates == ["w3", "w1"] and not allowed.all_open


def test_filter_routes_anyway_when_every_candidate_is_open():
    b = CircuitBreaker()
    faults(b, "w1", 3)
    faults(b, "w2", 3)
    allowed = b.filter(["w1", "w2"], 1.0)
    assert allowed.candidates == ["w1", "w2"] and allowed.all_open


def test_filter_of_nothing_is_nothing():
    allowed = CircuitBreaker().filter([], 0.0)
    assert allowed.candidates == [] and not allowed.all_open


def test_filter_with_a_key_function():
    b = CircuitBreaker()
    faults(b, ("w1", 1), 3)
    cands = [{"id": "w1", "rank": 0}, {"id": "w1", "rank": 1}]
    allowed = b.filter(cands, 0.0, key=lambda c: (c["id"], c["rank"]))
    assert allowed.candidates == [cands[0]]


# --- state for metrics, forgetting -------------------------------------------------------------------


def test_snapshot_reports_state_and_trips():
    b = CircuitBreaker(cooldown_s=5)
    faults(b, "w1", 3, now=0.0)
    faults(b, "w2", 1, now=0.0)
    snap = b.snapshot(1.0)
    assert snap["w1"].state is BreakerState.OPEN and snap["w1"].open_until == 5.0 and snap["w1"].trips == 1
    assert snap["w2"].state is BreakerState.CLOSED and snap["w2"].consecutive_faults == 1
    assert snap["w2"].trips == 0 and snap["w2"].open_until is None
    assert b.snapshot(5.0)["w1"].state is BreakerState.HALF_OPEN


def test_forget_drops_a_worker():
    b = CircuitBreaker()
    faults(b, "w1", 3)
    b.forget("w1")
    assert b.state("w1", 0.0) is BreakerState.CLOSED and "w1" not in b.snapshot(0.0)


@pytest.mark.parametrize(
    "kwargs",
    [{"failure_threshold": 0}, {"cooldown_s": 0}, {"cooldown_s": 10, "max_cooldown_s": 5}, {"probe_timeout_s": 0}],
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        CircuitBreaker(**kwargs)


def test_breaker_state_exports_to_prometheus():
    from infera_router.metrics import RouterMetrics

    metrics = RouterMetrics()
    b = CircuitBreaker()
    faults(b, "w1", 3)
    for key, worker in b.snapshot(1.0).items():
        metrics.set_breaker_state(key, worker.state)
    assert metrics.registry.get_sample_value("infera_router_breaker_state", {"worker": "w1"}) == 2
    metrics.set_breaker_state("w1", b.state("w1", 5.0))
    assert metrics.registry.get_sample_value("infera_router_breaker_state", {"worker": "w1"}) == 1
    metrics.set_breaker_state("w1", None)
    metrics.set_breaker_state("w1", None)  # removing twice is harmless
    assert metrics.registry.get_sample_value("infera_router_breaker_state", {"worker": "w1"}) is None
