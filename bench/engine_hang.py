"""A hung GPU behind a passing /health: what clients see, with the worker-agent's canary (the
default) and without it (``INFERA_ENGINE_STALL_CHECK=false``, the baseline), in one run.

Each row starts a fresh fleet as `infera up` starts it: nats-server, kv-indexer, router
(``--policy``, round-robin by default, so half the requests go to the hung engine until it is taken
out), frontend, and ``--workers`` worker-agents with mock engines of the vllm flavour, whose
/health, like vLLM's, answers 200 while the GPU hangs. The agents keep their health defaults
(probe every 10 s, 30 s per probe) and the frontend its upstream timeout (60 s without a frame,
then the request is tried on another worker).

Load: one short chat request (8 tokens, not streamed) every ``--period`` s, open loop, each allowed
``--client-timeout`` s. ``--hang-at`` s into the load, the first worker's engine gets SIGUSR1 (the
mock's simulated GPU hang: no step ends, HTTP answers on). Requests go on being sent for
``--observe`` s after it; the row then waits for the last answers and ends the hang.

With ``--quiet Q`` the engine hangs while idle: no request is sent from 1 s before the hang until
Q s after it, then the load resumes (a GPU that hangs overnight, met by the morning's traffic). The
``no-idle-canary`` row (``INFERA_ENGINE_IDLE_CANARY_AFTER=0``) is that scenario's baseline: only an
engine that holds requests is tested.

Per row: seconds from the hang until /v1/workers stops listing the worker as active ("never" if
it stayed active through the window); for the requests sent after the hang: how many, how many
failed, latency p50 / p99 / max, and how many took more than ``--slow`` s. The last lines give the
baseline / canary ratios of the slow requests and of p99.

    .venv/bin/python bench/engine_hang.py [--observe 90] [--period 0.5] [--rows canary no-canary]
    .venv/bin/python bench/engine_hang.py --quiet 60 --observe 120 --rows canary no-idle-canary
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchfleet import start_fleet, stop_fleet  # noqa: E402
from infera_common.models import BUNDLED_MODEL_NAME  # noqa: E402

ROWS = {"canary": {}, "no-canary": {"INFERA_ENGINE_STALL_CHECK": "false"},
        "no-idle-canary": {"INFERA_ENGINE_IDLE_CANARY_AFTER": "0"}}


def engine_pid(logs: Path, worker_id: str) -> int:
    """The pid of ``worker_id``'s engine, from its worker-agent's log (``engine_spawned``)."""
    for log in sorted(logs.glob("worker-*.log")):
        events = []
        for line in log.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                events.append(event)
        if any(e.get("event") == "agent_starting" and e.get("worker_id") == worker_id for e in events):
            return next(int(e["pid"]) for e in events if e.get("event") == "engine_spawned")
    raise RuntimeError(f"no worker-agent log for {worker_id} in {logs}")


async def one_request(session: aiohttp.ClientSession, url: str, timeout: float) -> tuple[float, int]:
    body = {"model": BUNDLED_MODEL_NAME, "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": 8}
    t0 = time.monotonic()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            await resp.read()
            return time.monotonic() - t0, resp.status
    except (aiohttp.ClientError, TimeoutError):
        return time.monotonic() - t0, 0


async def watch_worker(session: aiohttp.ClientSession, url: str, worker_id: str, since: float,
                       stop: asyncio.Event) -> float | None:
    """Seconds after ``since`` when the worker was first seen not active; None if never before ``stop``."""
    while not stop.is_set():
        try:
            async with session.get(f"{url}/v1/workers", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                workers = {w["worker_id"]: w for w in (await resp.json())["data"]}
            record = workers.get(worker_id)
            if record is None or record.get("status") != "active":
                return time.monotonic() - since
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            pass
        await asyncio.sleep(0.2)
    return None


def quiet(since_start: float, args: argparse.Namespace) -> bool:
    """No request is sent in the quiet spell around an idle hang (``--quiet``)."""
    return args.quiet > 0 and args.hang_at - 1.0 <= since_start < args.hang_at + args.quiet


async def drive(url: str, worker_id: str, pid: int, args: argparse.Namespace) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        sent: list[tuple[float, asyncio.Task]] = []
        start = time.monotonic()
        hung_at: float | None = None
        stop = asyncio.Event()
        watcher: asyncio.Task | None = None
        n = 0
        while True:
            now = time.monotonic()
            if hung_at is None and now - start >= args.hang_at:
                os.kill(pid, signal.SIGUSR1)
                hung_at = now
                watcher = asyncio.create_task(watch_worker(session, url, worker_id, hung_at, stop))
            if hung_at is not None and now - hung_at >= args.observe:
                break
            n += 1
            if not quiet(now - start, args):
                sent.append((now, asyncio.create_task(one_request(session, url, args.client_timeout))))
            await asyncio.sleep(max(0.0, start + n * args.period - time.monotonic()))
        await asyncio.gather(*(task for _, task in sent))
        await asyncio.sleep(2.0)  # a record changed as the last answers came back reaches the frontend
        stop.set()
        taken_out = await watcher if watcher is not None else None
        os.kill(pid, signal.SIGUSR2)
    after = [task.result() for at, task in sent if hung_at is not None and at >= hung_at]
    latencies = sorted(lat for lat, _ in after)
    return {
        "taken_out_s": taken_out,
        "requests": len(after),
        "failed": sum(1 for _, status in after if status != 200),
        "p50": statistics.median(latencies),
        "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "max": latencies[-1],
        "slow": sum(1 for lat in latencies if lat > args.slow),
    }


def run_row(row: str, args: argparse.Namespace, tmp: Path) -> dict:
    logs = tmp / row
    logs.mkdir(parents=True)
    procs, url, active = start_fleet(logs, workers=args.workers, policy=args.policy,
                                     engine_args=["--engine-flavor", "vllm"], env=ROWS[row])
    try:
        first = sorted(active, key=lambda w: w["worker_id"])[0]
        pid = engine_pid(logs, first["worker_id"])
        print(f"[{row}] fleet up; hanging the engine of {first['worker_id']} (pid {pid}) after {args.hang_at:g} s",
              flush=True)
        return asyncio.run(drive(url, first["worker_id"], pid, args))
    finally:
        stop_fleet(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=["canary", "no-canary"],
                    help="in this order; no-canary is the baseline (no-idle-canary with --quiet)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--policy", default="round-robin")
    ap.add_argument("--period", type=float, default=0.5, help="seconds between requests")
    ap.add_argument("--hang-at", type=float, default=5.0, help="seconds of load before the hang")
    ap.add_argument("--observe", type=float, default=90.0, help="seconds of load after the hang")
    ap.add_argument("--client-timeout", type=float, default=150.0)
    ap.add_argument("--slow", type=float, default=5.0, help="a request slower than this many seconds is slow")
    ap.add_argument("--quiet", type=float, default=0.0,
                    help="hang the engine while idle: no request from 1 s before the hang until this many s after it")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="infera-engine-hang-"))
    results = {row: run_row(row, args, tmp) for row in args.rows}
    idle = f" (idle: no request from 1 s before it until {args.quiet:g} s after)" if args.quiet else ""
    print(f"\n{args.workers} workers (vllm-flavoured mock engines), policy {args.policy}, a request every "
          f"{args.period:g} s; the first worker's GPU hangs {args.hang_at:g} s in{idle}; requests sent in the "
          f"{args.observe:g} s after it; logs {tmp}\n")
    hdr = (f"{'row':<14} | {'out of routing after':>20} | {'requests':>8} | {'failed':>6} | {'p50 s':>6} | "
           f"{'p99 s':>6} | {'max s':>6} | {f'> {args.slow:g} s':>7}")
    print(hdr)
    print("-" * len(hdr))
    for row, r in results.items():
        out = f"{r['taken_out_s']:.1f} s" if r["taken_out_s"] is not None else "never"
        print(f"{row:<14} | {out:>20} | {r['requests']:>8} | {r['failed']:>6} | {r['p50']:>6.2f} | "
              f"{r['p99']:>6.2f} | {r['max']:>6.2f} | {r['slow']:>7}")
    for baseline in ("no-canary", "no-idle-canary"):
        if "canary" in results and baseline in results:
            c, b = results["canary"], results[baseline]
            ratio = f" = {b['slow'] / c['slow']:.2f}x" if c["slow"] else ""
            print(f"\n{baseline} / canary: slow requests {b['slow']} / {c['slow']}{ratio}")
            print(f"{baseline} / canary: p99 {b['p99']:.2f} / {c['p99']:.2f} s = {b['p99'] / c['p99']:.2f}x")


if __name__ == "__main__":
    main()
