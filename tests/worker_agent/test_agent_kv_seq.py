"""Sequence gaps per DP rank, as a pure state machine."""

from infera_worker_agent.kv_seq import SeqTracker, Verdict, fill_plan


def test_in_order_batches_are_relayed_and_repeats_dropped():
    t = SeqTracker()
    assert t.check(0) is Verdict.NEXT
    t.relayed(0)
    assert t.check(1) is Verdict.NEXT
    t.relayed(1)
    assert t.check(1) is Verdict.DUPLICATE
    assert t.check(0) is Verdict.DUPLICATE


def test_a_jump_reveals_the_missing_seqs():
    t = SeqTracker()
    t.relayed(0)
    assert t.check(4) is Verdict.GAP
    assert list(t.missing(4)) == [1, 2, 3]


def test_first_batch_after_zero_is_a_gap_from_zero():
    t = SeqTracker()
    assert t.check(2) is Verdict.GAP
    assert list(t.missing(2)) == [0, 1]


def test_fill_plan_orders_what_replay_had_and_reports_the_rest_lost():
    found, lost = fill_plan(range(1, 5), {3: b"c", 1: b"a", 9: b"z"})
    assert found == [(1, b"a"), (3, b"c")]
    assert lost == [2, 4]
