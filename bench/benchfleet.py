"""Starting a local fleet for a benchmark, as processes: nats-server plus the `infera up` topology (or,
on the no-broker plane, etcd plus one `infera.server`), or (for comparison) bare mock engines behind
the public sglang-router."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from infera.fleet_plan import default_engine_args, plan_fleet
from infera.procs import free_port, start_etcd, start_nats, stop_process, wait_port
from infera_common.models import default_model_path


@contextmanager
def nats_server(prefix: str = "bench-nats-") -> Iterator[str]:
    """A nats-server with JetStream on a free 127.0.0.1 port, its store in a temporary directory:
    yields its URL, stopped on exit."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix=prefix) as store:
        proc = start_nats(port, Path(store) / "js")
        try:
            yield f"nats://127.0.0.1:{port}"
        finally:
            stop_process(proc)


def _stop_on_sigterm() -> None:
    """SIGTERM (e.g. from ``timeout``) becomes SystemExit, so the caller's ``finally`` stops the
    fleet: its processes run in their own sessions and would otherwise outlive the benchmark."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def spawn(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    log = open(log_path, "ab")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **env} if env else None)


def _get_json(url: str, timeout: float = 1.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def start_fleet(tmp: Path, *, workers: int, policy: str | None, engine_args: list[str],
                need_block_size: bool = False, metrics_ports: list[int] | None = None,
                prefill_workers: int = 0, decode_workers: int = 0, env: dict[str, str] | None = None,
                plane: str = "nats") -> tuple[list[subprocess.Popen], str, list[dict]]:
    """Start the fleet with logs in ``tmp``; returns (processes, frontend URL, active worker records).

    ``workers`` aggregated worker-agents, plus ``prefill_workers`` and ``decode_workers``
    disaggregated ones (both or neither, as `infera up`); ready when all of them are active.
    ``metrics_ports`` (kv-indexer, router, then one per worker: aggregated, prefill, decode) lets the
    caller read their /metrics. ``env`` is added to every process's environment (e.g. a router
    setting as INFERA_*). ``plane`` "no-broker": etcd discovery, HTTP requests, ZMQ KV events, no
    nats-server (the router's /metrics are then the server's, on the frontend URL)."""
    _stop_on_sigterm()
    nats_port, http_port = free_port(), free_port()
    total = workers + prefill_workers + decode_workers
    planes: dict = {}
    if plane == "no-broker":
        etcd_port = free_port()
        procs = [start_etcd(etcd_port, tmp / "etcd")]
        planes = {"etcd_endpoint": f"127.0.0.1:{etcd_port}", "request_transport": "http", "kv_event_transport": "zmq"}
    else:
        procs = [start_nats(nats_port, tmp / "js")]
    plan = plan_fleet(
        nats_url=f"nats://127.0.0.1:{nats_port}", host="127.0.0.1", port=http_port, workers=workers,
        router_policy=policy, engine_args=engine_args,
        metrics_ports=metrics_ports or [free_port() for _ in range(total + 2)],
        prefill_workers=prefill_workers, decode_workers=decode_workers, **planes,
    )
    for spec in plan:
        procs.append(spawn(spec.argv(sys.executable), tmp / f"{spec.name}.log", env))
    url = f"http://127.0.0.1:{http_port}"
    try:
        wait_port("127.0.0.1", http_port, 30)
        deadline = time.monotonic() + 60 + 1.5 * total  # each worker takes ~1 s of CPU to start
        while time.monotonic() < deadline:
            try:
                active = [w for w in _get_json(f"{url}/v1/workers")["data"] if w["status"] == "active"]
                if len(active) == total and (not need_block_size or all(w.get("kv_block_size") for w in active)):
                    return procs, url, active
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"fleet not ready; logs in {tmp}")
    except BaseException:  # also SystemExit from SIGTERM during start-up
        stop_fleet(procs)
        raise


def start_engines(tmp: Path, *, workers: int, engine_args: list[str]) -> tuple[list[subprocess.Popen], list[str]]:
    """``workers`` mock engines (sglang flavour) with the arguments a fleet's agents give them, minus
    the agents' KV-event publishing; returns (processes, engine URLs) once every /health answers 200."""
    _stop_on_sigterm()
    procs: list[subprocess.Popen] = []
    urls: list[str] = []
    try:
        for i in range(1, workers + 1):
            port = free_port()
            argv = [sys.executable, "-m", "infera_mock_engine", *default_engine_args(), *engine_args,
                    "--model-path", str(default_model_path()), "--host", "127.0.0.1", "--port", str(port)]
            procs.append(spawn(argv, tmp / f"engine-{i}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 60
        for proc, url in zip(procs, urls):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"mock engine {url} exited with {proc.returncode}; logs in {tmp}")
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mock engine {url} not healthy; logs in {tmp}")
                time.sleep(0.2)
        return procs, urls
    except BaseException:
        stop_fleet(procs)
        raise


def sglang_router_installed() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def start_sglang_router(tmp: Path, worker_urls: list[str], *, policy: str = "cache_aware",
                        extra_args: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """The public sglang-router (``python -m sglang_router.launch_router``) in front of ``worker_urls``;
    returns (process, router URL) once it lists every worker as healthy (it registers them in the
    background after it starts listening)."""
    _stop_on_sigterm()
    port = free_port()
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
            "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--log-level", "warn", "--shutdown-grace-period-secs", "5", *(extra_args or [])]
    proc = spawn(argv, tmp / "sglang-router.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_port("127.0.0.1", port, 30, proc)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with {proc.returncode}; log in {tmp}")
            try:
                listed = _get_json(f"{url}/workers")
                listed = listed.get("workers", []) if isinstance(listed, dict) else listed
                healthy = {w.get("url") for w in listed if w.get("is_healthy", True)}
                if healthy >= set(worker_urls):
                    return proc, url
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"sglang-router did not register its {len(worker_urls)} workers; log in {tmp}")
    except BaseException:
        stop_process(proc)
        raise


def stop_fleet(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        stop_process(p)
