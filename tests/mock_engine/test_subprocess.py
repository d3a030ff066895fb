"""The engine as a real process, started the way runbooks start engines."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from infera.procs import free_port, stop_process, wait_port


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _start(args: list[str], env: dict, log_path) -> subprocess.Popen:
    log = open(log_path, "wb")
    return subprocess.Popen([sys.executable, "-m", "infera_mock_engine", *args], stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)


def test_python_m_with_runbook_flags_cold_start_and_sigterm(model_dir, tmp_path, subprocess_env):
    port = free_port()
    log_path = tmp_path / "engine.log"
    t0 = time.monotonic()
    proc = _start(["--model-path", str(model_dir), "--port", str(port), "--startup-delay", "1.0",
                   "--tp", "8", "--trust-remote-code", "--enable-metrics"], subprocess_env, log_path)
    try:
        wait_port("127.0.0.1", port, 10, proc)
        listening_after = time.monotonic() - t0
        base = f"http://127.0.0.1:{port}"
        assert _get(base + "/health") == 503  # cold start
        deadline = time.monotonic() + 15
        while _get(base + "/health") != 200:
            assert time.monotonic() < deadline, "never became healthy"
            time.sleep(0.05)
        body = _post(base + "/v1/chat/completions", {"messages": [{"role": "user", "content": "1+1=?"}],
                                                     "max_tokens": 3})
        assert body["usage"]["prompt_tokens"] == 35 and body["usage"]["completion_tokens"] == 3
        assert listening_after < 5  # generous; typically well under a second
    finally:
        code = stop_process(proc)
    assert code == 0
    log = log_path.read_text()
    warnings = [line for line in log.splitlines() if "ignoring flags" in line]
    assert len(warnings) == 1 and warnings[0].endswith("--tp 8 --trust-remote-code")


def test_vllm_serve_style_positional_model(model_dir, tmp_path, subprocess_env):
    port = free_port()
    proc = _start(["serve", str(model_dir), "--engine-flavor", "vllm", "--port", str(port),
                   "--served-model-name", "smol", "--block-size", "16", "--kv-events-config",
                   '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:0"}'],
                  subprocess_env, tmp_path / "e.log")
    try:
        wait_port("127.0.0.1", port, 10, proc)
        deadline = time.monotonic() + 15
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                    models = json.loads(r.read())
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert models["data"][0]["id"] == "smol" and models["data"][0]["owned_by"] == "vllm"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/kv_event_sources", timeout=5) as r:
            sources = json.loads(r.read())
        assert list(sources) == ["0"] and sources["0"]["endpoint"].startswith("tcp://0.0.0.0:")
    finally:
        assert stop_process(proc) == 0


def test_missing_model_fails_fast_with_exit_2(subprocess_env):
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "infera_mock_engine", "--port", "1"], capture_output=True, text=True,
                         env=subprocess_env, timeout=30)
    assert res.returncode == 2 and "--model-path" in res.stderr
    assert time.monotonic() - t0 < 10


def test_busy_port_fails_with_a_clear_message(model_dir, subprocess_env):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "infera_mock_engine", "--model-path", str(model_dir),
                              "--port", str(port)], capture_output=True, text=True, env=subprocess_env, timeout=30)
    assert res.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in res.stderr


def test_sigusr1_hangs_the_gpu_and_sigusr2_ends_it(model_dir, tmp_path, subprocess_env):
    port = free_port()
    env = {**subprocess_env, "SGLANG_HEALTH_CHECK_TIMEOUT": "0.5"}
    log_path = tmp_path / "engine.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "infera_mock_engine", "--model-path", str(model_dir),
                                 "--port", str(port), "--speedup", "10"], stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    try:
        wait_port("127.0.0.1", port, 10, proc)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 15
        while _get(base + "/health") != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while _get(base + "/health") != 503:
            assert time.monotonic() < deadline, "the hang never showed"
        assert _get(base + "/v1/models") == 200  # HTTP itself answers
        os.kill(proc.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 10
        while _get(base + "/health") != 200:
            assert time.monotonic() < deadline, "the engine never came back"
    finally:
        assert stop_process(proc) == 0
    text = log_path.read_text()
    assert "simulated GPU hang (SIGUSR1)" in text and "simulated GPU hang over (SIGUSR2)" in text
