"""`infera up --discovery-backend etcd`: every process of the plan discovers the fleet in the same etcd."""

from __future__ import annotations

from infera.fleet_plan import plan_fleet
from infera_common.settings import parse_cli
from infera_frontend.settings import FrontendSettings
from infera_kv_indexer.settings import KvIndexerSettings
from infera_router.settings import RouterSettings
from infera_worker_agent.settings import parse_agent_cli

SETTINGS = {"kv-indexer": KvIndexerSettings, "router": RouterSettings, "frontend": FrontendSettings}


def _settings(role: str, args: list[str]):
    """The settings a process of the plan parses from its arguments."""
    if role == "server":
        from infera.server_settings import ServerSettings

        return parse_cli(ServerSettings, args, prog=role)[0]
    if role == "worker":
        return parse_agent_cli(args)[0]
    return parse_cli(SETTINGS[role], args, prog=role)[0]


def _plane(role: str, args: list[str]):
    settings = _settings(role, args)
    return settings.discovery_backend, settings.etcd_endpoint, settings.nats_url


def test_every_process_of_an_etcd_fleet_uses_that_etcd_and_still_nats_for_requests():
    plan = plan_fleet(nats_url="nats://127.0.0.1:4222", host="127.0.0.1", port=8000, workers=2, router_policy=None,
                      engine_args=[], metrics_ports=[1, 2, 3, 4], etcd_endpoint="127.0.0.1:23790")
    assert sorted(p.role for p in plan) == ["frontend", "kv-indexer", "router", "worker", "worker"]
    assert {_plane(p.role, p.args) for p in plan} == {("etcd", "127.0.0.1:23790", "nats://127.0.0.1:4222")}


def test_the_default_fleet_stays_on_nats_discovery():
    plan = plan_fleet(nats_url="nats://127.0.0.1:4222", host="127.0.0.1", port=8000, workers=1, router_policy=None,
                      engine_args=[], metrics_ports=[1, 2, 3])
    assert {_plane(p.role, p.args)[0] for p in plan} == {"nats"}


def _planes(role: str, args: list[str]) -> tuple[str, str, str]:
    settings = _settings(role, args)
    return settings.discovery_backend, settings.request_transport, settings.kv_event_transport


def test_the_no_broker_plane_is_one_server_and_workers_with_no_nats_url():
    plan = plan_fleet(nats_url="nats://127.0.0.1:4222", host="127.0.0.1", port=8000, workers=2,
                      router_policy="round-robin", engine_args=[], metrics_ports=[1, 2, 3, 4],
                      etcd_endpoint="127.0.0.1:23790", request_transport="http", kv_event_transport="zmq")
    assert sorted(p.role for p in plan) == ["server", "worker", "worker"]
    assert {_planes(p.role, p.args) for p in plan} == {("etcd", "http", "zmq")}
    assert not any("--nats-url" in p.args for p in plan)
    server = next(p for p in plan if p.role == "server")
    assert server.module == "infera.server" and "--router-policy" in server.args


def test_a_transport_on_http_with_nats_discovery_keeps_the_separate_services_on_nats():
    plan = plan_fleet(nats_url="nats://127.0.0.1:4222", host="127.0.0.1", port=8000, workers=1, router_policy=None,
                      engine_args=[], metrics_ports=[1, 2, 3], request_transport="http")
    assert sorted(p.role for p in plan) == ["frontend", "kv-indexer", "router", "worker"]
    assert {_planes(p.role, p.args) for p in plan} == {("nats", "http", "nats")}
    assert all("--nats-url" in p.args for p in plan)


def test_an_otlp_endpoint_reaches_every_process_of_both_planes():
    url = "http://127.0.0.1:4318/v1/traces"
    for planes in ({}, {"etcd_endpoint": "127.0.0.1:23790", "request_transport": "http", "kv_event_transport": "zmq"}):
        plan = plan_fleet(nats_url="nats://127.0.0.1:4222", host="127.0.0.1", port=8000, workers=2,
                          router_policy=None, engine_args=[], metrics_ports=[1, 2, 3, 4],
                          otlp_traces_endpoint=url, **planes)
        assert {_settings(p.role, p.args).otlp_traces_endpoint for p in plan} == {url}
    plan = plan_fleet(nats_url="nats://127.0.0.1:4222", host="127.0.0.1", port=8000, workers=1, router_policy=None,
                      engine_args=[], metrics_ports=[1, 2, 3])
    assert not any("--otlp-traces-endpoint" in p.args for p in plan)
