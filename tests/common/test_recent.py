"""The memory of recently cancelled (or finished) request ids."""

from infera_common.recent import RecentIds


def test_ids_are_forgotten_after_the_ttl():
    r = RecentIds(ttl=60.0)
    r.add("a", now=100.0)
    assert r.contains("a", now=159.0)
    assert not r.contains("a", now=160.0)
    assert not r.contains("b", now=100.0)


def test_size_is_bounded_oldest_first():
    r = RecentIds(ttl=60.0, max_size=3)
    for i, key in enumerate("abcd"):
        r.add(key, now=float(i))
    assert len(r) == 3
    assert not r.contains("a", now=4.0)
    assert all(r.contains(k, now=4.0) for k in "bcd")


def test_re_adding_refreshes_the_time():
    r = RecentIds(ttl=10.0)
    r.add("a", now=0.0)
    r.add("b", now=5.0)
    r.add("a", now=8.0)
    assert r.contains("a", now=17.0) and not r.contains("b", now=17.0)


def test_a_value_is_kept_with_its_id_and_forgotten_with_it():
    r = RecentIds(ttl=10.0)
    r.add("a", now=0.0, value=7)
    r.add("b", now=1.0)
    assert r.get("a", now=9.0) == 7 and r.get("b", now=9.0) is None and r.get("c", now=9.0) is None
    assert r.get("a", now=10.0) is None
