"""Sequence order per DP rank, as a pure state machine (shared by the worker-agent and the kv-indexer)."""

from infera_common.kv_seq import RankSeq, SeqTracker, Verdict, fill_plan


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


def test_without_restart_detection_every_backward_seq_is_a_duplicate():
    state = RankSeq()
    for seq in range(3):
        state.handled(seq, b"old %d" % seq)
    assert state.verdict(0, b"a new engine's first batch") is Verdict.DUPLICATE
    assert state.verdict(3, b"x") is Verdict.NEXT


def test_a_repeated_batch_is_a_duplicate_and_other_bytes_under_an_old_seq_a_restart():
    state = RankSeq(detect_restarts=True)
    for seq in range(3):
        state.handled(seq, b"old %d" % seq)
    assert state.verdict(1, b"old 1") is Verdict.DUPLICATE  # replay and SUB both delivered it
    assert state.verdict(0, b"new 0") is Verdict.RESTART
    state.restart()
    assert state.verdict(0, b"new 0") is Verdict.NEXT
    assert state.verdict(2, b"new 2") is Verdict.GAP and list(state.missing(2)) == [0, 1]


def test_a_seq_older_than_the_window_counts_as_a_restart():
    state = RankSeq(detect_restarts=True, window=4)
    for seq in range(10):
        state.handled(seq, b"%d" % seq)
    assert state.verdict(9, b"9") is Verdict.DUPLICATE
    assert state.verdict(6, b"6") is Verdict.DUPLICATE
    assert state.verdict(5, b"5") is Verdict.RESTART  # forgotten: an engine that started over
