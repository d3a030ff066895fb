"""compose.yaml and docker/Dockerfile cannot run here (no Docker engine): check them against the code.

Every service command must name a real console script and parse with that service's own settings
(and, for workers, the engine arguments with the mock engine's own parser); the topology must be
the one `infera up` starts.
"""

from __future__ import annotations

import tomllib
from collections import Counter
from pathlib import Path

import pytest
import yaml

from infera.fleet_plan import plan_fleet
from infera_common.models import BUNDLED_MODEL_NAME, default_model_path
from infera_common.settings import parse_cli
from infera_frontend.settings import FrontendSettings
from infera_kv_indexer.settings import KvIndexerSettings
from infera_mock_engine.main import parse_args as parse_mock_args
from infera_router.settings import RouterSettings
from infera_worker_agent.engine_cmd import plan_engine
from infera_worker_agent.settings import AgentSettings, parse_agent_cli

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
ROLE_OF_SCRIPT = {"infera-kv-indexer": "kv-indexer", "infera-router": "router", "infera-frontend": "frontend", "infera-worker-agent": "worker"}


def _service_commands() -> dict[str, list[str]]:
    return {name: svc["command"] for name, svc in COMPOSE["services"].items() if name != "nats"}


def _parse(role: str, args: list[str]):
    """Parse a service command line exactly as the service does; returns what matters for topology."""
    if role == "router":
        settings, _ = parse_cli(RouterSettings, args, prog="infera-router")
        return {"policy": settings.router_policy}
    if role == "kv-indexer":
        settings, _ = parse_cli(KvIndexerSettings, args, prog="infera-kv-indexer")
        return {"port": settings.metrics_port}
    if role == "frontend":
        settings, _ = parse_cli(FrontendSettings, args, prog="infera-frontend")
        return {"port": settings.port}
    settings, engine_args = parse_agent_cli(args)
    plan = plan_engine(settings.engine, engine_args, python="python", free_port=30000,
                       default_model_path=str(default_model_path()), advertise_host=settings.advertise_host)
    config, _ = parse_mock_args(list(plan.argv[3:]))
    assert not config.ignored_args, f"mock engine would ignore {config.ignored_args}"
    return {"engine": settings.engine, "worker_id": settings.worker_id, "model": config.served_model_names[0]}


@pytest.mark.parametrize("name", sorted(_service_commands()))
def test_compose_command_is_a_real_entry_point_with_valid_flags(name):
    command = _service_commands()[name]
    assert command[0] in SCRIPTS, f"{name}: {command[0]} is not a console script of this distribution"
    _parse(ROLE_OF_SCRIPT[command[0]], command[1:])


def test_compose_services_use_the_nats_service_and_the_image_built_here():
    nats = COMPOSE["services"]["nats"]
    assert "-js" in nats["command"]
    for name, cmd in _service_commands().items():
        assert cmd[cmd.index("--nats-url") + 1] == "nats://nats:4222", name
        assert COMPOSE["services"][name]["build"]["dockerfile"] == "docker/Dockerfile"
    assert (ROOT / "docker" / "Dockerfile").is_file()


def test_compose_topology_matches_infera_up():
    plan = plan_fleet(nats_url="nats://x:1", host="127.0.0.1", port=8000, workers=2, router_policy=None,
                      engine_args=[], metrics_ports=[1, 2, 3, 4])
    up_roles = Counter(p.role for p in plan)
    compose_roles = Counter(ROLE_OF_SCRIPT[c[0]] for c in _service_commands().values())
    assert compose_roles == up_roles
    up_workers = sorted((_parse("worker", p.args)["worker_id"], _parse("worker", p.args)["model"])
                        for p in plan if p.role == "worker")
    compose_workers = sorted((_parse("worker", c[1:])["worker_id"], _parse("worker", c[1:])["model"])
                             for c in _service_commands().values() if c[0] == "infera-worker-agent")
    assert up_workers == compose_workers == [("mock-1", BUNDLED_MODEL_NAME), ("mock-2", BUNDLED_MODEL_NAME)]
    assert {_parse("router", p.args)["policy"] for p in plan if p.role == "router"} == {
        _parse("router", c[1:])["policy"] for c in _service_commands().values() if c[0] == "infera-router"}


def test_dockerfile_installs_the_distribution_and_runs_a_console_script():
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert "pip install ." in text
    cmd_line = next(line for line in text.splitlines() if line.startswith("CMD"))
    assert any(f'"{script}"' in cmd_line for script in SCRIPTS)


def test_every_console_script_resolves():
    import importlib

    for script, target in SCRIPTS.items():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), script


def test_compose_nats_runs_with_the_settings_infera_up_gives_its_nats_server():
    """The payload limit and the ping that drops a frozen client: the same in both deployments."""
    from infera.procs import nats_config

    nats = COMPOSE["services"]["nats"]
    conf_host_path = nats["volumes"][0].split(":")[0]
    assert nats["command"][nats["command"].index("-c") + 1] == nats["volumes"][0].split(":")[1]
    text = (ROOT / conf_host_path).read_text()
    settings = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert settings == nats_config().splitlines()


def _seconds(duration: str) -> float:
    assert duration.endswith("s") and duration[:-1].isdigit(), f"write compose durations as e.g. 45s: {duration!r}"
    return float(duration[:-1])


def test_compose_lets_the_frontend_and_the_workers_drain_before_docker_kills_them():
    """Docker SIGKILLs a container 10 s after SIGTERM unless told otherwise: shorter than what the
    frontend and the worker-agents take, by default, to finish the answers under way."""
    services = COMPOSE["services"]
    frontend_needs = FrontendSettings.model_fields["drain_timeout"].default
    assert _seconds(services["frontend"].get("stop_grace_period", "10s")) > frontend_needs
    agent = AgentSettings.model_fields
    worker_needs = agent["drain_timeout"].default + agent["engine_stop_timeout"].default
    workers = [svc for svc in services.values() if svc["command"][0] == "infera-worker-agent"]
    assert workers and all(_seconds(w.get("stop_grace_period", "10s")) > worker_needs for w in workers)
