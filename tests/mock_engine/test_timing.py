"""The timing model's curves (NVIDIA Dynamo mocker defaults) and the speedup ratio."""

import pytest

from infera_mock_engine.timing import TimingModel


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
