"""A whole fleet started the way a user starts it: `infera up` as a subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from infera.procs import free_port, stop_process, wait_port


#: ``infera up`` flags of each plane the end-to-end tests run on.
PLANES = {
    "nats": [],
    "no-broker": ["--discovery-backend", "etcd", "--request-transport", "http", "--kv-event-transport", "zmq"],
}


class Fleet:
    def __init__(self, state_dir: Path, workers: int = 2, extra: list[str] | None = None,
                 env: dict[str, str] | None = None, plane: str = "nats") -> None:
        self.plane = plane
        self.state_dir = state_dir
        self.port = free_port()
        self.nats_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.nats_url = f"nats://127.0.0.1:{self.nats_port}"
        self.workers = workers
        self.argv = [sys.executable, "-m", "infera.cli", "up", "--port", str(self.port), "--nats-port",
                     str(self.nats_port), "--workers", str(workers), "--state-dir", str(state_dir), *PLANES[plane],
                     *(extra or [])]
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.banner = ""
        self.output: list[str] = []  # its lines after the banner

    def start(self, timeout: float = 90.0) -> "Fleet":
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env, start_new_session=True)
        deadline = time.monotonic() + timeout
        lines = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("Ctrl-C stops"):
                self.banner = "".join(lines)
                # what `infera up` says from now on (restarts, exits): read, so that its pipe never
                # fills and blocks it, and kept for ``logs``
                threading.Thread(target=self._read_output, daemon=True).start()
                return self
        self.stop()
        raise RuntimeError("infera up did not come up:\n" + "".join(lines) + self.logs())

    def _read_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)

    def logs(self) -> str:
        out = [f"--- infera up\n{''.join(self.output[-30:])}"]
        for f in sorted((self.state_dir / "logs").glob("*.log")):
            out.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(out)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                stop_process(self.proc)
        return self.proc.returncode

    # --- views -------------------------------------------------------------
    def get_json(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=5) as resp:
            return json.load(resp)

    def workers_list(self) -> list[dict]:
        return self.get_json("/v1/workers")["data"]


def engine_pid(engine_url: str) -> int:
    """The pid of the mock engine serving ``engine_url`` (found by its --port argument)."""
    port = engine_url.rsplit(":", 1)[1].rstrip("/")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"infera_mock_engine" in argv and b"--port" in argv:
            if argv[argv.index(b"--port") + 1].decode() == port:
                return int(entry.name)
    raise LookupError(f"no mock engine on port {port}")


def scrape(engine_url: str) -> dict[str, float]:
    """The engine's own Prometheus gauges/counters, summed over labels."""
    with urllib.request.urlopen(engine_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^{\s]+)(?:\{[^}]*\})?\s+(\S+)", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def descendants_alive(pids: list[int]) -> list[int]:
    return [p for p in pids if Path(f"/proc/{p}").exists() and _not_zombie(p)]


def _not_zombie(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]) != "Z"
    except OSError:
        return False


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[1])


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (by /proc parent links), at this moment."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = parent_pid(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def stop_with_children(procs: list[subprocess.Popen], timeout: float = 10.0) -> None:
    """Stop processes started by a test, then SIGKILL anything their trees still hold (what a killed
    parent left behind)."""
    pids = [pid for p in procs for pid in process_tree(p.pid)]
    for proc in procs:
        stop_process(proc, timeout=timeout)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def env_with(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERA_")}
    env.update(values)
    env["PYTHONUNBUFFERED"] = "1"
    return env


__all__ = ["PLANES", "Fleet", "engine_pid", "scrape", "parent_pid", "process_tree", "descendants_alive", "env_with", "wait_port"]


def router_metrics_url(fleet: Fleet) -> str:
    """The /metrics URL of the router `infera up` started (its --metrics-port argument; on the
    no-broker plane the router runs inside infera.server, whose /metrics is on the API port)."""
    if fleet.plane == "no-broker":
        return fleet.url
    for pid in process_tree(fleet.proc.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "infera_router" in argv and "--metrics-port" in argv:
            return f"http://127.0.0.1:{argv[argv.index('--metrics-port') + 1]}"
    raise LookupError("no router under this fleet")
