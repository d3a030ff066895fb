import random

from infera_common.schemas import WorkerStatus

from infera_router.core import RouterCore
from infera_router.policy_least_loaded import LeastLoaded
from infera_router.policy_round_robin import RoundRobin

from router_helpers import join, leave, load, route_request, update


def core(policy=None, max_age: float = 100.0) -> RouterCore:
    return RouterCore(policy or RoundRobin(), "r1", max_age)


def ids(plan) -> list[str]:
    return [w.worker_id for w in plan.order]


def test_unknown_model_is_404_and_no_active_worker_is_503():
    c = core()
    assert c.plan(route_request("m")).status == 404
    c.apply_change(join("a", status=WorkerStatus.STARTING))
    c.apply_change(join("b", status=WorkerStatus.DRAINING))
    c.apply_change(join("c", status=WorkerStatus.UNHEALTHY))
    c.apply_change(join("d", status=WorkerStatus.UNHEALTHY))
    plan = c.plan(route_request("m"))
    assert plan.status == 503 and "(1 starting, 1 draining, 2 unhealthy)" in plan.message
    assert c.plan(route_request("other")).status == 404


def test_only_active_workers_get_work_and_status_changes_apply():
    c = core()
    c.apply_change(join("a"))
    c.apply_change(join("b"))
    assert {ids(c.plan(route_request()))[0] for _ in range(4)} == {"a", "b"}
    c.apply_change(update("a", status=WorkerStatus.DRAINING))
    assert [ids(c.plan(route_request())) for _ in range(3)] == [["b"]] * 3
    c.apply_change(update("a", status=WorkerStatus.ACTIVE))
    assert sorted(ids(c.plan(route_request()))) == ["a", "b"]


def test_exclude_is_honoured():
    c = core()
    for wid in "abc":
        c.apply_change(join(wid))
    for _ in range(4):
        assert "b" not in ids(c.plan(route_request(exclude=["b"])))
    plan = c.plan(route_request(exclude=["a", "b", "c"]))
    assert plan.status == 503 and "excluded" in plan.message


def test_worker_moving_to_another_model_leaves_the_old_one():
    c = core()
    c.apply_change(join("a", model="m1"))
    c.apply_change(update("a", model="m2"))
    assert c.plan(route_request("m1")).status == 404
    assert ids(c.plan(route_request("m2"))) == ["a"]


def test_a_workers_aliases_route_to_it_and_follow_its_record():
    c = core()
    c.apply_change(join("a", model="m", aliases=["m-latest", "m"]))
    c.apply_change(join("b", model="m"))
    assert ids(c.plan(route_request("m-latest"))) == ["a"]
    assert sorted(ids(c.plan(route_request("m")))) == ["a", "b"]
    c.apply_change(join("a", model="m", aliases=["m-next"]))  # its engine restarted with another alias
    assert c.plan(route_request("m-latest")).status == 404 and ids(c.plan(route_request("m-next"))) == ["a"]
    c.apply_change(leave("a", model="m", aliases=["m-next"]))
    assert c.plan(route_request("m-next")).status == 404 and ids(c.plan(route_request("m"))) == ["b"]


def test_leases_count_on_the_worker_and_are_released():
    c = core()
    c.apply_change(join("a"))
    worker = c.fleet.get("a")
    l1 = c.acquire(worker, route_request(prompt_tokens=30), now=1.0)
    l2 = c.acquire(worker, route_request(prompt_tokens=12), now=1.0)
    assert (worker.in_flight, worker.in_flight_tokens) == (2, 42)
    assert c.release(l1.lease_id) == l1
    assert c.release(l1.lease_id) is None
    assert (worker.in_flight, worker.in_flight_tokens) == (1, 12)
    assert c.leases.get(l2.lease_id).request_id == "r"


def test_a_request_for_several_samples_counts_each_of_them():
    """n = 4 samples of a 100-token prompt: the engine runs 4 sequences and, once they decode, each
    reads the prompt's context every step; the prefill is computed once."""
    c = core()
    c.apply_change(join("a"))
    worker = c.fleet.get("a")
    lease = c.acquire(worker, route_request(prompt_tokens=100, samples=4, sequences=4), now=1.0)
    assert (worker.in_flight, worker.in_flight_sequences, worker.prefill_tokens) == (1, 4, 100)
    c.prefilled(lease.lease_id)
    assert (worker.prefill_tokens, worker.decode_tokens) == (0, 400)
    c.release(lease.lease_id)
    assert (worker.in_flight, worker.in_flight_sequences, worker.decode_tokens) == (0, 0, 0)


def test_a_worker_gone_past_its_grace_takes_its_leases_and_load_with_it():
    c = core()
    c.apply_change(join("a", started_at=5.0))
    c.apply_change(join("b"))
    a, b = c.fleet.get("a"), c.fleet.get("b")
    assert c.apply_load(load("a", in_flight=3))
    held = [c.acquire(a, route_request(), 1.0) for _ in range(3)]
    c.acquire(b, route_request(), 1.0)
    assert c.apply_change(leave("a", started_at=5.0, ttl=6.0), now=10.0) == []
    assert c.departed("a") and c.leases.counts() == {"a": 3, "b": 1}  # kept, for one discovery TTL
    assert c.departures(15.9) == []
    [(gone, dropped)] = c.departures(16.0)
    assert gone == "a" and sorted(x.lease_id for x in dropped) == sorted(x.lease_id for x in held)
    assert c.leases.counts() == {"b": 1} and not c.departed("a")
    assert all(c.release(x.lease_id) is None for x in held)  # late releases are ignored
    c.apply_change(join("a", started_at=5.0))  # it comes back fresh
    fresh = c.fleet.get("a")
    assert fresh.load is None and fresh.in_flight == 0


def test_a_worker_back_within_its_grace_counts_its_leases_again():
    """Discovery lost it for a moment (an etcd stall, a broker outage): its requests ran on."""
    c = core()
    c.apply_change(join("a", started_at=5.0))
    c.apply_change(join("b"))
    held = [c.acquire(c.fleet.get("a"), route_request(prompt_tokens=40), 1.0) for _ in range(2)]
    c.apply_change(leave("a", started_at=5.0), now=10.0)
    assert c.plan(route_request()).order == [c.fleet.get("b")]  # gone from routing meanwhile
    c.release(held[0].lease_id, "ok", 11.0)  # its agent answers through the outage
    c.apply_change(join("a", started_at=5.0), now=12.0)
    back = c.fleet.get("a")
    assert (back.in_flight, back.in_flight_tokens, back.prefill_tokens) == (1, 40, 40)
    assert c.departures(100.0) == []  # nothing dropped later
    c.release(held[1].lease_id, "ok", 13.0)
    assert (back.in_flight, back.in_flight_tokens, back.prefill_tokens) == (0, 0, 0)


def test_a_worker_back_from_another_start_drops_the_leases_of_the_old_one():
    c = core()
    c.apply_change(join("a", started_at=5.0))
    held = c.acquire(c.fleet.get("a"), route_request(), 1.0)
    c.apply_change(leave("a", started_at=5.0), now=10.0)
    dropped = c.apply_change(join("a", started_at=11.0), now=11.5)  # its agent restarted: nothing runs there
    assert [x.lease_id for x in dropped] == [held.lease_id] and c.fleet.get("a").in_flight == 0
    assert c.release(held.lease_id, "ok") is None


def test_leases_of_a_router_calling_the_engine_itself_stay_until_its_calls_end():
    c = RouterCore(RoundRobin(), "r1", 100.0, request_transport="http")
    c.apply_change(join("a", request_transport="http"))
    lease = c.acquire(c.fleet.get("a"), route_request(), 1.0)
    c.apply_change(leave("a", request_transport="http"), now=2.0)
    assert c.departures(10**6) == [] and c.departed("a")  # its own call ends it, answered or failed
    assert c.release(lease.lease_id, "error", 3.0) is not None
    assert not c.departed("a") and len(c.leases) == 0 and c.breaker.snapshot(3.0) == {}  # forgotten with it


def test_load_report_from_unknown_worker_is_ignored():
    c = core()
    assert c.apply_load(load("ghost", in_flight=9)) is False
    c.apply_change(join("ghost"))
    assert c.fleet.get("ghost").load is None


def test_max_age_safety_net_unaccounts_the_worker():
    c = core(max_age=10.0)
    c.apply_change(join("a"))
    a = c.fleet.get("a")
    c.acquire(a, route_request(prompt_tokens=5), now=0.0)
    young = c.acquire(a, route_request(prompt_tokens=7), now=8.0)
    assert c.expire(now=9.0) == []
    assert len(c.expire(now=10.0)) == 1
    assert (a.in_flight, a.in_flight_tokens) == (1, 7) and young.lease_id in c.leases


def test_least_loaded_spreads_by_leases_through_the_core():
    c = core(LeastLoaded(random.Random(3)))
    for wid in "abc":
        c.apply_change(join(wid))
    picked = []
    for _ in range(6):
        first = c.plan(route_request()).order[0]
        c.acquire(first, route_request(), 1.0)
        picked.append(first.worker_id)
    assert sorted(picked) == ["a", "a", "b", "b", "c", "c"]


def test_counters_match_leases_after_many_mixed_operations():
    rng = random.Random(5)
    c = core(LeastLoaded(random.Random(5)), max_age=50.0)
    now = 0.0
    for step in range(3000):
        now += rng.random()
        op = rng.random()
        wid = f"w{rng.randrange(4)}"
        if op < 0.05:  # with leases: kept for a TTL, back with the same start or another (restarted)
            c.apply_change(leave(wid, started_at=1.0), now=now)
        elif op < 0.15:
            c.apply_change(join(wid, status=rng.choice(list(WorkerStatus)), started_at=rng.choice((1.0, 1.0, 2.0))),
                           now=now)
        elif op < 0.6:
            plan = c.plan(route_request(prompt_tokens=rng.randrange(50)))
            if plan.status == 200:
                n = rng.choice((1, 1, 4))
                c.acquire(plan.order[0], route_request(prompt_tokens=rng.randrange(50), samples=n,
                                                       sequences=n * rng.choice((1, 3))), now)
            else:
                assert plan.status in (404, 503)
        elif op < 0.7 and len(c.leases):
            counts = c.leases.counts()
            c.prefilled(rng.choice(c.leases.held(rng.choice(list(counts)))).lease_id)
        elif op < 0.9 and len(c.leases):
            counts = c.leases.counts()
            victim = rng.choice(list(counts))
            lease = rng.choice(c.leases.held(victim))
            assert c.release(lease.lease_id) is not None
        else:
            c.expire(now)
        counts = c.leases.counts()
        for w in c.fleet.workers():
            held = c.leases.held(w.worker_id)
            assert w.in_flight == len(held) == counts.get(w.worker_id, 0)
            assert w.in_flight_tokens == sum(x.prompt_tokens for x in held)
            assert w.in_flight_sequences == sum(x.sequences for x in held)
            assert w.decode_tokens == sum(x.prompt_tokens * x.samples for x in held if x.prefilled)
            assert w.prefill_tokens == sum(x.prefill_tokens for x in held if not x.prefilled)
        assert set(counts) <= {w.worker_id for w in c.fleet.workers()} | set(c._departed)
        c.departures(now)
    for w in c.fleet.workers():
        c.apply_change(leave(w.worker_id))
    c.departures(now + 10)
    assert len(c.leases) == 0 and len(c.fleet) == 0


def test_heartbeat_update_keeps_counters_and_rotation():
    c = core()
    c.apply_change(join("a"))
    c.apply_change(join("b"))
    a = c.fleet.get("a")
    c.acquire(a, route_request(), 1.0)
    assert ids(c.plan(route_request()))[0] == "a"
    c.apply_change(update("a"))  # a heartbeat re-puts the same record
    assert c.fleet.get("a") is a and a.in_flight == 1
    assert ids(c.plan(route_request()))[0] == "b"


def test_workers_off_the_bus_sit_out_unless_every_candidate_is_off_it():
    c = core()
    for wid in ("a", "b"):
        c.apply_change(join(wid))
        c.apply_load(load(wid, report_every=1.0), now=10.0)
    assert c.overdue(11.4) == []  # not yet 1.5 x its period late
    assert sorted(w for w, _ in c.overdue(11.6)) == ["a", "b"]
    assert c.overdue(11.7) == []  # asked already: not again within its period
    assert c.mark_off_bus("b", 10.0)
    assert [ids(c.plan(route_request())) for _ in range(3)] == [["a"]] * 3
    assert not c.mark_off_bus("a", 9.0)  # it reported after the question went out: still on the bus
    c.apply_load(load("a", report_every=1.0), now=12.0)
    assert c.mark_off_bus("a", 12.0)  # both gone: route anyway (discovery still lists them)
    assert sorted(ids(c.plan(route_request()))) == ["a", "b"]
    c.apply_load(load("b", report_every=1.0), now=13.0)  # b reports again: back in
    assert c.back_on_bus == ["b"] and [ids(c.plan(route_request())) for _ in range(2)] == [["b"]] * 2
