"""--engine-python: the engine runs under another interpreter (e.g. a separate venv holding vLLM).

That interpreter is asked, before anything starts, whether it has the engine (refused at once if
not, naming the flag) and which of the engine's launch modules it has (vLLM 0.32 deprecates the one
earlier releases have); no engine code runs to find out.
"""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from infera_worker_agent.host_probe import HostFacts, probe_host, probe_interpreter
from infera_worker_agent.main import build_plan, main
from infera_worker_agent.settings import parse_agent_cli

NEW_VLLM = "vllm.entrypoints.launchers.api_server.entry"
OLD_VLLM = "vllm.entrypoints.openai.api_server"


def plan_for(argv: list[str], host: HostFacts = HostFacts()):
    settings, engine_args = parse_agent_cli(argv)
    return settings, build_plan(settings, engine_args, host, env={}, port=30000,
                                find_ports=lambda n: 20000)


@pytest.fixture
def bare(tmp_path_factory) -> Path:
    """A venv with none of the agent's packages (its interpreter path)."""
    root = tmp_path_factory.mktemp("bare")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    return root / "venv" / "bin" / "python"


def fake_vllm(python: Path, *modules: str) -> Path:
    """A vLLM package in the venv of ``python`` holding ``modules``; importing any of it leaves a mark."""
    site = next((python.parent.parent / "lib").glob("python3*/site-packages"))
    mark = site / "imported"
    leave_mark = f"open({str(mark)!r}, 'w').close()\n"
    for module in modules:
        *packages, name = module.split(".")
        d = site
        for package in packages:
            d = d / package
            d.mkdir(exist_ok=True)
            (d / "__init__.py").write_text(leave_mark)
        (d / f"{name}.py").write_text(leave_mark)
    return mark


def test_engine_runs_under_the_named_interpreter():
    settings, plan = plan_for(["--engine", "vllm", "--engine-python", "/opt/vllm-venv/bin/python",
                               "--model", "/m", "--block-size", "32"])
    assert settings.engine_python == "/opt/vllm-venv/bin/python"
    assert plan.argv[:3] == ("/opt/vllm-venv/bin/python", "-m", OLD_VLLM)  # not asked: the module every release has
    assert plan.argv[3:7] == ("--model", "/m", "--block-size", "32")  # the engine's own args, verbatim


def test_vllm_launches_from_the_module_its_release_has():
    argv = ["--engine", "vllm", "--model", "/m"]
    assert plan_for(argv, HostFacts(launch_modules=frozenset({OLD_VLLM})))[1].argv[2] == OLD_VLLM
    assert plan_for(argv, HostFacts(launch_modules=frozenset({OLD_VLLM, NEW_VLLM})))[1].argv[2] == NEW_VLLM


def test_default_is_the_agents_own_interpreter():
    _, plan = plan_for(["--engine", "vllm", "--model", "/m"])
    assert plan.argv[0] == sys.executable


def test_print_command_shows_the_interpreter(capsys):
    assert main(["--engine", "vllm", "--engine-python", "/venvs/vllm/bin/python", "--model", "/m",
                 "--print-command"]) == 0
    out, err = capsys.readouterr()
    assert f"/venvs/vllm/bin/python -m {OLD_VLLM}" in out
    assert "launching would be refused: --engine-python /venvs/vllm/bin/python cannot be run" in err


def test_the_interpreter_is_asked_without_importing_the_engine(tmp_path, bare):
    mark = fake_vllm(bare, OLD_VLLM)
    facts = probe_host({}, root=tmp_path, python=str(bare))
    assert facts.launch_modules == frozenset({OLD_VLLM}) and facts.interpreter_error is None
    assert facts.sglang_version is None
    assert not mark.exists()  # found on disk: none of the package's code ran
    fake_vllm(bare, NEW_VLLM)
    assert probe_host({}, root=tmp_path, python=str(bare)).launch_modules == frozenset({OLD_VLLM, NEW_VLLM})
    assert not mark.exists()


def test_the_engine_interpreter_launches_the_module_it_has(capsys, bare):
    fake_vllm(bare, OLD_VLLM, NEW_VLLM)
    assert main(["--engine", "vllm", "--engine-python", str(bare), "--model", "/m", "--print-command"]) == 0
    assert f"{bare} -m {NEW_VLLM}" in capsys.readouterr().out


def test_an_interpreter_without_the_engine_is_refused_naming_the_flag(capsys, bare, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    # no NATS anywhere: the refusal comes before any connection
    assert main(["--engine", "sglang", "--engine-python", str(bare), "--model-path", str(model),
                 "--nats-url", "nats://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert f"SGLang is not installed for --engine-python {bare} (no module sglang.launch_server)" in err
    assert main(["--engine", "vllm", "--model", str(model), "--nats-url", "nats://127.0.0.1:1"]) == 2
    assert f"vLLM is not installed for the agent's own interpreter {sys.executable}" in capsys.readouterr().err


def test_an_interpreter_that_cannot_run_is_refused(tmp_path, capsys):
    facts = probe_host({}, root=tmp_path, python=str(tmp_path / "no-such-python"))
    assert facts.launch_modules is None and "No such file" in facts.interpreter_error
    assert main(["--engine", "vllm", "--engine-python", str(tmp_path / "no-such-python"), "--model", "/m",
                 "--nats-url", "nats://127.0.0.1:1"]) == 2
    assert f"--engine-python {tmp_path / 'no-such-python'} cannot be run" in capsys.readouterr().err


def test_versions_are_read_from_the_engine_interpreter(bare):
    assert probe_interpreter(sys.executable, (), ("pydantic",)).versions == {
        "pydantic": importlib.metadata.version("pydantic")}
    assert probe_interpreter(str(bare), (), ("pydantic",)).versions == {}
    assert probe_interpreter("/bin/false", (), ()).error == "exit code 1"


def test_the_interpreter_sees_the_modules_python_m_would(tmp_path, bare, monkeypatch):
    # `python -m` puts the working directory first on the engine's sys.path: a source checkout there counts
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    mark = fake_vllm(bare, OLD_VLLM)
    (mark.parent / "vllm").rename(checkout / "vllm")  # out of the venv's site-packages
    assert probe_interpreter(str(bare), (OLD_VLLM,), ()).modules == frozenset()
    monkeypatch.chdir(checkout)
    assert probe_interpreter(str(bare), (OLD_VLLM,), ()).modules == frozenset({OLD_VLLM})
    assert not mark.exists()


def test_the_mock_under_an_interpreter_without_infera_is_refused(bare, capsys):
    assert main(["--engine", "mock", "--engine-python", str(bare), "--nats-url", "nats://127.0.0.1:1"]) == 2
    assert f"the mock engine (Infera's) is not installed for --engine-python {bare}" in capsys.readouterr().err
