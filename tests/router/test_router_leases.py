import random

from infera_router.leases import LeaseTable


def test_acquire_gives_unique_ids_and_release_drops_once():
    table = LeaseTable("r1")
    a = table.acquire("w1", "req-a", 10, now=1.0)
    b = table.acquire("w1", "req-b", 20, now=1.0)
    assert a.lease_id != b.lease_id and a.lease_id.startswith("r1-")
    assert table.count("w1") == 2 and len(table) == 2
    assert table.release(a.lease_id) == a
    assert table.release(a.lease_id) is None  # a duplicate release is ignored
    assert table.count("w1") == 1 and a.lease_id not in table and b.lease_id in table


def test_a_router_started_again_under_the_same_id_does_not_take_its_predecessors_release_for_its_own():
    before, after = LeaseTable("r1"), LeaseTable("r1")  # a fixed --router-id, a crash, a restart
    old = before.acquire("w1", "req-old", 10, now=1.0)
    new = after.acquire("w1", "req-new", 10, now=2.0)
    assert old.lease_id != new.lease_id and new.lease_id.startswith("r1-")
    assert after.release(old.lease_id) is None  # the old process's request ended: not this lease
    assert new.lease_id in after


def test_unknown_release_is_ignored():
    table = LeaseTable("r1")
    table.acquire("w1", "req", 0, now=0.0)
    assert table.release("other-router-7") is None
    assert len(table) == 1


def test_worker_leave_drops_only_its_leases():
    table = LeaseTable("r1")
    mine = [table.acquire("w1", f"q{i}", 0, now=float(i)) for i in range(3)]
    other = table.acquire("w2", "q", 0, now=5.0)
    dropped = table.drop_worker("w1")
    assert sorted(x.lease_id for x in dropped) == sorted(x.lease_id for x in mine)
    assert table.counts() == {"w2": 1} and other.lease_id in table
    assert table.drop_worker("w1") == []
    assert all(table.release(x.lease_id) is None for x in mine)


def test_max_age_drops_only_old_leases():
    table = LeaseTable("r1")
    old = table.acquire("w1", "old", 0, now=0.0)
    edge = table.acquire("w2", "edge", 0, now=10.0)
    young = table.acquire("w1", "young", 0, now=50.0)
    dropped = table.expire(now=110.0, max_age=100.0)
    assert [x.lease_id for x in dropped] == [old.lease_id, edge.lease_id]
    assert table.counts() == {"w1": 1} and young.lease_id in table
    assert table.expire(now=110.0, max_age=100.0) == []


def test_no_leak_after_many_mixed_operations():
    rng = random.Random(42)
    table = LeaseTable("r")
    live: dict[str, str] = {}  # lease id -> worker, the model of what should be held
    now = 0.0
    for _ in range(5000):
        now += rng.random()
        op = rng.random()
        wid = f"w{rng.randrange(5)}"
        if op < 0.55:
            lease = table.acquire(wid, "q", rng.randrange(100), now)
            live[lease.lease_id] = wid
        elif op < 0.85 and live:
            lid = rng.choice(list(live))
            assert table.release(lid) is not None
            del live[lid]
        elif op < 0.9:
            assert table.release(f"bogus-{rng.random()}") is None
        elif op < 0.95:
            for lease in table.drop_worker(wid):
                del live[lease.lease_id]
        else:
            for lease in table.expire(now, max_age=200.0):
                del live[lease.lease_id]
        assert len(table) == len(live)
    expected: dict[str, int] = {}
    for wid in live.values():
        expected[wid] = expected.get(wid, 0) + 1
    assert table.counts() == expected
    for lid in list(live):
        assert table.release(lid) is not None
    assert len(table) == 0 and table.counts() == {}
