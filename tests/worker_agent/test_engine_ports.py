"""A port the engine is to listen on that another process holds is refused before launch."""

import socket
import subprocess
import sys
import time

import pytest

from infera_common.models import default_model_path
from infera_common.ports import IN_USE, NOT_HERE, bind_failure
from infera_worker_agent.engine_cmd import plan_engine
from infera_worker_agent.engine_ports import bind_host, port_problems
from tests.worker_agent.recipe_fakes import SGLANG_PREFILL


def plan(engine, args):
    return plan_engine(engine, args, python="python3", free_port=41234, default_model_path="/m")


@pytest.fixture
def held_port():
    """A port something listens on, on 127.0.0.1 (as an engine left running would)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_listening_port_is_in_use_a_closed_one_free_and_a_foreign_address_not_here(held_port):
    assert bind_failure("127.0.0.1", held_port) == IN_USE and bind_failure("0.0.0.0", held_port) == IN_USE
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    assert bind_failure("127.0.0.1", free) is None
    assert bind_failure("192.0.2.7", free) == NOT_HERE  # TEST-NET-1: on no interface of this host
    assert bind_failure("no-such-host.invalid", free).startswith(f"{NOT_HERE}: it does not resolve")


@pytest.mark.parametrize("engine,args,host", [
    ("sglang", [], "127.0.0.1"),  # SGLang's default --host
    ("vllm", [], "0.0.0.0"),  # vLLM listens on every interface by default
    ("sglang", ["--host", "0.0.0.0"], "0.0.0.0"),
    ("vllm", ["--host", "::"], "::"),
    ("vllm", ["--host", "10.0.0.11"], "10.0.0.11"),
])
def test_the_port_is_tried_where_the_engine_binds(engine, args, host):
    assert bind_host(plan(engine, args)) == host


def test_the_http_port_and_an_sglang_prefills_bootstrap_port_are_checked():
    asked = []

    def taken(host, port):
        asked.append((host, port))
        return IN_USE

    problems = port_problems(plan("sglang", [*SGLANG_PREFILL, "--port", "30000"]), taken)
    assert asked == [("127.0.0.1", 30000), ("127.0.0.1", 8998)]  # SGLang's default bootstrap port
    assert "port 30000 on 127.0.0.1 is in use" in problems[0] and "--port" in problems[0]
    assert "bootstrap port 8998" in problems[1] and "--disaggregation-bootstrap-port" in problems[1]
    asked.clear()
    assert len(port_problems(plan("sglang", ["--port", "30000"]), taken)) == 1 and asked == [("127.0.0.1", 30000)]
    assert port_problems(plan("sglang", SGLANG_PREFILL), lambda host, port: None) == []


def test_an_engine_port_held_by_another_process_is_refused_in_seconds(held_port, nats_server, subprocess_env):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "infera_worker_agent", "--engine", "mock", "--nats-url", nats_server,
                        "--", "--model-path", str(default_model_path()), "--port", str(held_port)],
                       env=subprocess_env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "engine_spawned" not in r.stderr, r.stderr
    assert f"the engine's port {held_port} on 127.0.0.1 is in use" in r.stderr
    assert time.monotonic() - t0 < 15


def test_kv_event_ports_a_users_config_names_are_checked_and_the_agents_own_are_not():
    asked = []

    def taken(host, port):
        asked.append((host, port))
        return IN_USE if port == 5557 else None

    config = '{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600"}'
    user = plan_engine("sglang", ["--port", "30000", "--kv-events-config", config], python="python3", free_port=1,
                       default_model_path="/m", enable_kv_events=True, find_ports=lambda n: 47000)
    [problem] = port_problems(user, taken)
    assert asked == [("127.0.0.1", 30000), ("0.0.0.0", 5557), ("0.0.0.0", 5600)]
    assert "the KV-event port 5557 (DP rank 0: tcp://*:5557, from --kv-events-config) is in use" in problem
    asked.clear()
    own = plan_engine("sglang", ["--port", "30000"], python="python3", free_port=1, default_model_path="/m",
                      enable_kv_events=True, find_ports=lambda n: 5557)
    assert port_problems(own, taken) == [] and asked == [("127.0.0.1", 30000)]  # the agent's picks are free
    connects = '{"publisher": "zmq", "endpoint": "tcp://10.0.0.9:5557"}'  # the engine connects: nothing to bind
    asked.clear()
    port_problems(plan_engine("sglang", ["--kv-events-config", connects], python="python3", free_port=30000,
                              default_model_path="/m", enable_kv_events=True, find_ports=lambda n: 1), taken)
    assert asked == [("127.0.0.1", 30000)]


def test_an_engine_host_that_is_not_this_hosts_is_refused_once():
    asked = []

    def not_here(host, port):
        asked.append((host, port))
        return NOT_HERE

    [problem] = port_problems(plan("sglang", [*SGLANG_PREFILL, "--host", "10.9.9.9", "--port", "30000"]), not_here)
    assert problem.startswith("the engine's --host 10.9.9.9 is not an address of this host")
    assert asked == [("10.9.9.9", 30000)]  # the other ports on that host are not tried
