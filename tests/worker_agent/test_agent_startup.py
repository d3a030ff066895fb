"""Startup failures: each ends the agent quickly, with a clear reason, leaving nothing behind."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from infera_common.discovery import Watcher
from infera_common.models import default_model_path
from infera_common.nats_conn import connect

from .agent_proc import AgentProc, alive, group_members, wait_until

MODEL = str(default_model_path())  # a model directory that is there (tokenizer and config.json)


@pytest.fixture
def agent(nats_server, tmp_path, subprocess_env):
    started: list[AgentProc] = []

    def start(worker_id, agent_args=None, engine_args=None) -> AgentProc:
        a = AgentProc(nats_server, tmp_path, subprocess_env, worker_id, agent_args, engine_args).start()
        started.append(a)
        return a

    yield start
    for a in started:
        a.cleanup()


async def test_engine_failing_at_startup_ends_the_agent_with_its_code_and_output(nats_server, agent):
    nc = await connect(nats_server, "t")
    changes = []
    watcher = Watcher(nc.jetstream(), on_change=changes.append)
    await watcher.start()
    try:
        t0 = time.monotonic()
        a = agent("w-bad-model", engine_args=["--model-path", "/nonexistent/model"])
        code = await asyncio.to_thread(a.wait, 30)
        assert code == 2  # the mock engine's own exit status (argparse error)
        assert time.monotonic() - t0 < 20
        failed = a.event("engine_exited_during_startup")
        assert failed is not None and failed["exit_code"] == 2
        assert any("not a local directory" in line for line in failed["output_tail"])
        await asyncio.sleep(0.3)
        assert watcher.view.get("w-bad-model") is None  # announced as starting, then removed
        assert not alive(a.watchdog_pid())
    finally:
        await watcher.stop()
        await nc.close()


def test_health_timeout_stops_the_engine_and_fails(agent):
    a = agent("w-slow", ["--health-timeout", "1"], ["--startup-delay", "60"])
    engine_pid = a.engine_pid()
    assert a.wait(30) == 1
    assert a.event("engine_health_timeout") is not None
    assert not alive(engine_pid) and not group_members(engine_pid)


def test_sigterm_during_startup_stops_cleanly(agent):
    a = agent("w-early-stop", engine_args=["--startup-delay", "60"])
    engine_pid = a.engine_pid()
    os.kill(a.pid, signal.SIGTERM)
    assert a.wait(20) == 0
    assert a.event("stopped_during_startup") is not None
    assert wait_until(lambda: not alive(engine_pid), 5)


def _run_agent(args, env, timeout=20.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infera_worker_agent", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_unusable_engine_port_fails_before_anything_starts(nats_server, subprocess_env):
    r = _run_agent(["--engine", "sglang", "--nats-url", nats_server, "--port", "http"], subprocess_env)
    assert r.returncode == 2
    assert "--port" in r.stderr and "engine_spawned" not in r.stderr


def test_busy_metrics_port_fails_before_the_engine_starts(nats_server, subprocess_env):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = _run_agent(["--engine", "mock", "--nats-url", nats_server, "--metrics-port", str(port)], subprocess_env)
    assert r.returncode == 2
    assert "--metrics-port" in r.stderr and "engine_spawned" not in r.stderr


def test_a_plane_mix_that_cannot_work_is_refused_naming_the_flag(nats_server, subprocess_env):
    r = _run_agent(["--engine", "mock", "--nats-url", nats_server, "--request-transport", "http",
                    "--advertise-host", "0.0.0.0"], subprocess_env)
    assert r.returncode == 2
    assert "--advertise-host" in r.stderr and "--request-transport http" in r.stderr
    assert "engine_spawned" not in r.stderr


@pytest.mark.parametrize("engine,engine_args,fix", [
    ("sglang", ["--page-size", "16"], "--kv-index-block-size 32"),
    ("vllm", [], "--kv-index-block-size 32"),  # vLLM's default --block-size 16
])
def test_an_index_block_size_the_page_cannot_fold_into_is_refused_before_launch(nats_server, subprocess_env, engine,
                                                                                 engine_args, fix):
    r = _run_agent(["--engine", engine, "--nats-url", nats_server, "--kv-index-block-size", "24", *engine_args],
                   subprocess_env)
    assert r.returncode == 2, r.stderr
    assert "--kv-index-block-size 24 is not a multiple" in r.stderr and fix in r.stderr
    assert "engine_spawned" not in r.stderr


def test_a_vllm_without_metrics_is_refused_before_launch(nats_server, subprocess_env):
    r = _run_agent(["--engine", "vllm", "--nats-url", nats_server, "--", "--model", MODEL, "--disable-log-stats"],
                   subprocess_env)
    assert r.returncode == 2 and "--disable-log-stats" in r.stderr and "engine_spawned" not in r.stderr, r.stderr


@pytest.mark.parametrize("engine,model_flag", [("sglang", "--model-path"), ("vllm", "--model")])
def test_a_model_path_that_is_not_there_is_refused_in_seconds_naming_the_models_beside_it(
        nats_server, subprocess_env, tmp_path, engine, model_flag):
    (tmp_path / "Qwen3-8B").mkdir()
    (tmp_path / "Qwen3-8B" / "config.json").write_text("{}")
    base = ["--engine", engine, "--nats-url", nats_server, "--", model_flag]
    t0 = time.monotonic()
    r = _run_agent([*base, str(tmp_path / "Qwen3-8b")], subprocess_env)  # the runbook's typo
    assert r.returncode == 2 and "engine_spawned" not in r.stderr, r.stderr
    assert f"{model_flag} {tmp_path / 'Qwen3-8b'} does not exist on this host" in r.stderr
    assert time.monotonic() - t0 < 15  # seconds, not an engine's cold start
    r = _run_agent([*base, str(tmp_path)], subprocess_env)  # the folder above the model
    assert r.returncode == 2 and f"the model directories in it: {tmp_path / 'Qwen3-8B'}" in r.stderr, r.stderr


def test_unreachable_etcd_fails_before_the_engine_starts(nats_server, subprocess_env):
    r = _run_agent(["--engine", "mock", "--nats-url", nats_server, "--discovery-backend", "etcd",
                    "--etcd-endpoint", "127.0.0.1:1", "--metrics-port", "0"], subprocess_env)
    assert r.returncode == 1
    assert "discovery_unreachable" in r.stderr and "--etcd-endpoint" in r.stderr and "engine_spawned" not in r.stderr
