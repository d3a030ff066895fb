"""The agent's command line: its own flags, and everything else for the engine."""

import re

import pytest

from infera_common.subjects import TOKEN_RE
from infera_worker_agent.settings import parse_agent_cli


def test_unknown_args_go_to_the_engine_in_order():
    s, engine_args = parse_agent_cli(
        ["--engine", "sglang", "--model-path", "/m", "--max-pending", "8", "--tp", "2", "--port", "30000", "x"]
    )
    assert s.engine == "sglang" and s.max_pending == 8
    assert engine_args == ["--model-path", "/m", "--tp", "2", "--port", "30000", "x"]


def test_everything_after_double_dash_is_the_engines_even_agent_flag_names():
    s, engine_args = parse_agent_cli(["--engine", "mock", "--log-level", "warning", "--", "--log-level", "debug"])
    assert s.log_level == "warning"
    assert engine_args == ["--log-level", "debug"]


def test_defaults():
    s, engine_args = parse_agent_cli(["--engine", "vllm"])
    assert engine_args == []
    assert (s.max_pending, s.drain_timeout, s.health_timeout, s.engine_stop_timeout) == (512, 30.0, 1800.0, 10.0)
    assert (s.load_interval, s.discovery_ttl, s.role) == (1.0, 6.0, None)  # None: read from the engine flags
    assert (s.metrics_host, s.metrics_bind_port(), s.advertise_host) == ("127.0.0.1", 9200, None)
    assert re.fullmatch(r"vllm-[0-9a-f]{8}", s.worker_id) and TOKEN_RE.match(s.worker_id)


def test_env_var_sets_a_flag_and_the_command_line_wins(monkeypatch):
    monkeypatch.setenv("INFERA_MAX_PENDING", "7")
    assert parse_agent_cli(["--engine", "mock"])[0].max_pending == 7
    assert parse_agent_cli(["--engine", "mock", "--max-pending", "9"])[0].max_pending == 9


@pytest.mark.parametrize(
    "argv, needle",
    [
        ([], "--engine"),
        (["--engine", "tgi"], "--engine"),
        (["--engine", "mock", "--worker-id", "a.b"], "--worker-id"),
        (["--engine", "mock", "--max-pending", "0"], "--max-pending"),
        (["--engine", "mock", "--role", "both"], "--role"),
    ],
)
def test_bad_agent_flags_exit_2_naming_the_flag(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_agent_cli(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("host", ["10.0.0.11:30000", "http://10.0.0.11", "not a host", "node/1", ""])
def test_an_advertise_host_that_is_not_a_host_is_refused(host, capsys):
    # registered as http://HOST:PORT, it would give every router a URL it cannot call
    with pytest.raises(SystemExit) as exit_:
        parse_agent_cli(["--engine", "mock", "--advertise-host", host])
    assert exit_.value.code == 2
    assert "--advertise-host (env INFERA_ADVERTISE_HOST): a host name or IP address alone" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["10.0.0.11", "node-1.cluster.local", "gpu_node7", "fe80::1", "[::1]", "a."])
def test_host_names_and_addresses_are_accepted_as_advertise_host(host):
    assert parse_agent_cli(["--engine", "mock", "--advertise-host", host])[0].advertise_host == host


@pytest.mark.parametrize("typo, meant", [
    ("--discovery-backnd", "--discovery-backend"), ("--nats_url", "--nats-url"), ("--worker_id", "--worker-id"),
    ("--kv-events-transport=zmq", "--kv-event-transport"), ("--engine-pyhton", "--engine-python"),
])
def test_a_mistyped_agent_flag_is_refused_not_handed_to_the_engine(typo, meant, capsys):
    # it used to reach the engine (the mock ignores flags it does not know) while the agent ran on its defaults
    with pytest.raises(SystemExit) as exit_:
        parse_agent_cli(["--engine", "mock", typo, "x"] if "=" not in typo else ["--engine", "mock", typo])
    assert exit_.value.code == 2
    name = typo.split("=")[0]
    assert f"{name} is not a flag of the agent, and would go to the engine as written: did you mean {meant}?" in (
        capsys.readouterr().err)
    # after `--` it is the engine's, as written
    assert parse_agent_cli(["--engine", "mock", "--", typo])[1] == [typo]


def test_no_flag_of_the_mock_engine_is_taken_for_a_mistyped_agent_flag():
    from infera_mock_engine.main import build_parser as mock_parser
    from infera_common.typos import near_misses
    from infera_worker_agent.settings import agent_flags

    agent = agent_flags()
    mock = [o for a in mock_parser()._actions for o in a.option_strings if o.startswith("--") and o not in agent]
    assert len(mock) > 20 and near_misses(mock, agent) == []
