"""The infera-frontend command line: flags as documented, fast failures, a real process that serves."""

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from infera.procs import free_port, stop_process, wait_port
from infera_common.settings import parse_cli

from infera_frontend.settings import FrontendSettings


def parse(argv):
    return parse_cli(FrontendSettings, argv, prog="infera-frontend")[0]


def test_defaults(monkeypatch, model_dir):
    for var in ("INFERA_MODEL_PATH", "INFERA_ROUTER_TOKENIZER_PATH", "INFERA_PORT"):
        monkeypatch.delenv(var, raising=False)
    s = parse([])
    assert (s.host, s.port, s.max_body_bytes, s.upstream_timeout, s.route_timeout) == (
        "127.0.0.1", 8000, 8 * 1024 * 1024, 60.0, 5.0)
    assert s.model_path == str(model_dir) and s.enable_nats_api and not s.access_log and s.frontend_id is None


def test_model_path_alias_and_env(monkeypatch, model_dir, tmp_path):
    monkeypatch.delenv("INFERA_MODEL_PATH", raising=False)
    assert parse(["--router-tokenizer-path", str(model_dir)]).model_path == str(model_dir)
    monkeypatch.setenv("MODEL_PATH", str(tmp_path))  # an unprefixed variable is not ours
    monkeypatch.setenv("INFERA_MODEL_PATH", str(model_dir))
    assert parse([]).model_path == str(model_dir)
    assert not parse(["--no-enable-nats-api"]).enable_nats_api


@pytest.mark.parametrize(
    "argv",
    [["--model-path", "/nonexistent"], ["--upstream-timeout", "0"], ["--frontend-id", "has.dot"],
     ["--max-body-bytes", "10"], ["--port", "70000"], ["--no-such-flag"]],
)
def test_bad_flags_exit_2_naming_the_flag(argv, capsys):
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_process_serves_and_stops_on_sigterm(nats_server, subprocess_env):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "infera_frontend", "--nats-url", nats_server, "--port", str(port)],
        env=subprocess_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        wait_port("127.0.0.1", port, 20, proc)
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                    assert json.load(r)["status"] == "ready"
                    break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
            assert json.load(r) == {"object": "list", "data": []}
    finally:
        code = stop_process(proc)
        err = proc.stderr.read().decode()
        proc.stderr.close()
    assert code == 0, err
    assert "frontend_stopped" in err


def test_no_nats_fails_with_a_clear_message(subprocess_env):
    port = free_port()
    out = subprocess.run(
        [sys.executable, "-m", "infera_frontend", "--nats-url", f"nats://127.0.0.1:{port}", "--port", str(free_port())],
        capture_output=True, text=True, timeout=60, env=subprocess_env,
    )
    assert out.returncode == 1 and "cannot reach NATS" in out.stderr


def test_a_port_in_use_fails_at_once_naming_the_flag_to_change(nats_server, subprocess_env):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "infera_frontend", "--nats-url", nats_server, "--port", str(port)],
            capture_output=True, text=True, timeout=60, env=subprocess_env,
        )
    assert out.returncode == 1
    assert f"--port {port}: cannot listen there" in out.stderr and "pass another --port" in out.stderr, out.stderr
