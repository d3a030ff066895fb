"""`python -m infera.engine.sglang|vllm|mock`: the agent's flags parsed, the rest to the engine in
order, and `--print-command` showing what would run without running it."""

import importlib.util
import os
import subprocess
import sys

import pytest

from infera.engine import run
from infera_worker_agent.settings import parse_agent_cli

RUNBOOK_DECODE = ["--model-path", "/models/m", "--tp", "8", "--dp", "8", "--enable-dp-attention",
                  "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake",
                  "--host", "0.0.0.0", "--port", "30000"]


def run_module(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_agent_flags_are_parsed_and_everything_else_goes_to_the_engine_in_order():
    argv = ["--engine", "sglang", "--model-path", "/m", "--advertise-host", "10.0.0.11", "--tp", "8",
            "--etcd-endpoint", "10.0.0.10:2379", "--no-enable-kv-events", "--disaggregation-allow-tcp",
            "--drain-timeout", "90", "--print-command", "--disaggregation-mode", "decode", "--port", "30000"]
    settings, engine_args = parse_agent_cli(argv)
    assert engine_args == ["--model-path", "/m", "--tp", "8", "--disaggregation-mode", "decode", "--port", "30000"]
    assert (settings.advertise_host, settings.etcd_endpoint, settings.enable_kv_events) == (
        "10.0.0.11", "10.0.0.10:2379", False)
    assert (settings.disaggregation_allow_tcp, settings.drain_timeout, settings.print_command) == (True, 90.0, True)
    defaults, _ = parse_agent_cli(["--engine", "vllm"])
    assert (defaults.enable_kv_events, defaults.disaggregation_allow_tcp, defaults.print_command) == (
        True, False, False)


def test_print_command_shows_the_engine_argv_and_launches_nothing():
    out = run_module("infera.engine.sglang", "--print-command", "--advertise-host", "10.0.0.12",
                     "--disaggregation-allow-tcp", "--nats-url", "nats://127.0.0.1:1", *RUNBOOK_DECODE)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "# engine command:" in text and "-m sglang.launch_server" in text
    command = text.split("# engine command:\n", 1)[1].split("# notes:", 1)[0]
    tokens = command.replace("\\\n", " ").split()
    assert tokens[3:3 + len(RUNBOOK_DECODE)] == RUNBOOK_DECODE  # verbatim, in order, right after -m module
    for added in ("--enable-metrics", "--kv-events-config", "--disaggregation-decode-enable-radix-cache",
                  "--kv-cache-dtype"):
        assert added in tokens[3 + len(RUNBOOK_DECODE):]
    assert "--advertise-host" not in tokens and "--disaggregation-allow-tcp" not in tokens
    assert text.startswith("# environment changes")  # nothing to change on this non-ROCm host
    assert "#   none" in text


def test_print_command_for_vllm():
    consumer = '{"kv_connector":"MooncakeConnector","kv_role":"kv_consumer"}'
    out = run_module("infera.engine.vllm", "--print-command", "--disaggregation-allow-tcp", "--model", "/m",
                     "--kv-transfer-config", consumer)
    assert out.returncode == 0, out.stderr
    assert "-m vllm.entrypoints.openai.api_server" in out.stdout
    assert "--kv-transfer-config '" + consumer + "'" in out.stdout
    assert "--kv-cache-dtype fp8_e4m3" in out.stdout


def test_print_command_on_the_no_broker_plane_prints_without_a_note(capsys):
    assert run("mock", ["--print-command", "--discovery-backend", "etcd", "--request-transport", "http",
                        "--kv-event-transport", "zmq", "--etcd-endpoint", "10.0.0.10:2379",
                        "--advertise-host", "10.0.0.11"]) == 0
    captured = capsys.readouterr()
    assert "-m infera_mock_engine" in captured.out
    assert "refused" not in captured.err


def test_a_plane_mix_that_cannot_work_is_refused_at_launch_with_exit_2(capsys):
    code = run("sglang", ["--kv-event-transport", "zmq", "--etcd-endpoint", "10.0.0.10:2379",
                          "--advertise-host", "0.0.0.0", "--model-path", "/m"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("infera-worker-agent: error: --advertise-host '0.0.0.0' is a wildcard")
    assert "with --kv-event-transport zmq" in err


def test_a_pd_launch_that_would_not_use_rdma_exits_2_before_anything_starts(capsys):
    code = run("sglang", ["--nats-url", "nats://127.0.0.1:1", *RUNBOOK_DECODE])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("infera-worker-agent: error: refusing to start this sglang decode worker")
    assert "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=1800" in err and "--disaggregation-allow-tcp" in err
    if importlib.util.find_spec("sglang") is None:  # said in the same round, not only after the RDMA fix
        assert "infera-worker-agent: error: SGLang is not installed" in err


def test_an_engine_flag_contradicting_the_entry_point_is_refused(capsys):
    assert run("vllm", ["--engine", "sglang", "--print-command"]) == 2
    assert "--engine sglang contradicts the entry point; use python -m infera.engine.sglang" in capsys.readouterr().err
    assert run("vllm", ["--engine=vllm", "--print-command"]) == 0
    assert run("mock", ["--print-command", "--", "--engine", "x"]) == 0  # after `--` it is the engine's


def test_an_engine_variable_contradicting_the_entry_point_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("INFERA_ENGINE", "vllm")  # (the entry point's own --engine would win without a word)
    assert run("sglang", ["--print-command"]) == 2
    assert "INFERA_ENGINE=vllm contradicts the entry point; use python -m infera.engine.vllm" in capsys.readouterr().err
    assert run("vllm", ["--print-command", "--model", "/m"]) == 0


@pytest.mark.parametrize("module", ["infera.engine.sglang", "infera.engine.vllm", "infera.engine.mock"])
def test_entry_points_answer_help(module):
    out = run_module(module, "--help")
    assert out.returncode == 0 and "--print-command" in out.stdout and "--disaggregation-allow-tcp" in out.stdout
