"""The clock offset to a peer from the times it says (``clock_offsets``): pure, no I/O."""

from __future__ import annotations

import pytest

from infera_common.clock_offsets import ClockOffsets, read_time_answer, time_answer


def test_the_offset_is_the_midpoint_of_the_question_against_the_answer():
    clocks = ClockOffsets()
    assert clocks.offset("fe") is None and clocks.due("fe", 0.0)
    clocks.asked("fe", 0.0)
    # asked at 1000.0, answered 990.0 (its clock 10 s behind), received at 1000.2
    assert clocks.observe("fe", 1000.0, 990.0, 1000.2) == pytest.approx(10.1)
    assert clocks.offset("fe") == pytest.approx(10.1)
    assert clocks.largest() == pytest.approx(10.1)


def test_the_sample_with_the_shortest_round_trip_counts_and_slow_ones_are_dropped():
    clocks = ClockOffsets(max_round_trip=1.0)
    clocks.due("fe", 0.0)
    clocks.observe("fe", 100.0, 105.0, 100.4)  # round trip 0.4: offset -4.8
    clocks.observe("fe", 200.0, 205.0, 200.02)  # round trip 0.02: offset -4.99
    assert clocks.offset("fe") == pytest.approx(-4.99)
    assert clocks.observe("fe", 300.0, 200.0, 303.0) is None  # a 3 s round trip (a frozen asker) says nothing
    assert clocks.observe("fe", 300.0, 200.0, 299.0) is None  # nor does time running backwards
    assert clocks.offset("fe") == pytest.approx(-4.99)


def test_a_clock_that_stepped_is_followed_from_the_first_sample_that_contradicts_the_estimate():
    clocks = ClockOffsets()
    clocks.due("fe", 0.0)
    clocks.observe("fe", 0.0, 0.0, 0.001)
    clocks.observe("fe", 30.0, 30.02, 30.04)  # within both samples' error bounds: the same clock
    assert clocks.offset("fe") == pytest.approx(0.0005)  # the first: its round trip was the shorter
    clocks.observe("fe", 60.0, 90.0, 60.3)  # the frontend's clock stepped 30 s ahead (NTP caught up)
    assert clocks.offset("fe") == pytest.approx(-29.85)


def test_a_peer_is_asked_at_first_sight_and_again_only_after_the_resync_period():
    clocks = ClockOffsets(resync_after=30.0)
    assert clocks.due("fe", 10.0)
    clocks.asked("fe", 10.0)
    assert not clocks.due("fe", 39.0)
    assert clocks.due("fe", 40.0)
    clocks.forget("fe")
    assert clocks.offset("fe") is None and clocks.due("fe", 41.0)  # gone, then back: asked afresh
    assert clocks.observe("never-needed", 0.0, 0.0, 0.1) is None  # an answer nobody asked for


def test_the_least_recently_needed_peer_makes_room():
    clocks = ClockOffsets(max_peers=2)
    for key in ("a", "b"):
        clocks.due(key, 0.0)
        clocks.observe(key, 0.0, -1.0, 0.0)
    clocks.due("a", 1.0)  # a is needed again: b is now the least recent
    clocks.due("c", 2.0)
    assert len(clocks) == 2 and clocks.offset("a") == 1.0 and clocks.offset("b") is None


def test_the_time_answer_round_trips_and_nonsense_reads_as_none():
    assert read_time_answer(time_answer(1764687000.123456)) == pytest.approx(1764687000.123456)
    assert read_time_answer(b"") is None  # a frontend from before the question
    assert read_time_answer(b"soon") is None and read_time_answer(b"nan") is None and read_time_answer(b"inf") is None
