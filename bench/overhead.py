"""Overhead of the Infera path (frontend -> router -> worker-agent -> engine) over calling the engine directly.

Starts its own fleet per plane (``nats``: nats-server, router, frontend, one worker-agent over one
mock engine; ``no-broker``: etcd and one ``infera.server`` calling the engine over HTTP), then
drives the SAME engine two ways in one run: through the frontend, and straight at the engine's
URL (at concurrency 1 alternating one-second slices between the two). For each concurrency it
measures short non-streaming requests (p50/p99 latency, requests/s) and streamed tokens/s, and
prints each Infera figure as a ratio of the direct one.

    .venv/bin/python bench/overhead.py [--concurrency 1 32 128] [--seconds 8] [--speedup 1] [--planes nats no-broker]

The mock engine keeps its GPU-like timing model (the published Dynamo curves, divided by
--speedup), so the direct path is a realistic engine, not a no-op.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from benchfleet import start_fleet, stop_fleet
from infera_common.models import BUNDLED_MODEL_NAME

PROMPT = [{"role": "user", "content": "Write one short sentence about the sea."}]


async def one_request(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool) -> tuple[float, int]:
    t0 = time.perf_counter()
    tokens = 0
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {await resp.text()}")
        if stream:
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                        tokens += 1
        else:
            data = await resp.json()
            tokens = data["usage"]["completion_tokens"]
    return time.perf_counter() - t0, tokens


async def drive(urls: dict[str, str], concurrency: int, seconds: float, stream: bool, max_tokens: int,
                slice_s: float) -> dict[str, dict]:
    """Drive each of ``urls`` for ``seconds`` in all. At concurrency 1 the paths alternate in
    ``slice_s``-second slices, so that a slow moment of this noisy machine falls on both alike; at
    higher concurrency each runs once (a slice's ramp-down would distort its throughput)."""
    body = json.dumps({"model": BUNDLED_MODEL_NAME, "messages": PROMPT, "max_tokens": max_tokens,
                       "stream": stream, "temperature": 0}).encode()
    acc = {name: {"lat": [], "tokens": 0, "errors": 0, "elapsed": 0.0} for name in urls}
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as session:
        for url in urls.values():
            for _ in range(2):  # warm-up
                await one_request(session, url, body, stream)
        slices = max(1, round(seconds / slice_s)) if concurrency == 1 else 1
        for _ in range(slices):
            for name, url in urls.items():
                a = acc[name]
                stop_at = time.perf_counter() + seconds / slices

                async def worker(a=a, url=url, stop_at=stop_at) -> None:
                    while time.perf_counter() < stop_at:
                        try:
                            lat, n = await one_request(session, url, body, stream)
                        except Exception:
                            a["errors"] += 1
                            continue
                        a["lat"].append(lat)
                        a["tokens"] += n

                t0 = time.perf_counter()
                await asyncio.gather(*(worker() for _ in range(concurrency)))
                a["elapsed"] += time.perf_counter() - t0
    return {name: _summary(a) for name, a in acc.items()}


def _summary(a: dict) -> dict:
    latencies = sorted(a["lat"])
    return {
        "n": len(latencies),
        "errors": a["errors"],
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "rps": len(latencies) / a["elapsed"],
        "tok_s": a["tokens"] / a["elapsed"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--seconds", type=float, default=8.0, help="measuring time per cell and path")
    ap.add_argument("--slice", type=float, default=1.0,
                    help="at concurrency 1 the two paths alternate in slices of this many seconds (drift hits both alike)")
    ap.add_argument("--speedup", type=float, default=1.0, help="mock engine --speedup")
    ap.add_argument("--max-tokens", type=int, default=8, help="completion length of the short requests")
    ap.add_argument("--router-policy", default=None, help="router policy (default: the router's, kv-aware)")
    ap.add_argument("--stream-tokens", type=int, default=64, help="completion length of the streamed requests")
    ap.add_argument("--planes", nargs="+", choices=["nats", "no-broker"], default=["nats", "no-broker"],
                    help="nats: the services apart on NATS; no-broker: etcd + infera.server (HTTP to the engine)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="infera-bench-"))
    rows = []
    for plane in args.planes:
        (tmp / plane).mkdir()
        procs, frontend, workers = start_fleet(tmp / plane, workers=1, policy=args.router_policy,
                                               engine_args=["--speedup", str(args.speedup)], plane=plane)
        engine = workers[0]["url"]
        try:
            for c in args.concurrency:
                for label, stream, mt in (("short", False, args.max_tokens), ("stream", True, args.stream_tokens)):
                    out = asyncio.run(drive({"direct": f"{engine}/v1/chat/completions",
                                             "infera": f"{frontend}/v1/chat/completions"},
                                            c, args.seconds, stream, mt, args.slice))
                    rows.append((plane, c, label, out["direct"], out["infera"]))
        finally:
            stop_fleet(procs)
    print(f"\nrouter policy {args.router_policy or 'default (kv-aware)'}; mock engine speedup {args.speedup}; short = non-streaming, max_tokens {args.max_tokens}; "
          f"stream = max_tokens {args.stream_tokens}; {args.seconds:.0f}s per cell; logs {tmp}\n")
    hdr = (f"{'plane':<9} {'conc':>4} {'kind':<6} | {'direct p50':>10} {'p99':>8} {'req/s':>8} {'tok/s':>8} | "
           f"{'infera p50':>10} {'p99':>8} {'req/s':>8} {'tok/s':>8} | {'+p50 ms':>7} {'req/s %':>7} {'tok/s %':>7}")
    print(hdr)
    print("-" * len(hdr))
    for plane, c, label, d, i in rows:
        print(f"{plane:<9} {c:>4} {label:<6} | {d['p50_ms']:>10.2f} {d['p99_ms']:>8.2f} {d['rps']:>8.1f} {d['tok_s']:>8.0f} | "
              f"{i['p50_ms']:>10.2f} {i['p99_ms']:>8.2f} {i['rps']:>8.1f} {i['tok_s']:>8.0f} | "
              f"{i['p50_ms'] - d['p50_ms']:>7.2f} {100 * i['rps'] / d['rps']:>6.0f}% "
              f"{100 * i['tok_s'] / max(d['tok_s'], 1e-9):>6.0f}%")
        if d["errors"] or i["errors"]:
            print(f"     errors: direct {d['errors']}, infera {i['errors']}")


if __name__ == "__main__":
    main()
