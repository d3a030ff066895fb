"""The timing model's curves (NVIDIA Dynamo mocker defaults) and the speedup ratio."""

import pytest

from infera_mock_engine.timing import TimingModel, step_start


def test_prefill_curve_values():
    tm = TimingModel()
    assert tm.prefill_ms(0) == 0.0
    assert tm.prefill_ms(1000) == pytest.approx(4.209989e-07 * 1e6 + 1.518344e-02 * 1000 + 16.50142)
    assert tm.prefill_ms(1000) == pytest.approx(32.1058589)
    assert tm.prefill_ms(8192) == pytest.approx(4.209989e-07 * 8192**2 + 1.518344e-02 * 8192 + 16.50142)


def test_decode_curve_values():
    tm = TimingModel()
    assert tm.decode_ms(0.0) == pytest.approx(5.74)
    assert tm.decode_ms(0.5) == pytest.approx(-25.74 * 0.25 + 54.01 * 0.5 + 5.74)
    assert tm.decode_ms(1.0) == pytest.approx(34.01)
    assert tm.decode_ms(3.0) == tm.decode_ms(1.0)  # usage is clamped to [0, 1]


def test_decode_has_a_one_ms_floor():
    tm = TimingModel(decode_c=-10.0)
    assert tm.decode_ms(0.0) == 1.0


def test_step_cost_adds_prefill_and_decode():
    tm = TimingModel()
    assert tm.step_ms(0, 0, 0.3) == 0.0
    assert tm.step_ms(0, 5, 0.3) == pytest.approx(tm.decode_ms(0.3))  # decode cost does not grow with batch
    assert tm.step_ms(512, 0, 0.3) == pytest.approx(tm.prefill_ms(512))
    assert tm.step_ms(512, 3, 0.3) == pytest.approx(tm.prefill_ms(512) + tm.decode_ms(0.3))


def test_speedup_divides_step_time():
    slow, fast = TimingModel(), TimingModel(speedup=8.0)
    assert slow.step_seconds(700, 4, 0.25) == pytest.approx(slow.step_ms(700, 4, 0.25) / 1000)
    assert fast.step_seconds(700, 4, 0.25) == pytest.approx(slow.step_seconds(700, 4, 0.25) / 8)


def test_speedup_must_be_positive():
    with pytest.raises(ValueError):
        TimingModel(speedup=0)


def test_a_step_starts_when_the_host_gets_to_it_without_overlap_or_after_idle():
    assert step_start(10.004, due=10.0, last=0.01, overlap=False) == 10.004  # lateness lengthens the step
    assert step_start(10.004, due=None, last=0.01, overlap=True) == 10.004  # idle before: nothing to credit


def test_with_overlap_a_host_late_by_up_to_one_step_costs_the_gpu_nothing():
    assert step_start(10.004, due=10.0, last=0.01, overlap=True) == 10.0  # 4 ms late, 10 ms step: hidden
    assert step_start(10.025, due=10.0, last=0.01, overlap=True) == pytest.approx(10.015)  # only the excess lost
    assert step_start(10.0, due=10.0, last=0.01, overlap=True) == 10.0


def test_with_overlap_a_step_never_starts_before_the_latest_request_came_in():
    assert step_start(10.004, due=10.0, last=0.01, overlap=True, arrived=10.003) == 10.003
    assert step_start(10.004, due=10.0, last=0.01, overlap=True, arrived=9.0) == 10.0
