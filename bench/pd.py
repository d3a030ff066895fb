"""Disaggregated prefill/decode (1P1D) against aggregated serving on mock engines, and the router's
prefill guard release (hold vs completion) under long decodes.

Every fleet is started fresh as `infera up` starts it (nats-server, kv-indexer, router, frontend, one
worker-agent + mock engine per worker; disaggregated engines speak SGLang's bootstrap protocol and the
prompt's KV really crosses a TCP connection from the prefill engine to the decode engine), one after
the other in one run; requests stream `POST /v1/completions` with token-id prompts through the
frontend.

1. Sweep (the runbooks' shape, scaled down): prompts and outputs as sglang.bench_serving's random
   dataset (lengths uniform in [ratio x max, max], random token ids, exactly that many output
   tokens), seeded, the same requests for every fleet; a closed loop at each ``--concurrency``
   (clients start together, as bench_serving's --max-concurrency), ``--requests`` per point (at
   least 2 x the concurrency). Fleets: aggregated, ``--agg-workers`` engines (the baseline);
   ``--prefill-workers`` P + ``--decode-workers`` D with the bundled model's real KV size
   (23,040 bytes per prompt token); and the same with ``--light-kv-bytes`` per token (0 = no such
   row). Why the second PD row: the mock times its GPU work but the KV copy is real, here a Python
   TCP copy on the bench machine's own cores (~0.4 GB/s when they are busy) -- per token ~10x
   slower than a 128 KiB/token model over a 25 GB/s RDMA link, and it takes CPU from the rest of
   the fleet; 2 KiB/token at that speed is about the RDMA case. Per point: TTFT p50/p90, ITL
   p50/p90/p99 (gaps between streamed chunks, pooled, as bench_serving), output tokens/s,
   requests/s; then PD / aggregated ratios.
2. Guard release: ``--guard-prefill`` P + ``--guard-decode`` D under a long-decode mix: ``--guard-long``
   clients send short prompts with long outputs while ``--guard-short`` clients send long prompts
   with short outputs, each in a closed loop for ``--guard-seconds``; once with the router's
   ``--pd-prefill-guard-release hold`` (a prefill leg's lease, i.e. its routing load, is held until its
   decode finishes) and once with ``completion`` (released when the prefill answer has been drained),
   for each ``--guard-policies`` router policy. The router's ``infera_router_active_leases{worker}``
   is sampled every ``--sample-interval`` s: mean/max leases it counts on the prefill workers (sum,
   and the busiest one) and on the decode worker(s); how the requests split between the prefill
   engines (their own request counters); TTFT (all requests, and the long-prompt ones, which queue
   at the prefill engines) and throughput; completion / hold ratios.

Times are the mock's GPU-like model times (NVIDIA Dynamo's mocker curves) divided by ``--speedup``,
reported in SIMULATED ms (wall x speedup), throughput per simulated second; the Infera path's own
per-token CPU cost is multiplied by the speedup too, so the default is 1.

    .venv/bin/python bench/pd.py [--parts sweep guard] [--concurrency 1 4 16 32] [--speedup 1]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp

from benchfleet import start_fleet, stop_fleet
from infera.procs import free_port
from infera_common.models import BUNDLED_MODEL_NAME

VOCAB = 49152  # the bundled SmolLM2 tokenizer; ids below 100 are special tokens
LEASES = "infera_router_active_leases"
Request = tuple[list[int], int, str]  # prompt ids, output tokens, class


# --- requests and clients -----------------------------------------------------------------------------
def random_requests(seed: int, max_in: int, max_out: int, ratio: float, kind: str = "") -> Iterator[Request]:
    """Endless requests as bench_serving's random dataset: lengths uniform in [ratio x max, max]."""
    rng = random.Random(seed)
    while True:
        isl = rng.randint(max(1, int(max_in * ratio)), max_in)
        osl = rng.randint(max(1, int(max_out * ratio)), max_out)
        yield [rng.randrange(100, VOCAB) for _ in range(isl)], osl, kind


async def one_stream(session: aiohttp.ClientSession, url: str, req: Request) -> dict:
    """One streamed completion; chunk arrival times give TTFT and the inter-token gaps."""
    ids, max_tokens, kind = req
    body = {"model": BUNDLED_MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage: dict = {}
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return {"ok": False, "kind": kind, "error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"ok": False, "kind": kind, "error": f"stream error: {json.dumps(chunk['error'])[:200]}"}
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                usage = chunk["usage"]
    if not stamps:
        return {"ok": False, "kind": kind, "error": "no tokens streamed"}
    return {"ok": True, "kind": kind, "ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "e2e": time.perf_counter() - t0, "output": usage.get("completion_tokens", len(stamps))}


async def clients(session: aiohttp.ClientSession, url: str, source: Iterator[Request], concurrency: int,
                  results: list[dict], *, ramp: float = 0.0, until: float | None = None) -> None:
    """``concurrency`` closed-loop clients: each sends its next request from ``source`` when its last
    one ended, until ``source`` runs out or (wall clock) ``until``; client i starts ``i / concurrency x
    ramp`` s in."""
    async def client(i: int) -> None:
        await asyncio.sleep(i / concurrency * ramp)
        while until is None or time.perf_counter() < until:
            req = next(source, None)
            if req is None:
                return
            try:
                results.append(await one_stream(session, url, req))
            except Exception as exc:  # counted as a failure
                results.append({"ok": False, "kind": req[2], "error": repr(exc)})

    await asyncio.gather(*(client(i) for i in range(concurrency)))


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=600))


async def closed_loop(url: str, reqs: list[Request], concurrency: int) -> tuple[list[dict], float]:
    results: list[dict] = []
    async with session() as s:
        t0 = time.perf_counter()
        await clients(s, url, iter(reqs), concurrency, results)
        return results, time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summarize(results: list[dict], makespan: float, speedup: float) -> dict:
    ok = [r for r in results if r["ok"]]
    ms = 1000 * speedup  # wall seconds -> simulated ms
    ttft = [r["ttft"] for r in ok]
    itl = [g for r in ok for g in r["itl"]]
    sim_s = makespan * speedup
    return {"ttft_p50": ms * pct(ttft, 0.5), "ttft_p90": ms * pct(ttft, 0.9),
            "ttft_mean": ms * statistics.fmean(ttft) if ttft else float("nan"),
            "itl_p50": ms * pct(itl, 0.5), "itl_p90": ms * pct(itl, 0.9), "itl_p99": ms * pct(itl, 0.99),
            "tps": sum(r["output"] for r in ok) / sim_s, "rps": len(ok) / sim_s,
            "n": len(results), "failed": len(results) - len(ok), "wall": makespan,
            "errors": sorted({r["error"] for r in results if not r["ok"]})[:3]}


# --- fleets -------------------------------------------------------------------------------------------
def engine_args(speedup: float, kv_bytes: int | None) -> list[str]:
    return ["--speedup", str(speedup), *(["--kv-bytes-per-token", str(kv_bytes)] if kv_bytes else [])]


def warm_up(url: str) -> None:
    """One short request, so connection set-up and first-use costs fall outside the measurement."""
    results, _ = asyncio.run(closed_loop(url, [([1000 + i for i in range(16)], 4, "")], 1))
    if not results[0]["ok"]:
        raise RuntimeError(f"warm-up request failed: {results[0]['error']}")


def run_sweep_fleet(label: str, args, points: dict[int, list[Request]], kv_bytes: int | None,
                    **fleet) -> dict[int, dict]:
    tmp = Path(tempfile.mkdtemp(prefix="infera-pd-sweep-"))
    procs, url, _ = start_fleet(tmp, policy=args.router_policy, engine_args=engine_args(args.speedup, kv_bytes),
                                need_block_size=True, **fleet)
    try:
        warm_up(url)
        out = {}
        for conc, reqs in points.items():
            results, makespan = asyncio.run(closed_loop(url, reqs, conc))
            out[conc] = {**summarize(results, makespan, args.speedup), "logs": tmp}
            print(f"  {label} c={conc}: {len(reqs)} requests in {makespan:.1f} s wall", flush=True)
        return out
    finally:
        stop_fleet(procs)


def lease_gauges(text: str) -> dict[str, float]:
    """worker id -> infera_router_active_leases, from a Prometheus exposition."""
    out = {}
    for line in text.splitlines():
        if line.startswith(LEASES + "{"):
            labels, value = line[len(LEASES) + 1:].rsplit("} ", 1)
            worker = dict(kv.split("=", 1) for kv in labels.split(",")).get("worker", '""').strip('"')
            out[worker] = float(value)
    return out


def engine_requests(engine_url: str) -> float:
    with urllib.request.urlopen(engine_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("sglang:num_requests_total"))


async def sample_leases(s: aiohttp.ClientSession, metrics_url: str, interval: float,
                        samples: list[dict[str, float]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            async with s.get(metrics_url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                samples.append(lease_gauges(await resp.text()))
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


async def guard_load(url: str, metrics_url: str, args) -> tuple[list[dict], float, list[dict[str, float]]]:
    """The long-decode mix for ``--guard-seconds``, sampling the router's lease gauges meanwhile."""
    results: list[dict] = []
    samples: list[dict[str, float]] = []
    long = random_requests(args.seed * 1000 + 1, args.guard_long_input, args.guard_long_output, args.range_ratio,
                           "long-decode")
    short = random_requests(args.seed * 1000 + 2, args.guard_short_input, args.guard_short_output,
                            args.range_ratio, "long-prompt")
    stop = asyncio.Event()
    async with session() as s:
        sampler = asyncio.create_task(sample_leases(s, metrics_url, args.sample_interval, samples, stop))
        t0 = time.perf_counter()
        until = t0 + args.guard_seconds
        try:
            await asyncio.gather(clients(s, url, long, args.guard_long, results, ramp=args.guard_ramp, until=until),
                                 clients(s, url, short, args.guard_short, results, ramp=args.guard_ramp, until=until))
        finally:
            makespan = time.perf_counter() - t0
            stop.set()
            await sampler
    return results, makespan, samples


def run_guard(policy: str, mode: str, args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"infera-pd-guard-{mode}-"))
    ports = [free_port() for _ in range(args.guard_prefill + args.guard_decode + 2)]
    procs, url, active = start_fleet(
        tmp, workers=0, prefill_workers=args.guard_prefill, decode_workers=args.guard_decode, policy=policy,
        engine_args=engine_args(args.speedup, args.guard_kv_bytes), metrics_ports=ports, need_block_size=True,
        env={"INFERA_PD_PREFILL_GUARD_RELEASE": mode})
    prefill = sorted((w for w in active if w.get("role") == "prefill"), key=lambda w: w["worker_id"])
    decode = {w["worker_id"] for w in active if w.get("role") == "decode"}
    try:
        warm_up(url)
        before = [engine_requests(w["url"]) for w in prefill]
        results, makespan, samples = asyncio.run(guard_load(url, f"http://127.0.0.1:{ports[1]}/metrics", args))
        split = [int(engine_requests(w["url"]) - b) for w, b in zip(prefill, before)]
    finally:
        stop_fleet(procs)
    out = {**summarize(results, makespan, args.speedup), "logs": tmp, "split": split, "samples": len(samples)}
    heavy = summarize([r for r in results if r["kind"] == "long-prompt"], makespan, args.speedup)
    out.update(short_p50=heavy["ttft_p50"], short_p90=heavy["ttft_p90"])
    pids = [w["worker_id"] for w in prefill]
    total = [sum(s.get(w, 0.0) for w in pids) for s in samples] or [float("nan")]
    busiest = [max((s.get(w, 0.0) for w in pids), default=0.0) for s in samples] or [float("nan")]
    dec = [sum(v for w, v in s.items() if w in decode) for s in samples] or [float("nan")]
    out.update(prefill_mean=statistics.fmean(total), prefill_max=max(total), busiest_mean=statistics.fmean(busiest),
               decode_mean=statistics.fmean(dec))
    print(f"  guard {policy} {mode}: {out['n']} requests in {makespan:.1f} s wall, {len(samples)} lease samples",
          flush=True)
    return out


# --- tables -------------------------------------------------------------------------------------------
def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def print_sweep(rows: dict[str, dict[int, dict]], args) -> None:
    print(f"\nSweep: input {args.max_input} x U[{args.range_ratio:g}, 1] random token ids, output "
          f"{args.max_output} x U[{args.range_ratio:g}, 1] tokens; closed loop, >= {args.requests} requests per "
          f"point; speedup {args.speedup:g}; router policy {args.router_policy or 'default (kv-aware)'}; times in "
          f"simulated ms, throughput per simulated s\n")
    w = max(len(k) for k in rows) + 1
    hdr = (f"{'conc':>4} {'fleet':<{w}} {'reqs':>4} {'TTFT p50':>8} {'p90':>6} {'ITL p50':>7} {'p90':>6} {'p99':>6} "
           f"{'out tok/s':>9} {'req/s':>6} {'failed':>6}")
    print(hdr)
    print("-" * len(hdr))
    base_label = next(iter(rows))
    for conc in rows[base_label]:
        for label, points in rows.items():
            r = points[conc]
            print(f"{conc:>4} {label:<{w}} {r['n']:>4} {r['ttft_p50']:>8.0f} {r['ttft_p90']:>6.0f} "
                  f"{r['itl_p50']:>7.1f} {r['itl_p90']:>6.1f} {r['itl_p99']:>6.1f} {r['tps']:>9.0f} {r['rps']:>6.2f} "
                  f"{r['failed']:>6}")
    print(f"\nratios to {base_label} (same run):")
    hdr = (f"{'conc':>4} {'fleet':<{w}} {'TTFT p50':>8} {'p90':>6} {'ITL p50':>7} {'p90':>6} {'p99':>6} "
           f"{'out tok/s':>9} {'req/s':>6}")
    print(hdr)
    print("-" * len(hdr))
    for conc, a in rows[base_label].items():
        for label, points in itertools.islice(rows.items(), 1, None):
            p = points[conc]
            print(f"{conc:>4} {label:<{w}} {ratio(p['ttft_p50'], a['ttft_p50']):>8} "
                  f"{ratio(p['ttft_p90'], a['ttft_p90']):>6} {ratio(p['itl_p50'], a['itl_p50']):>7} "
                  f"{ratio(p['itl_p90'], a['itl_p90']):>6} {ratio(p['itl_p99'], a['itl_p99']):>6} "
                  f"{ratio(p['tps'], a['tps']):>9} {ratio(p['rps'], a['rps']):>6}")
    for label, points in rows.items():
        for conc, r in points.items():
            if r["errors"]:
                print(f"errors, {label} c={conc}: {'; '.join(r['errors'])} (logs {r['logs']})")


def print_guard(rows: dict[tuple[str, str], dict], args) -> None:
    print(f"\nGuard release: {args.guard_prefill}P{args.guard_decode}D, KV {args.guard_kv_bytes} B/token; "
          f"{args.guard_long} clients long-decode (input {args.guard_long_input}, output {args.guard_long_output}) + "
          f"{args.guard_short} clients long-prompt (input {args.guard_short_input}, output {args.guard_short_output}), "
          f"lengths x U[{args.range_ratio:g}, 1], closed loops for {args.guard_seconds:g} s wall; leases sampled every "
          f"{args.sample_interval:g} s; times in simulated ms\n")
    hdr = (f"{'policy':<12} {'release':<10} {'reqs':>4} | {'prefill leases mean':>19} {'max':>4} {'busiest':>7} "
           f"{'decode':>6} | {'prefill split':>13} | {'TTFT p50':>8} {'p90':>6} {'mean':>6} | "
           f"{'long-prompt p50':>15} {'p90':>6} | {'ITL p50':>7} {'out tok/s':>9} {'failed':>6}")
    print(hdr)
    print("-" * len(hdr))
    for (policy, mode), r in rows.items():
        print(f"{policy:<12} {mode:<10} {r['n']:>4} | {r['prefill_mean']:>19.2f} {r['prefill_max']:>4.0f} "
              f"{r['busiest_mean']:>7.2f} {r['decode_mean']:>6.2f} | {str(r['split']):>13} | "
              f"{r['ttft_p50']:>8.0f} {r['ttft_p90']:>6.0f} {r['ttft_mean']:>6.0f} | {r['short_p50']:>15.0f} "
              f"{r['short_p90']:>6.0f} | {r['itl_p50']:>7.1f} {r['tps']:>9.0f} {r['failed']:>6}")
    for policy in dict.fromkeys(p for p, _ in rows):
        h, c = rows.get((policy, "hold")), rows.get((policy, "completion"))
        if h and c:
            print(f"{policy}, completion / hold: prefill leases mean {ratio(c['prefill_mean'], h['prefill_mean'])}; "
                  f"TTFT p50 {ratio(c['ttft_p50'], h['ttft_p50'])}, p90 {ratio(c['ttft_p90'], h['ttft_p90'])}, "
                  f"mean {ratio(c['ttft_mean'], h['ttft_mean'])}; long-prompt TTFT p50 "
                  f"{ratio(c['short_p50'], h['short_p50'])}, p90 {ratio(c['short_p90'], h['short_p90'])}; "
                  f"out tok/s {ratio(c['tps'], h['tps'])}")
    for (policy, mode), r in rows.items():
        if r["errors"]:
            print(f"errors, {policy} {mode}: {'; '.join(r['errors'])} (logs {r['logs']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", choices=["sweep", "guard"], default=["sweep", "guard"])
    ap.add_argument("--speedup", type=float, default=1.0, help="mock engine --speedup (times are reported x this)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--range-ratio", type=float, default=0.5, help="lengths are uniform in [ratio x max, max]")
    ap.add_argument("--max-input", type=int, default=2048, help="sweep: largest prompt, tokens")
    ap.add_argument("--max-output", type=int, default=128, help="sweep: largest output, tokens")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32], help="sweep: points")
    ap.add_argument("--requests", type=int, default=16, help="sweep: requests per point (at least 2 x concurrency)")
    ap.add_argument("--router-policy", default=None, help="sweep: router policy (default: the router's)")
    ap.add_argument("--agg-workers", type=int, default=2, help="sweep baseline: aggregated engines")
    ap.add_argument("--prefill-workers", type=int, default=1, help="sweep: prefill engines")
    ap.add_argument("--decode-workers", type=int, default=1, help="sweep: decode engines")
    ap.add_argument("--light-kv-bytes", type=int, default=2048,
                    help="sweep: KV bytes per prompt token of the second PD row (0: no such row)")
    ap.add_argument("--guard-policies", nargs="+", default=["least-loaded", "kv-aware"],
                    help="guard part: router policies, each run with both releases")
    ap.add_argument("--guard-modes", nargs="+", choices=["hold", "completion"], default=["hold", "completion"])
    ap.add_argument("--guard-prefill", type=int, default=2, help="guard part: prefill engines")
    ap.add_argument("--guard-decode", type=int, default=1, help="guard part: decode engines")
    ap.add_argument("--guard-kv-bytes", type=int, default=2048, help="guard part: KV bytes per prompt token")
    ap.add_argument("--guard-long", type=int, default=8, help="guard part: long-decode clients")
    ap.add_argument("--guard-long-input", type=int, default=256, help="guard part: long-decode largest prompt")
    ap.add_argument("--guard-long-output", type=int, default=512, help="guard part: long-decode largest output")
    ap.add_argument("--guard-short", type=int, default=8, help="guard part: long-prompt clients")
    ap.add_argument("--guard-short-input", type=int, default=4096, help="guard part: long-prompt largest prompt")
    ap.add_argument("--guard-short-output", type=int, default=16, help="guard part: long-prompt largest output")
    ap.add_argument("--guard-seconds", type=float, default=20.0, help="guard part: wall seconds per run")
    ap.add_argument("--guard-ramp", type=float, default=2.0, help="guard part: clients start spread over this (wall s)")
    ap.add_argument("--sample-interval", type=float, default=0.1, help="guard part: wall s between lease samples")
    args = ap.parse_args()

    t0 = time.perf_counter()
    if "sweep" in args.parts:
        points = {c: list(itertools.islice(random_requests(args.seed * 1000 + i, args.max_input, args.max_output,
                                                           args.range_ratio), max(args.requests, 2 * c)))
                  for i, c in enumerate(args.concurrency)}
        pd_label = f"{args.prefill_workers}P{args.decode_workers}D"
        pd_fleet = {"workers": 0, "prefill_workers": args.prefill_workers, "decode_workers": args.decode_workers}
        sweep = {f"agg x{args.agg_workers}": run_sweep_fleet("agg", args, points, None, workers=args.agg_workers)}
        sweep[pd_label] = run_sweep_fleet(pd_label, args, points, None, **pd_fleet)
        if args.light_kv_bytes:
            label = f"{pd_label} KV {args.light_kv_bytes}B"
            sweep[label] = run_sweep_fleet(label, args, points, args.light_kv_bytes, **pd_fleet)
    if "guard" in args.parts:
        guard = {(p, m): run_guard(p, m, args) for p in args.guard_policies for m in args.guard_modes}
    if "sweep" in args.parts:
        print_sweep(sweep, args)
    if "guard" in args.parts:
        print_guard(guard, args)
    print(f"\n(total {time.perf_counter() - t0:.0f} s wall)")


if __name__ == "__main__":
    main()
