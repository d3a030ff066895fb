"""Time to first token for long token-id prompts: Infera and sglang-router, each against the engine itself.

The trace replay's TTFT gap to sglang-router sits at p90, where ~16k-token prompts that share
nothing wait for their prefill. This measures what each path adds to such a request, one at a time:
a fleet per plane (``nats``: nats-server, router, frontend, kv-indexer, one worker-agent over one
mock engine; ``no-broker``: etcd + one ``infera.server``) and, over the SAME engine, the public
sglang-router (policy ``cache_aware``, pip extra ``bench``). Every request is a fresh random
token-id prompt (no cache hit anywhere, so the engine's work is the same on every path), streamed,
``max_tokens`` 1; TTFT is the client's time to the first generated token. Paths alternate in
one-second slices so that the machine's slow moments fall on all of them; each path's added TTFT
is against the engine called directly on the same API (``/v1/completions`` for Infera, SGLang's
``/generate`` with ``input_ids`` for sglang-router, as in ``trace_replay.py``).

    .venv/bin/python bench/long_prompt.py [--tokens 1024 16384] [--seconds 10] [--planes nats no-broker]
        [--page-size 1 --index-block-sizes 1 16 64]

With ``--index-block-sizes`` one Infera fleet runs per worker-agent ``--kv-index-block-size``, all
alternating in the same slices (each against its own engine called directly): at SGLang's default
page of one token, what folding the pages into larger index blocks saves.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from benchfleet import sglang_router_installed, start_fleet, start_sglang_router, stop_fleet
from trace_replay import VOCAB, one_completion, one_generate

DIRECT_OPENAI, DIRECT_GENERATE, SGLANG = "engine /v1/completions", "engine /generate", "sglang-router"


def fresh_prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(tokens)]


async def drive(paths: dict[str, tuple], tokens: int, seconds: float, slice_s: float, seed: int) -> dict[str, list[float]]:
    """TTFTs per path: each path in turn for ``slice_s`` seconds until each had ``seconds``."""
    rng = random.Random(seed)
    ttfts: dict[str, list[float]] = {name: [] for name in paths}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for send, url in paths.values():  # warm-up: connections, the router's first route
            for _ in range(2):
                await send(session, url, fresh_prompt(rng, tokens), 1)
        for _ in range(max(1, round(seconds / slice_s))):
            for name, (send, url) in paths.items():
                stop_at = time.perf_counter() + slice_s
                while time.perf_counter() < stop_at:
                    out = await send(session, url, fresh_prompt(rng, tokens), 1)
                    if not out["ok"]:
                        raise RuntimeError(f"{name}: {out['status']}")
                    ttfts[name].append(out["ttft"])
    return ttfts


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 16384], help="prompt lengths")
    ap.add_argument("--seconds", type=float, default=10.0, help="measuring time per path and length")
    ap.add_argument("--slice", type=float, default=1.0, help="seconds per path before the next takes over")
    ap.add_argument("--speedup", type=float, default=20.0,
                    help="mock engine --speedup (high, so that the paths' own time is not lost in prefill noise)")
    ap.add_argument("--planes", nargs="+", choices=["nats", "no-broker"], default=["nats", "no-broker"])
    ap.add_argument("--page-size", type=int, default=None,
                    help="the mock engine's --page-size (default: its own, 64); 1 is SGLang's default")
    ap.add_argument("--index-block-sizes", type=int, nargs="+", default=[0],
                    help="one Infera fleet per worker-agent --kv-index-block-size, all measured in the same run "
                         "(0: the agent picks; e.g. `--page-size 1 --index-block-sizes 1 16 64`)")
    args = ap.parse_args()
    with_sglang = sglang_router_installed()
    if not with_sglang:
        print("sglang-router is not installed (`make bench` installs it): its rows are left out")
    tmp = Path(tempfile.mkdtemp(prefix="infera-bench-"))
    engine_args = ["--speedup", str(args.speedup), "--context-length", "131072"]
    if args.page_size is not None:  # the same KV capacity in tokens as the default 16,384 pages of 64
        engine_args += ["--page-size", str(args.page_size), "--max-total-tokens", str(16384 * 64)]
    rows = []
    for plane in args.planes:
        procs: list = []
        paths: dict[str, tuple] = {}
        base_of: dict[str, str] = {}  # each path's direct baseline: its own fleet's engine
        try:
            for size in args.index_block_sizes:
                label = "" if args.index_block_sizes == [0] else f" idx {size}"
                where = tmp / f"{plane}{label.replace(' ', '-')}"
                where.mkdir()
                fleet, frontend, workers = start_fleet(where, workers=1, policy=None, engine_args=engine_args,
                                                       plane=plane, env={"INFERA_KV_INDEX_BLOCK_SIZE": str(size)})
                procs += fleet
                engine = workers[0]["url"]
                direct, infera = DIRECT_OPENAI + label, f"infera ({plane}){label}"
                paths |= {direct: (one_completion, engine), infera: (one_completion, frontend)}
                base_of[infera] = direct
                if with_sglang and not base_of.get(SGLANG):
                    proc, router = start_sglang_router(where, [engine])
                    procs.append(proc)
                    paths |= {DIRECT_GENERATE: (one_generate, engine), SGLANG: (one_generate, router)}
                    base_of[SGLANG] = DIRECT_GENERATE
            for n in args.tokens:
                ttfts = asyncio.run(drive(paths, n, args.seconds, args.slice, seed=n))
                rows.append((plane, n, ttfts, base_of))
        finally:
            stop_fleet(procs)
    page = f"page size {args.page_size}" if args.page_size is not None else "its default page size"
    print(f"\nTTFT of fresh token-id prompts, max_tokens 1, concurrency 1; mock engine speedup {args.speedup:g}, "
          f"{page}; {args.seconds:g} s per path and length, in {args.slice:g}-s slices; wall ms; logs {tmp}\n")
    width = max(24, *(len(name) for _, _, ttfts, _ in rows for name in ttfts))
    hdr = f"{'plane':<9} {'tokens':>6} {'path':<{width}} {'n':>5} {'p50':>8} {'p90':>8} | {'added p50':>9} {'p90':>7}"
    print(hdr)
    print("-" * len(hdr))
    for plane, n, ttfts, base_of in rows:  # each plane's paths against its own fleet's engine
        for name, values in ttfts.items():
            p50, p90 = 1000 * statistics.median(values), 1000 * quantile(values, 0.9)
            added = ""
            if name in base_of:
                base = ttfts[base_of[name]]
                added = f"{p50 - 1000 * statistics.median(base):>+9.2f} {p90 - 1000 * quantile(base, 0.9):>+7.2f}"
            print(f"{plane:<9} {n:>6} {name:<{width}} {len(values):>5} {p50:>8.2f} {p90:>8.2f} | {added}")


if __name__ == "__main__":
    main()
