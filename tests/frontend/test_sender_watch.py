from infera_frontend.sender_watch import SenderWatch


def test_a_request_is_silent_once_nothing_arrived_for_the_threshold():
    w = SenderWatch(silent_after=2.0, gone_after=3.0)
    assert not w.silent("r", 1, now=0.0)
    assert not w.silent("r", 1, now=1.9)
    assert w.silent("r", 1, now=2.0)
    assert not w.silent("r", 2, now=2.5)  # a frame came: counting starts again
    assert not w.silent("r", 2, now=4.4) and w.silent("r", 2, now=4.5)


def test_ended_requests_are_forgotten():
    w = SenderWatch(2.0, 3.0)
    w.silent("a", 0, 0.0)
    w.silent("b", 0, 0.0)
    w.forget_except(["b"])
    assert not w.silent("a", 0, 5.0)  # seen anew
    assert w.silent("b", 0, 5.0)


def test_a_sender_is_gone_only_after_no_responders_for_the_whole_threshold():
    w = SenderWatch(2.0, gone_after=3.0)
    assert not w.absent("agent", 10.0)
    assert not w.absent("agent", 12.9)
    assert w.absent("agent", 13.0)
    w.present("agent")  # it answered (or is subscribed but slow): start over
    assert not w.absent("agent", 14.0) and not w.absent("agent", 16.9) and w.absent("agent", 17.0)
    assert not w.absent("other", 17.0)  # per sender


def test_reset_forgets_everything_seen_before_a_reconnect():
    w = SenderWatch(2.0, 3.0)
    w.silent("r", 0, 0.0)
    w.absent("agent", 0.0)
    w.reset()
    assert not w.silent("r", 0, 10.0) and not w.absent("agent", 10.0)
