"""Starting a local fleet for a benchmark: nats-server plus the `infera up` topology, as processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from infera.fleet_plan import plan_fleet
from infera.procs import free_port, start_nats, stop_process, wait_port


def start_fleet(tmp: Path, *, workers: int, policy: str | None, engine_args: list[str],
                need_block_size: bool = False) -> tuple[list[subprocess.Popen], str, list[dict]]:
    """Start the fleet with logs in ``tmp``; returns (processes, frontend URL, active worker records).

    SIGTERM (e.g. from ``timeout``) is turned into SystemExit so the caller's ``finally`` stops the
    fleet: its processes run in their own sessions and would otherwise outlive the benchmark.
    """
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    nats_port, http_port = free_port(), free_port()
    procs = [start_nats(nats_port, tmp / "js")]
    plan = plan_fleet(
        nats_url=f"nats://127.0.0.1:{nats_port}", host="127.0.0.1", port=http_port, workers=workers,
        router_policy=policy, engine_args=engine_args, metrics_ports=[free_port() for _ in range(workers + 2)],
    )
    for spec in plan:
        log = open(tmp / f"{spec.name}.log", "ab")
        procs.append(subprocess.Popen(spec.argv(sys.executable), stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    url = f"http://127.0.0.1:{http_port}"
    try:
        wait_port("127.0.0.1", http_port, 30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{url}/v1/workers", timeout=1) as r:
                    active = [w for w in json.load(r)["data"] if w["status"] == "active"]
                if len(active) == workers and (not need_block_size or all(w.get("kv_block_size") for w in active)):
                    return procs, url, active
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"fleet not ready; logs in {tmp}")
    except BaseException:  # also SystemExit from SIGTERM during start-up
        stop_fleet(procs)
        raise


def stop_fleet(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        stop_process(p)
