"""What SGLang's default page of one token costs Infera, and what folding pages into index blocks saves.

One fleet per worker-agent ``--kv-index-block-size`` (1 = every page indexed as it is, the behaviour
before folding and the baseline; then e.g. 16 and 64), one after the other on the NATS plane (or
``--plane no-broker``), each over one mock engine with ``--page-size 1`` and the KV capacity of the
default 16,384 pages of 64 tokens. Each fleet gets the same fresh random token-id prompts (no cache
hit), one at a time, streamed with ``max_tokens`` 1. Reported per fleet: the CPU time each process
spent per request (from /proc, so the machine's noise barely moves it), TTFT p50 through Infera, and
the ratios of Infera's CPU against the baseline fleet's. The engine's own CPU is listed apart: at
page 1 the mock engine does per-token work for its prefix cache and events that a GPU engine's
scheduler also does, and it is the same in every fleet.

    .venv/bin/python bench/small_pages.py [--tokens 16384] [--requests 30] [--index-block-sizes 1 16 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
from pathlib import Path

import aiohttp

from benchfleet import start_fleet, stop_fleet
from long_prompt import fresh_prompt
from trace_replay import one_completion

ROLES = {  # a process's role: the module it runs (checked in this order), or the binary
    "infera_worker_agent.watchdog": None, "infera_worker_agent": "worker-agent", "infera_mock_engine": "engine",
    "infera.server": "infera.server", "infera_frontend": "frontend", "infera_router": "router",
    "infera_kv_indexer": "kv-indexer",
}
BINARIES = {"nats-server": "nats-server", "etcd": "etcd",
            "sglang::router": "sglang-router"}  # (the name sglang-router gives its process)
_HZ = os.sysconf("SC_CLK_TCK")


def _role(pid: int) -> str | None:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    binary = BINARIES.get(Path(argv[0]).name)
    if binary is not None:
        return binary
    return next((role for key, role in ROLES.items() if key in argv), None)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def fleet_cpu(roots: list[int]) -> dict[str, float]:
    """CPU seconds (user + system) so far of every process under ``roots``, summed by role."""
    by_role: dict[str, float] = {}
    todo = list(roots)
    while todo:
        pid = todo.pop()
        todo += _children(pid)
        role = _role(pid)
        if role is None:
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        by_role[role] = by_role.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / _HZ
    return by_role


async def drive(url: str, prompts: list[list[int]]) -> list[float]:
    ttfts = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for prompt in prompts:
            out = await one_completion(session, url, prompt, 1)
            if not out["ok"]:
                raise RuntimeError(f"request failed: {out['status']}")
            ttfts.append(out["ttft"])
    return ttfts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384, help="prompt length")
    ap.add_argument("--requests", type=int, default=30, help="measured requests per fleet (after 3 to warm up)")
    ap.add_argument("--index-block-sizes", type=int, nargs="+", default=[1, 16, 64],
                    help="one fleet per --kv-index-block-size; the first is the baseline")
    ap.add_argument("--plane", choices=["nats", "no-broker"], default="nats")
    ap.add_argument("--speedup", type=float, default=20.0, help="mock engine --speedup")
    args = ap.parse_args()
    rng = random.Random(7)
    warm = [fresh_prompt(rng, args.tokens) for _ in range(3)]
    prompts = [fresh_prompt(rng, args.tokens) for _ in range(args.requests)]
    engine_args = ["--speedup", str(args.speedup), "--context-length", "131072", "--page-size", "1",
                   "--max-total-tokens", str(16384 * 64)]
    tmp = Path(tempfile.mkdtemp(prefix="infera-bench-"))
    rows = []
    for size in args.index_block_sizes:
        where = tmp / f"index-{size}"
        where.mkdir()
        procs, url, workers = start_fleet(where, workers=1, policy=None, engine_args=engine_args, plane=args.plane,
                                          env={"INFERA_KV_INDEX_BLOCK_SIZE": str(size)})
        try:
            assert workers[0]["kv_index_block_size"] == size, workers[0]
            asyncio.run(drive(url, warm))
            roots = [p.pid for p in procs]
            before = fleet_cpu(roots)
            ttfts = asyncio.run(drive(url, prompts))
            after = fleet_cpu(roots)
        finally:
            stop_fleet(procs)
        per_request = {role: 1000 * (after[role] - before.get(role, 0.0)) / len(prompts) for role in after}
        rows.append((size, per_request, 1000 * statistics.median(ttfts)))
    roles = sorted({r for _, cpu, _ in rows for r in cpu if r != "engine"})
    print(f"\nFresh {args.tokens}-token prompts at page size 1, {args.requests} per fleet, one at a time, "
          f"max_tokens 1; {args.plane} plane; mock speedup {args.speedup:g}; CPU ms per request; logs {tmp}\n")
    hdr = (f"{'index block':>11} | " + " ".join(f"{r:>12}" for r in roles) + f" | {'Infera':>8} {'vs base':>7}"
           f" | {'engine':>8} | {'TTFT p50':>8}")
    print(hdr)
    print("-" * len(hdr))
    base = sum(v for r, v in rows[0][1].items() if r != "engine")
    for size, cpu, ttft in rows:
        infera = sum(v for r, v in cpu.items() if r != "engine")
        print(f"{size:>11} | " + " ".join(f"{cpu.get(r, 0.0):>12.2f}" for r in roles)
              + f" | {infera:>8.2f} {infera / base:>6.2f}x | {cpu.get('engine', 0.0):>8.2f} | {ttft:>8.1f}")


if __name__ == "__main__":
    main()
