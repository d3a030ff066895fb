"""The runbooks' manual fleet as subprocesses: ``python -m infera.server`` and ``python -m infera.engine.mock``
workers, with the plane flags as the runbooks write them. Every process is started in its own session
and killed (with its children) by ``close()``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from infera.procs import free_port
from infera_common.models import default_model_path
from tests.e2e.fleet import env_with, stop_with_children

NO_BROKER = ["--discovery-backend", "etcd", "--request-transport", "http", "--kv-event-transport", "zmq"]


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} not within {timeout:.0f}s")


def http_json(url: str, body: dict | None = None, timeout: float = 30.0,
              headers: dict[str, str] | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)
    except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
        return 0, {"error": str(err)}


class Runbook:
    """One server and its workers, all on the same planes and the same etcd."""

    def __init__(self, workdir: Path, etcd_endpoint: str, planes: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.etcd_endpoint = etcd_endpoint
        self.planes = list(NO_BROKER if planes is None else planes)
        self.env = env_with(**(env or {}))
        self.model = str(default_model_path())
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")
        return subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True)

    def start_server(self, *extra: str) -> None:
        self.server = self._spawn("server", [
            "-m", "infera.server", "--host", "0.0.0.0", "--port", str(self.port),
            "--etcd-endpoint", self.etcd_endpoint, "--router-tokenizer-path", self.model, *self.planes, *extra,
        ])
        wait_for(lambda: self.get("/health")[0] == 200 or self._exited(self.server), 60, "server /health")
        assert self.server.poll() is None, self.log("server")

    def start_worker(self, name: str, *extra: str) -> subprocess.Popen:
        proc = self._spawn(name, [
            "-m", "infera.engine.mock", "--model", self.model, "--port", str(free_port()), "--host", "0.0.0.0",
            "--advertise-host", "127.0.0.1", "--etcd-endpoint", self.etcd_endpoint, *self.planes,
            "--metrics-port", "0", *extra,
        ])
        self.workers[name] = proc
        return proc

    @staticmethod
    def _exited(proc: subprocess.Popen | None) -> bool:
        return proc is not None and proc.poll() is not None

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def get(self, path: str) -> tuple[int, dict]:
        return http_json(self.url + path, timeout=10)

    def workers_listed(self) -> list[dict]:
        status, body = self.get("/v1/workers")
        return body.get("data", []) if status == 200 else []

    def served_model(self) -> str:
        return wait_for(lambda: next((m["id"] for m in self.get("/v1/models")[1].get("data", [])), None), 60,
                        "a served model")

    def chat(self, content: str = "hi", max_tokens: int = 4, **kw) -> tuple[int, dict]:
        body = {"model": self.served_model(), "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens, **kw}
        return http_json(self.url + "/v1/chat/completions", body)

    def kill_worker(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal the worker-agent only (as a crash would); its engine must not outlive it."""
        os.kill(self.workers[name].pid, sig)
        self.workers[name].wait(timeout=30)

    def close(self) -> None:
        stop_with_children([p for p in [*self.workers.values(), self.server] if p is not None])
