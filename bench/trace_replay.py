"""KV-aware routing on real multi-turn traffic: the Mooncake FAST'25 conversation trace.

Standard settings (the issue's, so figures compare with its Dynamo anchor): requests 2000-2999 of
the trace; each 512-token hash id expanded into 512 deterministic token ids (same id, same tokens),
sent as token-id prompts truncated at 16,384 tokens; outputs capped at 256; 4 mock engines with
block size 64 and 8,192 KV blocks each; arrivals compressed 4x (requests inside one 3 s bin of the
trace spread over it) with the engines' speedup 4. Each row gets a fresh fleet, one after the other
in one run:

- an Infera routing policy (round-robin, least-loaded, kv-aware, ...): nats-server, kv-indexer,
  router --router-policy P, frontend and one worker-agent + mock engine per worker, as `infera up`
  starts them; requests go to the frontend's POST /v1/completions with the token ids as `prompt`;
- `sglang-router`: the same mock engines started bare (no Infera service) behind the public
  sglang-router (pip extra `bench`) with its `cache_aware` policy; requests go to the router's
  POST /generate with the token ids as `input_ids` (its /v1/completions takes text prompts only,
  and on /generate its cache-aware tree keys on the ids, written out as decimal text).

Reported per row: prefix hit ratio (engine-reported cached / prompt tokens), TTFT mean/p50/p90
and end-to-end p50 in SIMULATED ms (wall time x speedup), throughput over the replay (requests/s
and output tokens/s, simulated), the request split across engines (max share / mean share, from
each engine's own request counter), failures; ratios against round-robin; and three references over
the same window: one infinite cache, one LRU cache of the whole fleet's capacity, and the same LRU
also caching each request's output after its prompt, as the engines do (all at block size 64, full
blocks only). With sglang-router in the run, each other row's TTFT is also compared with its on the
requests that got the same cache hit in both (the paths' cost, not the routing's). Each row also
prints the CPU its clients took (they share the two cores with what they measure, so they are kept
light) and, for Infera rows, the router's mean route and kv-indexer query times.

    .venv/bin/python bench/trace_replay.py [--start 2000 --count 1000] [--workers 4]
        [--policies round-robin least-loaded kv-aware sglang-router]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import random
import statistics
import tempfile
import time
import urllib.request
from collections import OrderedDict
from pathlib import Path

import aiohttp
import orjson
import uvloop

from benchfleet import (sglang_router_installed, start_engines, start_fleet, start_sglang_router,
                        stop_fleet)
from infera.procs import free_port
from infera_common.block_hash import block_hashes
from infera_common.models import BUNDLED_MODEL_NAME
from infera_common.sse import SseDecoder

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_fast25_conversation_trace.jsonl.gz"
TRACE_BLOCK = 512
SGLANG_ROW = "sglang-router"  # --policies name of the sglang-router rows: cache_aware, or sglang-router@POLICY
VOCAB = 49152


def load_trace(path: Path, start: int, count: int) -> list[dict]:
    out = []
    with gzip.open(path, "rt") as f:
        for i, line in enumerate(f):
            if i >= start:
                out.append(json.loads(line))
            if len(out) >= count:
                break
    return out


def block_tokens(hash_id: int) -> list[int]:
    rng = random.Random(hash_id * 7919 + 17)
    return [rng.randrange(100, VOCAB) for _ in range(TRACE_BLOCK)]


def prompt_ids(rec: dict, cache: dict[int, list[int]], max_prompt: int) -> list[int]:
    ids: list[int] = []
    for h in rec["hash_ids"]:
        if len(ids) >= max_prompt:
            break
        if h not in cache:
            cache[h] = block_tokens(h)
        ids.extend(cache[h])
    return ids[: min(rec["input_length"], max_prompt)]


def reference_hits(prompts: list[list[int]], block: int, capacity_blocks: int | None,
                   outputs: list[int] | None = None) -> float:
    """Hit ratio (cached / prompt tokens) of ONE cache over the window: infinite, or LRU of capacity_blocks.

    ``outputs`` (tokens generated per request): also cache each request's output after its prompt,
    as every engine (and the mock) does; the output tokens are unique to their request."""
    lru: OrderedDict[int, None] = OrderedDict()
    hit_tokens = total = 0
    for i, ids in enumerate(prompts):
        total += len(ids)
        hashes = block_hashes(ids, block)
        matched = 0
        for h in hashes:
            if h not in lru:
                break
            matched += 1
        hit_tokens += matched * block
        if outputs is not None and outputs[i]:
            rng = random.Random(-1 - i)
            hashes = block_hashes(ids + [rng.randrange(100, VOCAB) for _ in range(outputs[i])], block)
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while capacity_blocks is not None and len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return hit_tokens / max(1, total)


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
            out[i] = (ts - stamps[0] + width * j / len(members)) / 1000.0 / time_scale
    return out


#: The clients share the two cores with what they measure, so they do as little as they can: uvloop,
#: bodies encoded by orjson, and of a stream only the chunks up to the first token and the last parsed.
JSON_HEADERS = {"Content-Type": "application/json"}


def has_usage(payload: bytes) -> bool:
    return b'"usage":{' in payload or b'"usage": {' in payload


async def sse_payloads(resp: aiohttp.ClientResponse):
    """The JSON payloads of an SSE response, as the chunks arrive."""
    decoder = SseDecoder()
    async for chunk in resp.content.iter_any():
        for payload in decoder.feed(chunk):
            if payload.startswith(b"{"):
                yield payload


async def one_completion(session: aiohttp.ClientSession, url: str, ids: list[int], max_tokens: int) -> dict:
    """One streamed POST /v1/completions with a token-id prompt (Infera's frontend)."""
    body = orjson.dumps({"model": BUNDLED_MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "stream": True,
                         "stream_options": {"include_usage": True}, "temperature": 0})
    t0 = time.perf_counter()
    ttft = None
    usage = None
    async with session.post(url + "/v1/completions", data=body, headers=JSON_HEADERS) as resp:
        if resp.status != 200:
            return {"ok": False, "status": resp.status}
        async for payload in sse_payloads(resp):
            if ttft is not None and not has_usage(payload):
                continue
            chunk = orjson.loads(payload)
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    e2e = time.perf_counter() - t0
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ok": True, "ttft": ttft if ttft is not None else e2e, "e2e": e2e,
            "prompt": usage.get("prompt_tokens", len(ids)), "cached": cached,
            "output": usage.get("completion_tokens", 0)}


async def one_generate(session: aiohttp.ClientSession, url: str, ids: list[int], max_tokens: int) -> dict:
    """One streamed SGLang-native POST /generate with ``input_ids`` (the sglang-router row).

    Each frame carries everything generated so far; the last one's meta_info has the usage.
    """
    body = orjson.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0},
                         "stream": True})
    t0 = time.perf_counter()
    ttft = None
    last = None
    async with session.post(url + "/generate", data=body, headers=JSON_HEADERS) as resp:
        if resp.status != 200:
            return {"ok": False, "status": resp.status}
        async for payload in sse_payloads(resp):
            last = payload
            if ttft is None and orjson.loads(payload).get("output_ids"):
                ttft = time.perf_counter() - t0
    e2e = time.perf_counter() - t0
    meta = (orjson.loads(last).get("meta_info") or {}) if last is not None else {}
    return {"ok": True, "ttft": ttft if ttft is not None else e2e, "e2e": e2e,
            "prompt": meta.get("prompt_tokens", len(ids)), "cached": meta.get("cached_tokens", 0),
            "output": meta.get("completion_tokens", 0)}


async def replay(send, url: str, trace: list[dict], prompts: list[list[int]], offsets: list[float],
                 max_tokens_cap: int) -> list[dict]:
    """Send request i at offsets[i] (seconds from the start) with ``send`` (one_completion / one_generate)."""
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = time.perf_counter()

        async def at(i: int) -> dict:
            delay = offsets[i] - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                return await send(session, url, prompts[i], max(1, min(trace[i]["output_length"], max_tokens_cap)))
            except Exception as exc:  # counted as a failure
                return {"ok": False, "status": repr(exc)}

        return await asyncio.gather(*(at(i) for i in range(len(trace))))


def summarize(results: list[dict], speedup: float, makespan: float, split: list[float]) -> dict:
    ok = [r for r in results if r["ok"]]
    ttfts = sorted(r["ttft"] for r in ok) or [float("nan")]
    sim = 1000 * speedup  # wall seconds -> simulated ms
    sim_seconds = makespan * speedup
    mean_share = sum(split) / max(1, len(split))
    return {
        "hit": sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok)),
        "ttft_mean": sim * statistics.fmean(ttfts),
        "ttft_p50": sim * statistics.median(ttfts),
        "ttft_p90": sim * ttfts[min(len(ttfts) - 1, int(0.90 * len(ttfts)))],
        "e2e_p50": sim * statistics.median([r["e2e"] for r in ok] or [float("nan")]),
        "rps": len(ok) / sim_seconds,
        "tps": sum(r["output"] for r in ok) / sim_seconds,
        "makespan": makespan,
        "split": max(split) / mean_share if mean_share else float("nan"),
        "split_counts": split,
        "failed": 1 - len(ok) / max(1, len(results)),
        "errors": sorted({str(r["status"]) for r in results if not r["ok"]})[:3],
    }


def engine_requests(engine_urls: list[str]) -> list[float]:
    """Requests each engine has finished (its own sglang:num_requests counter)."""
    counts = []
    for url in engine_urls:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        counts.append(sum(float(line.split()[-1]) for line in text.splitlines()
                          if line.startswith("sglang:num_requests_total")))
    return counts


def fleet_engines(frontend: str) -> list[str]:
    """The engine URLs of an Infera fleet, in worker-id order (from the frontend's /v1/workers)."""
    with urllib.request.urlopen(f"{frontend}/v1/workers", timeout=5) as r:
        workers = sorted(json.load(r)["data"], key=lambda w: w["worker_id"])
    return [w["url"] for w in workers]


def measure(send, url: str, engines: list[str], trace, prompts, offsets, args) -> dict:
    before = engine_requests(engines)
    t0, cpu0 = time.perf_counter(), time.process_time()
    results = uvloop.run(replay(send, url, trace, prompts, offsets, args.max_tokens))  # (the services' loop too)
    makespan, client_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    split = [b - a for a, b in zip(before, engine_requests(engines))]
    out = summarize(results, args.speedup, makespan, split)
    out["results"] = results
    out["client_cpu"] = client_cpu  # the clients share the two cores with what they measure
    return out


#: The router's own counters worth reading after a replay (why a kv-aware pick went where it did).
ROUTER_COUNTERS = ("infera_router_kv_query_failures_total", "infera_router_kv_picks_without_cache_info_total",
                   "infera_router_prefilled_total", "infera_router_kv_hit_blocks_sum", "infera_router_kv_picks_total")
#: Histograms whose mean the row reports (wall ms): a route answered, and the kv-indexer query within it.
ROUTER_TIMES = ("infera_router_route_seconds", "infera_router_kv_query_seconds")


def router_counters(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.removesuffix("_sum").removesuffix("_count") in ROUTER_TIMES:
            out[name] = float(line.rsplit(" ", 1)[-1])
        elif name in ROUTER_COUNTERS:  # per reason where a reason is given (worker labels are summed)
            reason = line.split('reason="', 1)[1].split('"', 1)[0] if 'reason="' in line else None
            key = f"{name}{{reason={reason}}}" if reason else name
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[-1])
    return out


def run_infera(row: str, engine_args: list[str], trace, prompts, offsets, args) -> dict:
    """One Infera row: ``policy``, ``policy@no-broker`` (etcd, HTTP requests, ZMQ events, infera.server) or
    ``policy@local-index`` (the NATS plane with the router on ``--kv-index local``) or ``policy@no-evict``
    (the NATS plane with ``--kv-evict-weight 0``)."""
    policy, _, variant = row.partition("@")
    if variant not in INFERA_VARIANTS:
        raise SystemExit(f"unknown row {row!r}: after '@' give one of {', '.join(INFERA_VARIANTS)}")
    plane = "no-broker" if variant == "no-broker" else "nats"
    tmp = Path(tempfile.mkdtemp(prefix=f"infera-trace-{policy}-"))
    ports = [free_port() for _ in range(args.workers + 2)]
    procs, url, _ = start_fleet(tmp, workers=args.workers, policy=policy, engine_args=engine_args,
                                need_block_size=True, metrics_ports=ports, plane=plane,
                                env=VARIANT_ENV.get(variant))
    try:
        result = measure(one_completion, url, fleet_engines(url), trace, prompts, offsets, args)
        result["router"] = router_counters(f"{url}/metrics" if plane == "no-broker"
                                           else f"http://127.0.0.1:{ports[1]}/metrics")
        return result
    finally:
        stop_fleet(procs)


#: What may follow an Infera row's policy after '@' ('': the default NATS-plane fleet).
INFERA_VARIANTS = ("", "no-broker", "local-index", "no-evict")
#: The environment a variant's processes get (the same flags as settings, ``INFERA_*``).
VARIANT_ENV = {"local-index": {"INFERA_KV_INDEX": "local"}, "no-evict": {"INFERA_KV_EVICT_WEIGHT": "0"}}


def sglang_policy(row: str) -> str:
    """The sglang-router policy of a row: ``sglang-router`` is cache_aware, ``sglang-router@round_robin`` ..."""
    return row.partition("@")[2] or "cache_aware"


def run_sglang_router(row: str, engine_args: list[str], trace, prompts, offsets, args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="infera-trace-sglang-router-"))
    procs, engines = start_engines(tmp, workers=args.workers, engine_args=engine_args)
    try:
        router, url = start_sglang_router(tmp, engines, policy=sglang_policy(row))
        procs.append(router)
        return measure(one_generate, url, engines, trace, prompts, offsets, args)
    finally:
        stop_fleet(procs)


def row_label(policy: str) -> str:
    return f"{SGLANG_ROW} {sglang_policy(policy)}" if policy.startswith(SGLANG_ROW) else policy


def print_table(rows: dict[str, dict], args, n: int, infinite: float, fleet_lru: float,
                fleet_lru_outputs: float) -> None:
    base = rows.get("round-robin") or next(iter(rows.values()))
    print(f"\nMooncake conversation trace, requests {args.start}-{args.start + n - 1}; prompts <= "
          f"{args.max_prompt} tokens, outputs <= {args.max_tokens}; {args.workers} mock engines x {args.kv_blocks} "
          f"blocks of {args.block_size}; arrivals / {args.time_scale:g}, speedup {args.speedup:g}; times in "
          f"simulated ms, throughput per simulated s\n")
    w = 25
    hdr = (f"{'policy':<{w}} {'hit':>6} {'TTFT mean':>10} {'p50':>7} {'p90':>7} {'e2e p50':>8} {'req/s':>6} "
           f"{'out tok/s':>9} {'max/mean':>8} {'failed':>6} | vs round-robin: {'hit':>5} {'TTFT p90':>8}")
    print(hdr)
    print("-" * len(hdr))
    for policy, r in rows.items():
        print(f"{row_label(policy):<{w}} {r['hit']:>6.3f} {r['ttft_mean']:>10.0f} {r['ttft_p50']:>7.0f} "
              f"{r['ttft_p90']:>7.0f} {r['e2e_p50']:>8.0f} {r['rps']:>6.2f} {r['tps']:>9.0f} {r['split']:>8.2f} "
              f"{100 * r['failed']:>5.1f}% | {' ':>15}{r['hit'] / max(base['hit'], 1e-9):>5.2f}x "
              f"{r['ttft_p90'] / base['ttft_p90']:>7.2f}x")
    print(f"{'infinite cache':<{w}} {infinite:>6.3f}   (reference: one cache of unbounded size)")
    print(f"{'fleet LRU':<{w}} {fleet_lru:>6.3f}   (reference: one LRU of {args.workers * args.kv_blocks} blocks)")
    print(f"{'fleet LRU, outputs too':<{w}} {fleet_lru_outputs:>6.3f}   (reference: the same LRU also caching each "
          "request's output after its prompt, as the engines do)")
    for policy, r in rows.items():
        errors = f"; errors: {', '.join(r['errors'])}" if r["errors"] else ""
        print(f"requests per engine, {row_label(policy)}: {[int(x) for x in r['split_counts']]} "
              f"(replay took {r['makespan']:.0f} s wall, the clients {r['client_cpu']:.1f} s of CPU{errors})")
        if r.get("router"):
            counters = {k: v for k, v in r["router"].items() if not k.startswith(ROUTER_TIMES)}
            times = [f"{name.removeprefix('infera_router_').removesuffix('_seconds')} mean "
                     f"{1000 * r['router'][name + '_sum'] / r['router'][name + '_count']:.2f} ms"
                     for name in ROUTER_TIMES if r["router"].get(name + "_count")]
            print(f"router counters, {row_label(policy)}: "
                  + ", ".join([*(f"{k.removeprefix('infera_router_')} {v:.0f}" for k, v in counters.items()), *times]))


PROMPT_BUCKETS = ((0, 2000), (2000, 6000), (6000, 12000), (12000, 1 << 30))


def print_same_hit_gaps(rows: dict[str, dict], speedup: float) -> None:
    """Routing or path? For the requests that got the SAME cached tokens in two rows, the TTFT
    difference is the paths' (and the load's), not the cache's: each row against the sglang-router row."""
    ref_name = next((p for p in rows if p.startswith(SGLANG_ROW)), None)
    if ref_name is None:
        return
    ref = rows[ref_name]["results"]
    for policy, r in rows.items():
        if policy == ref_name:
            continue
        cells = []
        for lo, hi in PROMPT_BUCKETS:
            diff = sorted(1000 * speedup * (x["ttft"] - y["ttft"]) for x, y in zip(r["results"], ref)
                          if x["ok"] and y["ok"] and x["cached"] == y["cached"] and lo <= x["prompt"] < hi)
            if diff:
                span = f"{lo // 1000}k-{hi // 1000}k" if hi < 1 << 30 else f"{lo // 1000}k+"
                cells.append(f"{span}: {statistics.median(diff):+.0f} (n {len(diff)})")
        print(f"TTFT {row_label(policy)} minus {row_label(ref_name)}, requests with the same cache hit in both, "
              f"median by prompt length (simulated ms): " + ", ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--start", type=int, default=2000, help="first trace record of the window")
    ap.add_argument("--count", type=int, default=1000, help="records in the window (fewer for a quick run)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=4.0, help="divide the trace's arrival times by this")
    ap.add_argument("--speedup", type=float, default=4.0, help="mock engine --speedup")
    ap.add_argument("--kv-blocks", type=int, default=8192, help="KV blocks per engine")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=16384, help="truncate prompts at this many tokens")
    ap.add_argument("--max-tokens", type=int, default=256, help="cap on the trace's output lengths")
    ap.add_argument("--policies", nargs="+", default=["round-robin", "least-loaded", "kv-aware", SGLANG_ROW],
                    help=f"rows to run, in order: Infera --router-policy names (NAME@no-broker: on etcd, HTTP and "
                    f"ZMQ with one infera.server; NAME@local-index: the router on --kv-index local; NAME@no-evict: --kv-evict-weight 0), and {SGLANG_ROW} (or {SGLANG_ROW}@round_robin, ...: another of its policies) "
                    "(the public sglang-router, policy cache_aware, in front of bare mock engines)")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--dump-dir", type=Path, default=None,
                    help="also write each row's per-request results (wall seconds) to DIR/<row>.jsonl")
    args = ap.parse_args()
    if len(set(args.policies)) != len(args.policies):
        ap.error("each row may be given once in --policies (rows are reported by name)")
    if any(p.startswith(SGLANG_ROW) for p in args.policies) and not sglang_router_installed():
        ap.error(f"the {SGLANG_ROW} row needs the sglang-router package: `make bench` installs it (or "
                 f"`.venv/bin/pip install -e '.[test,bench]'`); or leave {SGLANG_ROW} out of --policies")
    trace = load_trace(args.trace, args.start, args.count)
    token_cache: dict[int, list[int]] = {}
    prompts = [prompt_ids(rec, token_cache, args.max_prompt) for rec in trace]
    offsets = arrivals(trace, args.time_scale)
    engine_args = ["--speedup", str(args.speedup), "--num-kv-blocks", str(args.kv_blocks),
                   "--page-size", str(args.block_size), "--context-length", "131072"]
    rows = {}
    for policy in args.policies:
        if policy.startswith(SGLANG_ROW):
            rows[policy] = run_sglang_router(policy, engine_args, trace, prompts, offsets, args)
        else:
            rows[policy] = run_infera(policy, engine_args, trace, prompts, offsets, args)
    if args.dump_dir is not None:
        args.dump_dir.mkdir(parents=True, exist_ok=True)
        for policy, r in rows.items():
            with open(args.dump_dir / f"{policy}.jsonl", "w") as f:
                for i, res in enumerate(r["results"]):
                    f.write(json.dumps({"i": args.start + i, "arrival_s": offsets[i], **res}) + "\n")
    infinite = reference_hits(prompts, args.block_size, None)
    fleet_lru = reference_hits(prompts, args.block_size, args.workers * args.kv_blocks)
    outputs = [max(1, min(rec["output_length"], args.max_tokens)) for rec in trace]
    fleet_lru_outputs = reference_hits(prompts, args.block_size, args.workers * args.kv_blocks, outputs)
    print_table(rows, args, len(trace), infinite, fleet_lru, fleet_lru_outputs)
    print_same_hit_gaps(rows, args.speedup)


if __name__ == "__main__":
    main()
