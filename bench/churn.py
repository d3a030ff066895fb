"""What killing a quarter of a fleet's worker-agents at once costs the clients, per plane.

Starts the `infera up` topology with ``--workers`` mock workers (engine speedup 20), then sends the
same open-loop traffic twice for ``--seconds`` each: short chat requests at ``--rate`` per second,
a share of them streamed. The first window is the baseline; two seconds into the second, a
quarter of the worker-agents are SIGKILLed (their engines die with them, as on a lost node). It
prints, per plane, both windows' requests answered, latency p50/p99/max, the churn window's p99
as a ratio of the baseline's, and how long the dead workers stayed listed in ``/v1/workers``.

    .venv/bin/python bench/churn.py [--workers 16] [--planes nats no-broker] [--rate 15] [--seconds 20]

The figures this measures came from the scale audit of session 27 (docs/benchmarks.md, "Fleet
churn"): dead workers listed until their discovery TTL (6 s) ages out, during which requests
met them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from benchfleet import start_fleet, stop_fleet
from infera_common.models import BUNDLED_MODEL_NAME


async def one(session: aiohttp.ClientSession, url: str, i: int, stream: bool) -> tuple[float, int]:
    """One request: (seconds, HTTP status; 0 when the connection failed)."""
    body = {"model": BUNDLED_MODEL_NAME, "max_tokens": 16, "stream": stream,
            "messages": [{"role": "user", "content": f"Say something about the number {i}."}]}
    t0 = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            raw = await resp.read()
            # a stream cut by an error ends with an error event after its 200
            status = 502 if stream and b'"error"' in raw else resp.status
    except aiohttp.ClientError:
        status = 0
    return time.perf_counter() - t0, status


async def window(url: str, rate: float, seconds: float, during=None) -> list[tuple[float, int]]:
    """Open-loop traffic: one request every 1/``rate`` s for ``seconds`` (every third streamed);
    ``during`` (a coroutine) runs alongside."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        side = asyncio.create_task(during) if during is not None else None
        tasks = []
        t0 = time.monotonic()
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one(session, url, i, stream=i % 3 == 0)))
        results = await asyncio.gather(*tasks)
        if side is not None:
            await side
    return list(results)


def listed(url: str) -> set[str]:
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/workers", timeout=2) as r:
        return {w["worker_id"] for w in json.load(r)["data"]}


async def kill_after(delay: float, agents: list, ids: list[str], url: str, out: dict) -> None:
    """SIGKILL ``agents`` after ``delay`` s; record how long ``ids`` stayed listed."""
    await asyncio.sleep(delay)
    for proc in agents:
        os.kill(proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    while set(ids) & await asyncio.to_thread(listed, url):
        if time.monotonic() - t0 > 60:
            break
        await asyncio.sleep(0.1)
    out["listed_s"] = time.monotonic() - t0


def summary(results: list[tuple[float, int]]) -> dict:
    lat = sorted(t for t, status in results if status == 200)
    return {"n": len(results), "ok": len(lat), "slow": sum(1 for t in lat if t > 1.0),
            "p50": statistics.median(lat) * 1000 if lat else 0.0,
            "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000 if lat else 0.0,
            "max": lat[-1] * 1000 if lat else 0.0}


def run_plane(plane: str, workers: int, rate: float, seconds: float) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-churn-{plane}-") as tmp:
        procs, url, active = start_fleet(Path(tmp), workers=workers, policy=None, plane=plane,
                                         engine_args=["--speedup", "20"])
        try:
            victims = max(1, workers // 4)
            agents = procs[-victims:]  # plan_fleet lists the workers last, in order: mock-1 .. mock-N
            ids = [f"mock-{i}" for i in range(workers - victims + 1, workers + 1)]
            assert set(ids) <= {w["worker_id"] for w in active}
            steady = summary(asyncio.run(window(url, rate, seconds)))
            killed: dict = {}
            churn = summary(asyncio.run(window(url, rate, seconds, kill_after(2.0, agents, ids, url, killed))))
            return {"plane": plane, "workers": workers, "killed": victims, "steady": steady, "churn": churn,
                    "listed_s": killed.get("listed_s", float("nan"))}
        finally:
            stop_fleet(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--planes", nargs="+", default=["nats", "no-broker"], choices=["nats", "no-broker"])
    ap.add_argument("--rate", type=float, default=15.0, help="requests per second")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each window")
    args = ap.parse_args()
    rows = [run_plane(plane, args.workers, args.rate, args.seconds) for plane in args.planes]
    print(f"\n{args.workers} mock workers (speedup 20), {args.rate:g} req/s for {args.seconds:g} s per window, "
          "every third request streamed; the churn window SIGKILLs a quarter of the worker-agents 2 s in\n")
    head = (f"{'plane':10} {'killed':>6} | {'steady ok':>10} {'p50':>6} {'p99':>7} | {'churn ok':>10} {'> 1 s':>5} "
            f"{'p50':>6} {'p99':>7} {'max':>7} | {'p99 vs steady':>13} {'listed s':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        s, c = r["steady"], r["churn"]
        print(f"{r['plane']:10} {r['killed']:>6} | {s['ok']:>4}/{s['n']:<5} {s['p50']:>6.0f} {s['p99']:>7.0f} | "
              f"{c['ok']:>4}/{c['n']:<5} {c['slow']:>5} {c['p50']:>6.0f} {c['p99']:>7.0f} {c['max']:>7.0f} | "
              f"{c['p99'] / s['p99'] if s['p99'] else float('nan'):>12.1f}x {r['listed_s']:>8.1f}")
    print("\n(latencies in ms, of the requests answered 200; '> 1 s': how many of those took longer; 'listed s': "
          "how long the killed workers stayed in /v1/workers after the kill)")


if __name__ == "__main__":
    main()
