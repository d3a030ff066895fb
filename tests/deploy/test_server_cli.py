"""`python -m infera.server` refuses what cannot work at once, with a message that says what to change."""

from __future__ import annotations

import subprocess
import sys

import pytest

from infera.procs import free_port
from infera.server_settings import ServerSettings
from infera_common.settings import parse_cli

NO_BROKER = ["--discovery-backend", "etcd", "--request-transport", "http", "--kv-event-transport", "zmq"]


def server(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infera.server", "--port", "0", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def test_the_runbook_flags_parse_into_one_settings_object():
    settings, _ = parse_cli(ServerSettings, [
        "--host", "0.0.0.0", "--port", "8000", "--etcd-endpoint", "10.0.0.10:2379",
        "--router-tokenizer-path", str(ServerSettings().model_path), *NO_BROKER, "--router-policy", "round-robin",
        "--session-affinity", "both", "--session-affinity-ttl-seconds", "120",
        "--pd-prefill-guard-release", "completion", "--router-backend", "python",
    ], prog="python -m infera.server")
    assert (settings.host, settings.port, settings.etcd_endpoint) == ("0.0.0.0", 8000, "10.0.0.10:2379")
    assert (settings.router_policy, settings.session_affinity, settings.session_affinity_ttl_seconds) == (
        "round-robin", "both", 120)
    assert settings.pd_prefill_guard_release == "completion" and not settings.needs_nats()


@pytest.mark.parametrize("backend", ["sglang", "rust"])
def test_another_router_backend_is_refused_naming_the_python_one(backend, subprocess_env):
    out = server("--router-backend", backend, env=subprocess_env)
    assert out.returncode == 2
    assert "--router-backend" in out.stderr and "this build's router is the Python one" in out.stderr


def test_unreachable_etcd_fails_at_once_naming_the_endpoint(subprocess_env):
    port = free_port()
    out = server("--etcd-endpoint", f"127.0.0.1:{port}", *NO_BROKER, env=subprocess_env)
    assert out.returncode == 1
    assert f"127.0.0.1:{port}" in out.stderr and "--etcd-endpoint" in out.stderr


def test_metrics_port_is_one_setting_with_each_process_s_own_default(monkeypatch):
    from infera_kv_indexer.settings import KvIndexerSettings
    from infera_router.settings import RouterSettings
    from infera_worker_agent.settings import parse_agent_cli

    def ports() -> list[int | None]:
        agent, _ = parse_agent_cli(["--engine", "mock"])
        return [parse_cli(cls, [], prog="p")[0].metrics_bind_port()
                for cls in (RouterSettings, KvIndexerSettings, ServerSettings)] + [agent.metrics_bind_port()]

    # apart by default, so that the services of one host do not collide; the server's /metrics is on --port
    assert ports() == [9100, 9300, None, 9200]
    monkeypatch.setenv("INFERA_METRICS_PORT", "0")  # one variable, one meaning, for every process
    assert ports() == [0, 0, 0, 0]


def test_the_server_serves_metrics_apart_on_a_free_port_when_asked(nats_server, subprocess_env):
    import re
    import urllib.request

    proc = subprocess.Popen([sys.executable, "-m", "infera.server", "--port", "0", "--nats-url", nats_server,
                             "--metrics-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=subprocess_env)
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()
        found = re.search(r"/metrics also on (http://\S+/metrics)", banner)
        assert found, banner
        with urllib.request.urlopen(found.group(1), timeout=10) as resp:
            body = resp.read().decode()
        assert "infera_frontend_requests" in body and "infera_router_" in body
    finally:
        proc.terminate()
        proc.wait(timeout=30)
