"""--engine-python: the engine runs under another interpreter (e.g. a separate venv holding vLLM)."""

import importlib.metadata
import subprocess
import sys

from infera_worker_agent.host_probe import HostFacts, probe_host, version_in
from infera_worker_agent.main import build_plan, main
from infera_worker_agent.settings import parse_agent_cli


def plan_for(argv: list[str]):
    settings, engine_args = parse_agent_cli(argv)
    return settings, build_plan(settings, engine_args, HostFacts(), env={}, port=30000,
                                find_ports=lambda n: 20000)


def test_engine_runs_under_the_named_interpreter():
    settings, plan = plan_for(["--engine", "vllm", "--engine-python", "/opt/vllm-venv/bin/python",
                               "--model", "/m", "--block-size", "32"])
    assert settings.engine_python == "/opt/vllm-venv/bin/python"
    assert plan.argv[:3] == ("/opt/vllm-venv/bin/python", "-m", "vllm.entrypoints.openai.api_server")
    assert plan.argv[3:7] == ("--model", "/m", "--block-size", "32")  # the engine's own args, verbatim


def test_default_is_the_agents_own_interpreter():
    _, plan = plan_for(["--engine", "vllm", "--model", "/m"])
    assert plan.argv[0] == sys.executable


def test_print_command_shows_the_interpreter(capsys):
    assert main(["--engine", "vllm", "--engine-python", "/venvs/vllm/bin/python", "--model", "/m",
                 "--print-command"]) == 0
    assert "/venvs/vllm/bin/python -m vllm.entrypoints.openai.api_server" in capsys.readouterr().out


def test_sglang_version_is_read_from_the_engine_interpreter(tmp_path):
    # a bare venv: the interpreter exists but has none of the agent's packages
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    bare = str(tmp_path / "venv" / "bin" / "python")
    assert version_in(sys.executable)("pydantic") == importlib.metadata.version("pydantic")
    assert version_in(bare)("pydantic") is None
    facts = probe_host({}, root=tmp_path, python=bare)
    assert facts.sglang_version is None


def test_an_interpreter_that_cannot_run_reports_no_version(tmp_path):
    assert version_in(str(tmp_path / "no-such-python"))("sglang") is None
