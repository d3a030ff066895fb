"""Running the worker-agent as a real subprocess in tests, and looking at the processes it leaves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from infera.procs import stop_process


def process_state(pid: int) -> str | None:
    """The /proc state letter of ``pid``; None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    return process_state(pid) not in (None, "Z")


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class AgentProc:
    """``python -m infera_worker_agent --engine mock ...`` with its logs in files."""

    def __init__(self, nats_url: str, workdir: Path, env: dict[str, str], worker_id: str,
                 agent_args: list[str] | None = None, engine_args: list[str] | None = None,
                 ttl: float = 2.0) -> None:
        self.worker_id = worker_id
        self.argv = [
            sys.executable, "-m", "infera_worker_agent", "--engine", "mock", "--nats-url", nats_url,
            "--worker-id", worker_id, "--discovery-ttl", str(ttl), "--metrics-port", "0",
            "--engine-stop-timeout", "3", *(agent_args or []), "--", "--speedup", "1", *(engine_args or []),
        ]
        self.err_path = workdir / f"{worker_id}.err"
        self.out_path = workdir / f"{worker_id}.out"
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self) -> "AgentProc":
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=err, env=self.env, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def logs(self) -> list[dict]:
        out = []
        for line in self.err_path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def event(self, name: str, timeout: float = 0.0) -> dict | None:
        found: list[dict] = []

        def look() -> bool:
            found[:] = [e for e in self.logs() if e.get("event") == name]
            return bool(found)

        wait_until(look, timeout)
        return found[0] if found else None

    def engine_pid(self, timeout: float = 15.0) -> int:
        spawned = self.event("engine_spawned", timeout)
        assert spawned is not None, self.err_path.read_text()[-3000:]
        return int(spawned["pid"])

    def watchdog_pid(self) -> int | None:
        spawned = self.event("engine_spawned")
        return int(spawned["watchdog_pid"]) if spawned else None

    def wait(self, timeout: float) -> int | None:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def cleanup(self) -> None:
        """Stop the agent and anything it may have left behind."""
        if self.proc is not None:
            stop_process(self.proc, timeout=15)
        spawned = self.event("engine_spawned")
        if spawned:
            for pid in (int(spawned["pid"]), int(spawned["watchdog_pid"])):
                for target in {pid, *group_members(pid)}:
                    if alive(target) and _ours(target):
                        try:
                            os.kill(target, signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass


def _ours(pid: int) -> bool:
    """A process this test's agent started (pids are not reused under our feet)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"infera_mock_engine" in cmdline or b"infera_worker_agent" in cmdline
