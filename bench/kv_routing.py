"""KV-aware routing on real multi-turn traffic: the Mooncake FAST'25 conversation trace.

Replays the first requests of the trace against a fresh fleet once per routing policy, in the
same run: nats-server, kv-indexer, router (--router-policy P), frontend and N mock engines with a
bounded KV cache. Each trace hash id becomes 512 deterministic token ids (same id, same tokens),
so requests that share a prefix in the trace share it in tokens, at any block size dividing 512.
Arrivals keep the trace's spacing divided by --time-scale (requests inside one 3 s bin of the
trace are spread over it), and the engines run --speedup times faster than the modelled GPU.

Measured per policy: prefix-cache hit rate (engine-reported cached tokens / prompt tokens),
TTFT p50/p99 (first streamed token), end-to-end p50, and the share of requests that failed;
each figure is printed as a ratio to round-robin measured in the same run.

    .venv/bin/python bench/kv_routing.py [--requests 400] [--workers 4] [--time-scale 10]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from infera.fleet_plan import plan_fleet
from infera.procs import free_port, start_nats, stop_process, wait_port
from infera_common.models import BUNDLED_MODEL_NAME

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_fast25_conversation_trace.jsonl.gz"
TRACE_BLOCK = 512
VOCAB = 49152


def load_trace(path: Path, n: int) -> list[dict]:
    out = []
    with gzip.open(path, "rt") as f:
        for line in f:
            out.append(json.loads(line))
            if len(out) >= n:
                break
    return out


def block_tokens(hash_id: int) -> list[int]:
    rng = random.Random(hash_id * 7919 + 17)
    return [rng.randrange(100, VOCAB) for _ in range(TRACE_BLOCK)]


def prompt_ids(rec: dict, cache: dict[int, list[int]]) -> list[int]:
    ids: list[int] = []
    for h in rec["hash_ids"]:
        if h not in cache:
            cache[h] = block_tokens(h)
        ids.extend(cache[h])
    return ids[: rec["input_length"]]


def arrivals(trace: list[dict], time_scale: float) -> list[float]:
    """Arrival offsets in seconds: the trace's 3 s bins, requests spread evenly inside a bin."""
    bins: dict[int, list[int]] = {}
    for i, rec in enumerate(trace):
        bins.setdefault(rec["timestamp"], []).append(i)
    out = [0.0] * len(trace)
    stamps = sorted(bins)
    for k, ts in enumerate(stamps):
        width = (stamps[k + 1] - ts) if k + 1 < len(stamps) else 3000
        members = bins[ts]
        for j, i in enumerate(members):
            out[i] = (ts + width * j / len(members)) / 1000.0 / time_scale
    return out


def start_fleet(tmp: Path, policy: str, workers: int, engine_args: list[str]) -> tuple[list[subprocess.Popen], str]:
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
    wait_port("127.0.0.1", http_port, 30)
    url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/v1/workers", timeout=1) as r:
                active = [w for w in json.load(r)["data"] if w["status"] == "active"]
            if len(active) == workers and all(w.get("kv_block_size") for w in active):
                return procs, url
        except OSError:
            pass
        time.sleep(0.2)
    for p in reversed(procs):
        stop_process(p)
    raise RuntimeError(f"fleet not ready; logs in {tmp}")


async def one(session: aiohttp.ClientSession, url: str, ids: list[int], max_tokens: int) -> dict:
    body = {"model": BUNDLED_MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    t0 = time.perf_counter()
    ttft = None
    usage = None
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return {"ok": False, "status": resp.status}
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    e2e = time.perf_counter() - t0
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ok": True, "ttft": ttft if ttft is not None else e2e, "e2e": e2e,
            "prompt": (usage or {}).get("prompt_tokens", len(ids)), "cached": cached}


async def replay(url: str, trace: list[dict], offsets: list[float], max_tokens_cap: int) -> list[dict]:
    cache: dict[int, list[int]] = {}
    prompts = [prompt_ids(rec, cache) for rec in trace]
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = time.perf_counter()

        async def at(i: int) -> dict:
            delay = offsets[i] - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                return await one(session, url, prompts[i], max(1, min(trace[i]["output_length"], max_tokens_cap)))
            except Exception as exc:  # counted as a failure
                return {"ok": False, "status": repr(exc)}

        return await asyncio.gather(*(at(i) for i in range(len(trace))))


def summarize(results: list[dict]) -> dict:
    ok = [r for r in results if r["ok"]]
    ttfts = sorted(r["ttft"] for r in ok) or [float("nan")]
    return {
        "hit": sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok)),
        "ttft_p50": 1000 * statistics.median(ttfts),
        "ttft_p99": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "e2e_p50": 1000 * statistics.median([r["e2e"] for r in ok] or [float("nan")]),
        "failed": 1 - len(ok) / max(1, len(results)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=10.0, help="divide the trace's arrival times by this")
    ap.add_argument("--speedup", type=float, default=10.0, help="mock engine --speedup")
    ap.add_argument("--kv-blocks", type=int, default=2048, help="KV blocks per engine (64 tokens each)")
    ap.add_argument("--max-tokens", type=int, default=64, help="cap on the trace's output lengths")
    ap.add_argument("--policies", nargs="+", default=["round-robin", "least-loaded", "kv-aware"])
    ap.add_argument("--trace", type=Path, default=TRACE)
    args = ap.parse_args()
    trace = load_trace(args.trace, args.requests)
    offsets = arrivals(trace, args.time_scale)
    engine_args = ["--speedup", str(args.speedup), "--num-kv-blocks", str(args.kv_blocks),
                   "--context-length", "131072"]
    rows = {}
    for policy in args.policies:
        tmp = Path(tempfile.mkdtemp(prefix=f"infera-kvbench-{policy}-"))
        procs, url = start_fleet(tmp, policy, args.workers, engine_args)
        try:
            rows[policy] = summarize(asyncio.run(replay(url, trace, offsets, args.max_tokens)))
        finally:
            for p in reversed(procs):
                stop_process(p)
    base = rows.get("round-robin") or next(iter(rows.values()))
    print(f"\nMooncake conversation trace, first {len(trace)} requests, arrivals / {args.time_scale:g}; "
          f"{args.workers} mock engines x {args.kv_blocks} blocks of 64, speedup {args.speedup:g}; "
          f"outputs capped at {args.max_tokens} tokens\n")
    hdr = f"{'policy':<14} {'hit rate':>9} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'e2e p50 ms':>11} {'failed':>7} | vs round-robin: {'hit':>6} {'TTFT p50':>9} {'TTFT p99':>9}"
    print(hdr)
    print("-" * len(hdr))
    for policy, r in rows.items():
        print(f"{policy:<14} {100 * r['hit']:>8.1f}% {r['ttft_p50']:>12.1f} {r['ttft_p99']:>12.1f} {r['e2e_p50']:>11.1f} "
              f"{100 * r['failed']:>6.1f}% | {' ':>15}{r['hit'] / max(base['hit'], 1e-9):>6.2f}x "
              f"{r['ttft_p50'] / base['ttft_p50']:>8.2f}x {r['ttft_p99'] / base['ttft_p99']:>8.2f}x")


if __name__ == "__main__":
    main()
