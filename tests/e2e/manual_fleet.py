"""The services `infera up` would start, one process each, started and stopped by the test."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from infera.fleet_plan import plan_fleet
from infera.procs import free_port, start_nats, stop_process, wait_port
from infera_common.models import BUNDLED_MODEL_NAME
from tests.e2e.fleet import env_with
from tests.e2e.runbook import http_json, wait_for


def chat(url: str, content: str = "hi") -> tuple[int, dict]:
    return http_json(url + "/v1/chat/completions", {"model": BUNDLED_MODEL_NAME, "max_tokens": 2,
                                                    "messages": [{"role": "user", "content": content}]}, timeout=10)


def active_workers(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/v1/workers", timeout=5) as resp:
        return sorted(w["worker_id"] for w in json.load(resp)["data"] if w["status"] == "active")


class ManualFleet:
    """The services `infera up` would start, but with the nats-server in the test's hands."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.nats_port, self.port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.nats: subprocess.Popen | None = None
        self.frontend: subprocess.Popen | None = None
        self.procs: list[subprocess.Popen] = []
        self.specs: dict[str, tuple] = {}  # service name -> (its ProcSpec, its process)
        self.env: dict[str, str] = {}
        (tmp / "logs").mkdir()

    def start_nats(self, store: str) -> None:
        with open(self.tmp / "logs" / f"nats-{store}.log", "ab") as log:
            self.nats = start_nats(self.nats_port, self.tmp / store, log_file=log)

    def start(self, request_transport: str = "nats", service_env: dict[str, dict[str, str]] | None = None,
              **env_values: str) -> "ManualFleet":
        """``env_values``: every service's environment; ``service_env``: more for some services, by
        name (``router``, ``frontend``, ``kv-indexer``, ``worker-1``, ...)."""
        self.start_nats("store")
        specs = plan_fleet(nats_url=f"nats://127.0.0.1:{self.nats_port}", host="127.0.0.1", port=self.port,
                           workers=2, router_policy="kv-aware", engine_args=["--served-model-name", BUNDLED_MODEL_NAME],
                           metrics_ports=[free_port() for _ in range(4)], request_transport=request_transport)
        env = self.env = env_with(**{"INFERA_DISCOVERY_TTL": "3", **env_values})
        for spec in specs:
            with open(self.tmp / "logs" / f"{spec.name}.log", "ab") as log:
                own = (service_env or {}).get(spec.name, {})
                self.procs.append(subprocess.Popen(spec.argv(sys.executable), stdout=log, stderr=subprocess.STDOUT,
                                                   env={**env, **spec.env, **own}, start_new_session=True))
            self.specs[spec.name] = (spec, self.procs[-1])
            if spec.role == "frontend":
                self.frontend = self.procs[-1]
                wait_port("127.0.0.1", self.port, 30.0, self.procs[-1])
        wait_for(lambda: len(active_workers(self.url)) == 2, 60, "two active workers")
        return self

    def restart(self, name: str) -> None:
        """Stop one service (SIGTERM) and start it again with the same command line."""
        spec, proc = self.specs[name]
        stop_process(proc, timeout=20.0)
        with open(self.tmp / "logs" / f"{spec.name}.log", "ab") as log:
            again = subprocess.Popen(spec.argv(sys.executable), stdout=log, stderr=subprocess.STDOUT,
                                     env={**self.env, **spec.env}, start_new_session=True)
        self.procs[self.procs.index(proc)] = again
        self.specs[name] = (spec, again)

    def logs(self) -> str:
        return "".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted((self.tmp / "logs").glob("*.log")))

    def stop(self) -> None:
        if self.frontend is not None and self.frontend.poll() is None:
            self.frontend.send_signal(signal.SIGCONT)  # a test that failed while it was stopped
        for proc in reversed(self.procs):
            stop_process(proc, timeout=20.0)
        if self.nats is not None:
            stop_process(self.nats)
