"""Workers on another request or KV-event plane than the router's: named, and not routed where they cannot serve."""

from infera_common.fleet import Change
from infera_common.settings import PlaneSettings

from infera_router.core import RouterCore
from infera_router.planes import plane_mismatches
from infera_router.policy_round_robin import RoundRobin

from router_helpers import record, route_request


def core(transport: str) -> RouterCore:
    c = RouterCore(RoundRobin(), "r1", 60.0, request_transport=transport)
    return c


def test_a_worker_on_the_other_request_transport_is_not_a_candidate():
    c = core("http")
    c.apply_change(Change("join", record("nats-w", request_transport="nats")))
    c.apply_change(Change("join", record("http-w", request_transport="http")))
    plan = c.plan(route_request())
    assert plan.status == 200 and [w.worker_id for w in plan.order] == ["http-w"]


def test_only_workers_on_the_other_transport_is_a_503_naming_the_flag():
    c = core("http")
    c.apply_change(Change("join", record("a", request_transport="nats")))
    plan = c.plan(route_request())
    assert plan.status == 503
    assert "--request-transport nats" in plan.message and "uses --request-transport http" in plan.message


def test_mismatches_name_each_flag_and_its_effect():
    ours = PlaneSettings(request_transport="http", kv_event_transport="zmq")
    same = record("a", request_transport="http", kv_event_transport="zmq")
    assert plane_mismatches(same, ours) == []
    other = record("b", request_transport="nats", kv_event_transport="nats")
    found = {m.flag: m for m in plane_mismatches(other, ours)}
    assert set(found) == {"--request-transport", "--kv-event-transport"}
    assert found["--request-transport"].worker == "nats" and found["--request-transport"].ours == "http"
    assert "cache-blind" in found["--kv-event-transport"].effect
