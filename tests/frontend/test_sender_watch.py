from infera_frontend.sender_watch import SenderWatch


def test_a_request_is_silent_once_nothing_arrived_for_the_threshold():
    w = SenderWatch(silent_after=2.0, gone_after=3.0)
    assert not w.silent("r", 1, now=0.0)
    assert not w.silent("r", 1, now=1.9)
    assert w.silent("r", 1, now=2.0)
    assert not w.silent("r", 2, now=2.5)  # a frame came: counting starts again
    assert not w.silent("r", 2, now=4.4) and w.silent("r", 2, now=4.5)


def test_a_request_that_received_nothing_at_all_is_silent_sooner():
    w = SenderWatch(silent_after=2.0, gone_after=3.0, unheard_after=0.5)
    assert not w.silent("new", 0, now=0.0) and not w.silent("new", 0, now=0.4)
    assert w.silent("new", 0, now=0.5)
    assert not w.silent("under_way", 3, now=0.0) and not w.silent("under_way", 3, now=1.0)
    assert w.silent("under_way", 3, now=2.0)


def test_ended_requests_are_forgotten():
    w = SenderWatch(2.0, 3.0)
    w.silent("a", 0, 0.0)
    w.silent("b", 0, 0.0)
    w.forget_except(["b"])
    assert not w.silent("a", 0, 5.0)  # seen anew
    assert w.silent("b", 0, 5.0)


def test_a_request_under_way_ends_only_after_no_responders_for_the_whole_threshold():
    w = SenderWatch(2.0, gone_after=3.0)
    assert not w.gone("agent", 4, 10.0)  # never said absent
    assert w.absent("agent", 10.0) == 0.0 and not w.gone("agent", 4, 10.0)
    assert w.absent("agent", 12.5) == 2.5 and not w.gone("agent", 4, 12.9)
    w.absent("agent", 13.0)
    assert w.gone("agent", 4, 13.0)
    w.present("agent")  # it answered (or is subscribed but slow): start over
    w.absent("agent", 14.0)
    assert not w.gone("agent", 4, 16.9) and w.gone("agent", 4, 17.0)
    assert not w.gone("other", 4, 17.0)  # per sender


def test_a_request_that_received_nothing_ends_at_the_first_no_responders():
    w = SenderWatch(2.0, gone_after=3.0)
    assert not w.gone("agent", 0, 10.0)  # not asked yet
    w.absent("agent", 10.0)
    assert w.gone("agent", 0, 10.0)
    w.present("agent")
    assert not w.gone("agent", 0, 11.0)  # back on the bus


def test_just_after_this_frontend_reconnected_every_request_waits_for_the_threshold():
    w = SenderWatch(2.0, gone_after=3.0)
    w.silent("r", 0, 0.0)
    w.absent("agent", 0.0)
    w.reset(100.0)  # back on the broker: every sender may be reconnecting too
    assert not w.silent("r", 0, 110.0) and not w.gone("agent", 0, 110.0)  # what came before means nothing
    w.absent("agent", 101.0)
    assert not w.gone("agent", 0, 101.0) and not w.gone("agent", 0, 102.9)
    assert w.gone("agent", 0, 104.0)  # settled, and absent for the threshold
    w.present("agent")
    w.absent("agent", 104.5)
    assert w.gone("agent", 0, 104.5)  # settled: the first "no responders" is enough again
