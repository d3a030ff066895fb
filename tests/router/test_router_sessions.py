import random

import pytest

from infera_common.schemas import Role
from infera_router.sessions import (
    MAX_SESSION_ID_BYTES,
    SESSION_HEADER,
    Outcome,
    SessionIdError,
    SessionTable,
    Target,
    check_mode,
    check_session_id,
    check_ttl,
    parse_session_header,
    pinned_roles,
)

P0 = Target("p0", 0)
P1 = Target("p1", 1)
D0 = Target("d0", 3)
ALL = {P0, P1, D0, Target("a0"), Target("a1")}


def routed(table: SessionTable, role, sid="s1", pick=P0, now=0.0, available=ALL, model="m"):
    """One request leg as the adapter does it: lookup, else let 'the policy' pick and bind."""
    found = table.lookup(model, sid, role, available, now)
    if found.binding is not None:
        return found, found.binding
    return found, table.bind(model, sid, role, pick, now)


# --- header validation ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["prefill", "both"])
def test_enabled_modes_take_one_session_id(mode):
    assert parse_session_header(mode, ["chat-42"]) == "chat-42"
    assert parse_session_header(mode, []) is None  # no header: route normally
    assert parse_session_header(mode, None) is None


@pytest.mark.parametrize("mode", ["prefill", "both"])
@pytest.mark.parametrize(
    "values, message",
    [
        (["a", "b"], "sent 2 times"),
        (["a", "a"], "sent 2 times"),
        ([""], "must not be empty"),
        (["   "], "must not be empty"),
        (["x" * (MAX_SESSION_ID_BYTES + 1)], "1025 bytes long"),
        (["é" * 513], "1026 bytes long"),  # the limit is bytes, not characters
    ],
)
def test_enabled_modes_reject_bad_headers_with_a_clear_message(mode, values, message):
    with pytest.raises(SessionIdError, match=message) as err:
        parse_session_header(mode, values)
    assert SESSION_HEADER in str(err.value)


def test_a_session_id_of_exactly_the_limit_is_accepted():
    sid = "x" * MAX_SESSION_ID_BYTES
    assert parse_session_header("both", [sid]) == sid
    assert check_session_id("prefill", sid) == sid


@pytest.mark.parametrize("values", [["a", "b"], [""], ["x" * 5000], ["fine"]])
def test_off_mode_ignores_the_header_entirely(values):
    assert parse_session_header("off", values) is None
    assert check_session_id("off", values[0]) is None


def test_session_id_from_a_route_request_follows_the_same_rules():
    assert check_session_id("both", None) is None
    assert check_session_id("both", "s") == "s"
    with pytest.raises(SessionIdError):
        check_session_id("both", "")


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="off, prefill, both"):
        check_mode("sticky")
    with pytest.raises(ValueError):
        SessionTable("sticky")


@pytest.mark.parametrize("ttl", [1, 1.0, 3600, 86400])
def test_ttl_in_range_is_accepted(ttl):
    assert check_ttl(ttl) == ttl
    assert SessionTable("both", ttl_s=ttl).ttl_s == ttl


@pytest.mark.parametrize("ttl", [0, 0.5, -1, 86401])
def test_ttl_out_of_range_is_refused(ttl):
    with pytest.raises(ValueError, match="between 1 and 86400 seconds"):
        check_ttl(ttl)


def test_defaults_match_the_flags():
    table = SessionTable()
    assert table.mode == "off" and table.ttl_s == 3600 and table.max_entries == 65536


# --- which roles each mode pins -----------------------------------------------------------------


@pytest.mark.parametrize(
    "mode, pinned",
    [
        ("off", set()),
        ("prefill", {Role.PREFILL, Role.AGGREGATED}),
        ("both", {Role.PREFILL, Role.DECODE, Role.AGGREGATED}),
    ],
)
def test_modes_pin_their_roles(mode, pinned):
    assert pinned_roles(mode) == pinned
    table = SessionTable(mode)
    for role in Role:
        assert table.pins(role) == (role in pinned)
        found, binding = routed(table, role, pick=P1)
        if role in pinned:
            assert found.outcome is Outcome.MISS and binding is not None and binding.target == P1
            again = table.lookup("m", "s1", role, ALL, 1.0)
            assert again.outcome is Outcome.HIT and again.binding.target == P1
        else:
            assert found.outcome is Outcome.NOT_PINNED and binding is None
            assert table.lookup("m", "s1", role, ALL, 1.0).outcome is Outcome.NOT_PINNED


def test_prefill_mode_keeps_prefill_and_lets_decode_move():
    table = SessionTable("prefill")
    routed(table, Role.PREFILL, pick=P1)
    assert table.bind("m", "s1", Role.DECODE, D0, 0.0) is None  # decode is not recorded
    assert table.lookup("m", "s1", Role.PREFILL, ALL, 1.0).binding.target == P1
    assert table.lookup("m", "s1", Role.DECODE, ALL, 1.0).outcome is Outcome.NOT_PINNED


def test_requests_without_session_id_route_normally():
    table = SessionTable("both")
    assert table.lookup("m", None, Role.PREFILL, ALL, 0.0).outcome is Outcome.NOT_PINNED
    assert table.bind("m", None, Role.PREFILL, P0, 0.0) is None
    assert len(table) == 0


def test_prefill_and_decode_bindings_are_independent_and_ranks_need_not_match():
    table = SessionTable("both")
    _, pre = routed(table, Role.PREFILL, pick=Target("p1", 1))
    _, dec = routed(table, Role.DECODE, pick=Target("d0", 3))
    assert table.get("m", "s1", Role.PREFILL) == ("p1", 1)
    assert table.get("m", "s1", Role.DECODE) == ("d0", 3)
    table.invalidate(dec)  # a decode failure leaves the prefill binding alone
    assert table.get("m", "s1", Role.PREFILL) == ("p1", 1) and table.get("m", "s1", Role.DECODE) is None
    assert pre.target == ("p1", 1)


def test_session_ids_are_scoped_by_model_and_role():
    table = SessionTable("both")
    routed(table, Role.PREFILL, model="m1", pick=P0)
    routed(table, Role.PREFILL, model="m2", pick=P1)
    routed(table, Role.AGGREGATED, model="m1", pick=Target("a1"))
    assert table.get("m1", "s1", Role.PREFILL) == P0
    assert table.get("m2", "s1", Role.PREFILL) == P1
    assert table.get("m1", "s1", Role.AGGREGATED) == ("a1", None)
    assert table.lookup("m1", "s2", Role.PREFILL, ALL, 0.0).outcome is Outcome.MISS


def test_roles_may_be_given_as_strings():
    table = SessionTable("both")
    table.bind("m", "s", "prefill", P0, 0.0)
    assert table.lookup("m", "s", Role.PREFILL, ALL, 0.0).binding.target == P0


# --- availability and reselection ------------------------------------------------------------------


def test_unavailable_target_falls_back_and_the_new_pick_replaces_it():
    table = SessionTable("both")
    _, first = routed(table, Role.PREFILL, pick=P0)
    table.release(first, 1.0)
    found = table.lookup("m", "s1", Role.PREFILL, ALL - {P0}, 2.0)
    assert found.outcome is Outcome.FALLBACK and found.binding is None and found.previous == P0
    new = table.bind("m", "s1", Role.PREFILL, P1, 2.0)
    assert new.target == P1 and new.epoch != first.epoch
    assert table.lookup("m", "s1", Role.PREFILL, ALL, 3.0).binding.target == P1


def test_same_worker_on_another_rank_is_a_different_target():
    table = SessionTable("both")
    routed(table, Role.PREFILL, pick=Target("p0", 0))
    assert table.lookup("m", "s1", Role.PREFILL, {Target("p0", 1)}, 1.0).outcome is Outcome.FALLBACK


def test_a_fallback_without_a_new_pick_keeps_the_binding_for_when_the_target_returns():
    table = SessionTable("both")
    routed(table, Role.PREFILL, pick=P0)
    assert table.lookup("m", "s1", Role.PREFILL, set(), 1.0).outcome is Outcome.FALLBACK
    assert table.lookup("m", "s1", Role.PREFILL, {P0}, 2.0).outcome is Outcome.HIT


def test_availability_may_be_a_predicate():
    table = SessionTable("both")
    routed(table, Role.DECODE, pick=D0)
    assert table.lookup("m", "s1", Role.DECODE, lambda t: t.worker_id != "d0", 1.0).outcome is Outcome.FALLBACK
    assert table.lookup("m", "s1", Role.DECODE, lambda t: t.dp_rank == 3, 1.0).outcome is Outcome.HIT


# --- failures and generations ----------------------------------------------------------------------


def test_a_failure_invalidates_the_binding_and_the_next_request_reselects():
    table = SessionTable("both")
    _, b = routed(table, Role.PREFILL, pick=P0)
    assert table.invalidate(b) is True
    assert table.lookup("m", "s1", Role.PREFILL, ALL, 1.0).outcome is Outcome.MISS
    assert table.invalidate(b) is False  # already gone


def test_an_old_failure_cannot_delete_a_newer_binding():
    table = SessionTable("both")
    _, old = routed(table, Role.PREFILL, pick=P0)  # request A, still streaming
    table.lookup("m", "s1", Role.PREFILL, ALL - {P0}, 1.0)
    new = table.bind("m", "s1", Role.PREFILL, P1, 1.0)  # request B moved the session to P1
    assert table.invalidate(old) is False  # A's stream then fails: too late to matter
    assert table.get("m", "s1", Role.PREFILL) == P1
    assert table.invalidate(new) is True


def test_a_hit_shares_the_generation_of_its_binding():
    table = SessionTable("both")
    _, first = routed(table, Role.PREFILL, pick=P0)
    hit = table.lookup("m", "s1", Role.PREFILL, ALL, 1.0).binding
    assert hit.epoch == first.epoch and hit.lease_id != first.lease_id
    assert table.invalidate(hit) is True  # the hit's failure deletes the binding it used
    assert table.get("m", "s1", Role.PREFILL) is None


def test_an_invalidated_session_still_held_by_a_request_can_be_rebound():
    table = SessionTable("both", ttl_s=10, max_entries=1)
    _, a = routed(table, Role.PREFILL, pick=P0)
    table.invalidate(a)  # A still runs (holds its lease)
    b = table.bind("m", "s1", Role.PREFILL, P1, 1.0)
    assert b is not None and table.get("m", "s1", Role.PREFILL) == P1  # same entry, no capacity needed
    assert table.release(a, 2.0) and table.release(b, 2.0)
    assert table.get("m", "s1", Role.PREFILL) == P1


# --- leases and idle expiry ---------------------------------------------------------------------------


def test_idle_session_expires_after_the_ttl_counted_from_the_last_release():
    table = SessionTable("both", ttl_s=100)
    _, b = routed(table, Role.PREFILL, pick=P0, now=0.0)
    table.release(b, now=50.0)
    hit = table.lookup("m", "s1", Role.PREFILL, ALL, 149.0)
    assert hit.outcome is Outcome.HIT
    table.release(hit.binding, now=149.0)
    assert table.lookup("m", "s1", Role.PREFILL, ALL, 248.0).outcome is Outcome.HIT
    assert table.stats()[Role.PREFILL].expired == 0


def test_lookup_after_the_ttl_is_a_miss():
    table = SessionTable("both", ttl_s=100)
    _, b = routed(table, Role.PREFILL, pick=P0, now=0.0)
    table.release(b, now=10.0)
    assert table.lookup("m", "s1", Role.PREFILL, ALL, 110.0).outcome is Outcome.MISS
    assert len(table) == 0 and table.stats()[Role.PREFILL].expired == 1


def test_a_lease_prevents_idle_expiry():
    table = SessionTable("both", ttl_s=10)
    _, long_request = routed(table, Role.DECODE, pick=D0, now=0.0)
    assert table.expire(now=1000.0) == 0
    assert table.lookup("m", "s1", Role.DECODE, ALL, 1000.0).outcome is Outcome.HIT
    assert table.stats()[Role.DECODE].active_leases == 2


def test_expire_drops_only_idle_entries_past_the_ttl():
    table = SessionTable("both", ttl_s=10)
    bindings = {sid: routed(table, Role.PREFILL, sid=sid, now=0.0)[1] for sid in ("a", "b", "c")}
    table.release(bindings["a"], 1.0)
    table.release(bindings["b"], 5.0)  # "c" is still running
    assert table.expire(now=11.0) == 1
    assert table.get("m", "a", Role.PREFILL) is None
    assert table.get("m", "b", Role.PREFILL) == P0 and table.get("m", "c", Role.PREFILL) == P0
    assert table.expire(now=15.0) == 1 and len(table) == 1


def test_release_is_counted_once():
    table = SessionTable("both", ttl_s=10)
    _, a = routed(table, Role.PREFILL, now=0.0)
    b = table.lookup("m", "s1", Role.PREFILL, ALL, 0.0).binding
    assert table.release(a, 1.0) is True
    assert table.release(a, 1.0) is False  # a duplicate release does not end b's lease
    assert table.expire(now=100.0) == 0
    assert table.release(b, 100.0) is True
    assert table.expire(now=110.0) == 1


def test_an_invalidated_entry_disappears_when_its_last_lease_ends():
    table = SessionTable("both")
    _, a = routed(table, Role.PREFILL)
    table.invalidate(a)
    assert len(table) == 1  # still held by a
    table.release(a, 1.0)
    assert len(table) == 0


# --- capacity ---------------------------------------------------------------------------------------


def test_at_capacity_new_sessions_route_normally_and_leased_bindings_stay():
    table = SessionTable("both", ttl_s=10, max_entries=2)
    routed(table, Role.PREFILL, sid="a")
    routed(table, Role.DECODE, sid="a", pick=D0)
    found, binding = routed(table, Role.PREFILL, sid="b", pick=P1, now=100.0)
    assert found.outcome is Outcome.MISS and binding is None
    assert table.get("m", "a", Role.PREFILL) == P0 and table.get("m", "a", Role.DECODE) == D0
    assert table.stats()[Role.PREFILL].unbound_full == 1


def test_at_capacity_idle_unexpired_bindings_are_kept():
    table = SessionTable("both", ttl_s=10, max_entries=1)
    _, a = routed(table, Role.PREFILL, sid="a", now=0.0)
    table.release(a, 1.0)
    assert table.bind("m", "b", Role.PREFILL, P1, 5.0) is None
    assert table.get("m", "a", Role.PREFILL) == P0


def test_at_capacity_an_idle_expired_binding_is_reclaimed():
    table = SessionTable("both", ttl_s=10, max_entries=1)
    _, a = routed(table, Role.PREFILL, sid="a", now=0.0)
    table.release(a, 1.0)
    b = table.bind("m", "b", Role.PREFILL, P1, 11.0)
    assert b is not None and table.get("m", "b", Role.PREFILL) == P1
    assert table.get("m", "a", Role.PREFILL) is None and len(table) == 1


def test_rebinding_an_existing_session_needs_no_free_slot():
    table = SessionTable("both", ttl_s=10, max_entries=1)
    routed(table, Role.PREFILL, sid="a")
    assert table.lookup("m", "a", Role.PREFILL, {P1}, 1.0).outcome is Outcome.FALLBACK
    assert table.bind("m", "a", Role.PREFILL, P1, 1.0) is not None


@pytest.mark.parametrize("bad", [0, -5])
def test_capacity_must_be_positive(bad):
    with pytest.raises(ValueError, match="max_entries"):
        SessionTable("both", max_entries=bad)


# --- stats ----------------------------------------------------------------------------------------


def test_stats_count_per_role_without_session_ids():
    table = SessionTable("both", ttl_s=10)
    _, pre = routed(table, Role.PREFILL, pick=P0)  # miss + selection
    hit = table.lookup("m", "s1", Role.PREFILL, ALL, 1.0).binding  # hit
    table.lookup("m", "s1", Role.PREFILL, {P1}, 1.0)  # fallback
    _, dec = routed(table, Role.DECODE, pick=D0)
    table.invalidate(dec)
    stats = table.stats()
    p, d, a = stats[Role.PREFILL], stats[Role.DECODE], stats[Role.AGGREGATED]
    assert (p.hits, p.misses, p.fallbacks, p.selections, p.active_leases, p.bindings) == (1, 1, 1, 1, 2, 1)
    assert (d.hits, d.misses, d.selections, d.invalidated, d.active_leases, d.bindings) == (0, 1, 1, 1, 1, 0)
    assert a == type(a)()
    table.release(pre, 2.0)
    table.release(hit, 2.0)
    table.release(dec, 2.0)
    assert table.stats()[Role.PREFILL].active_leases == 0 and table.stats()[Role.DECODE].active_leases == 0
    assert stats[Role.PREFILL].active_leases == 2  # a snapshot does not change afterwards


def test_gauges_return_to_zero_after_random_traffic():
    rng = random.Random(7)
    table = SessionTable("both", ttl_s=50, max_entries=20)
    held = []
    now = 0.0
    for _ in range(3000):
        now += rng.random()
        sid, role = f"s{rng.randrange(30)}", rng.choice(list(Role))
        op = rng.random()
        if op < 0.5:
            avail = {Target(f"w{i}") for i in range(3) if rng.random() < 0.8}
            found = table.lookup("m", sid, role, avail, now)
            binding = found.binding or (table.bind("m", sid, role, Target(f"w{rng.randrange(3)}"), now))
            if binding is not None:
                assert binding.target in avail or found.binding is None
                held.append(binding)
        elif op < 0.85 and held:
            assert table.release(held.pop(rng.randrange(len(held))), now)
        elif held:
            table.invalidate(rng.choice(held))
        if rng.random() < 0.05:
            table.expire(now)
        assert len(table) <= 20
        assert sum(s.active_leases for s in table.stats().values()) == len(held)
    for binding in held:
        assert table.release(binding, now)
    table.expire(now + 50)
    assert len(table) == 0
    assert all(s.active_leases == 0 and s.bindings == 0 for s in table.stats().values())


def test_stats_export_to_prometheus_by_role_only():
    from infera_router.metrics import RouterMetrics

    metrics = RouterMetrics()
    table = SessionTable("both")
    _, b = routed(table, Role.PREFILL, sid="secret-session")
    metrics.set_session_stats(table.stats())
    table.lookup("m", "secret-session", Role.PREFILL, ALL, 1.0)
    table.lookup("m", "secret-session", Role.PREFILL, ALL, 1.0)
    table.invalidate(b)
    metrics.set_session_stats(table.stats())
    metrics.set_session_stats(table.stats())  # exporting twice does not double count
    value = metrics.registry.get_sample_value
    assert value("infera_router_session_hits_total", {"role": "prefill"}) == 2
    assert value("infera_router_session_selections_total", {"role": "prefill"}) == 1
    assert value("infera_router_session_dropped_total", {"role": "prefill", "reason": "invalidated"}) == 1
    assert value("infera_router_session_active_leases", {"role": "prefill"}) == 3
    assert value("infera_router_session_bindings", {"role": "prefill"}) == 0
    assert value("infera_router_session_hits_total", {"role": "decode"}) == 0
    exposed = b"".join(m.name.encode() + repr(m.samples).encode() for m in metrics.registry.collect())
    assert b"secret-session" not in exposed
