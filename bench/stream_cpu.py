"""CPU per streamed token: what each process on the path spends to relay one token to a client.

Every row drives the same load — ``--clients`` concurrent clients, each streaming ``--requests``
answers of ``--max-tokens`` tokens in all from short text prompts through ``POST /v1/completions``
— at ``--workers`` mock engines, and reads each process's CPU time from /proc over the measured
requests (after a warm-up), so the machine's noise barely moves the figures. Rows:

- ``direct``: the clients call the engines themselves (round-robin): the baseline, what the engines
  alone spend per token;
- ``nats``: the ``infera up`` topology (nats-server, kv-indexer, router, frontend, one worker-agent
  per engine), router policy round-robin;
- ``no-broker``: etcd, ``infera.server`` and the worker-agents on ``--request-transport http``;
- ``sglang-router``: the public sglang-router (``--policy round_robin``) in front of the engines.

Printed per row: µs of CPU per streamed token for each process role, the path's total beyond the
engines, and that total as a ratio of the engines' own cost in the ``direct`` row of the same run.

    .venv/bin/python bench/stream_cpu.py [--rows direct nats no-broker sglang-router] [--clients 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
from pathlib import Path

import aiohttp
import uvloop

from benchfleet import sglang_router_installed, start_engines, start_fleet, start_sglang_router, stop_fleet
from infera_common.models import BUNDLED_MODEL_NAME
from small_pages import fleet_cpu
from trace_replay import has_usage, sse_payloads

ROWS = ("direct", "nats", "no-broker", "sglang-router")


async def one_stream(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> int:
    """One streamed completion; returns the tokens the usage chunk reports."""
    body = {"model": BUNDLED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    usage = None
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:200]}")
        async for payload in sse_payloads(resp):
            if has_usage(payload):
                usage = json.loads(payload)["usage"]
    if not usage:
        raise RuntimeError(f"{url}: no usage in the stream")
    return usage["completion_tokens"]


async def drive(urls: list[str], prompts: list[str], clients: int, max_tokens: int) -> int:
    """Stream every prompt's answer, ``clients`` at a time, spread round-robin over ``urls``;
    returns the tokens streamed."""
    todo = iter(enumerate(prompts))
    tokens = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal tokens
        for i, prompt in todo:
            streamed = await one_stream(session, urls[i % len(urls)], prompt, max_tokens)
            tokens += streamed  # (not `tokens += await ...`: that reads `tokens` before the wait)

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return tokens


def start_row(row: str, tmp: Path, workers: int, engine_args: list[str]) -> tuple[list, list[str]]:
    """The row's processes and the URLs its clients call."""
    if row in ("nats", "no-broker"):
        procs, url, _ = start_fleet(tmp, workers=workers, policy="round-robin", engine_args=engine_args, plane=row)
        return procs, [url]
    procs, engines = start_engines(tmp, workers=workers, engine_args=engine_args)
    if row == "direct":
        return procs, engines
    try:
        router, url = start_sglang_router(tmp, engines, policy="round_robin")
    except BaseException:
        stop_fleet(procs)
        raise
    return [*procs, router], [url]


def measure_row(row: str, args, warm: list[str], prompts: list[str], tmp: Path) -> dict[str, float]:
    """µs of CPU per streamed token, by process role."""
    where = tmp / row
    where.mkdir()
    procs, urls = start_row(row, where, args.workers, ["--speedup", str(args.speedup)])
    try:
        uvloop.run(drive(urls, warm, args.clients, args.max_tokens))
        roots = [p.pid for p in procs]
        before = fleet_cpu(roots)
        tokens = uvloop.run(drive(urls, prompts, args.clients, args.max_tokens))
        after = fleet_cpu(roots)
    finally:
        stop_fleet(procs)
    return {role: 1e6 * (after[role] - before.get(role, 0.0)) / tokens for role in after}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), help="in this order; 'direct' is the baseline")
    ap.add_argument("--workers", type=int, default=2, help="mock engines (and worker-agents)")
    ap.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    ap.add_argument("--requests", type=int, default=96, help="measured requests per row (after --clients to warm up)")
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens per answer")
    ap.add_argument("--speedup", type=float, default=4.0, help="mock engine --speedup")
    args = ap.parse_args()
    rows = [r for r in args.rows if r != "sglang-router" or sglang_router_installed()]
    if len(rows) < len(args.rows):
        print("sglang-router is not installed (the bench extra: make bench): its row is left out")
    rng = random.Random(11)
    words = ["sea", "stone", "river", "cloud", "field", "light", "road", "tree", "bird", "wind"]
    prompt = lambda: " ".join(rng.choice(words) for _ in range(12))  # noqa: E731 (below one KV block)
    warm = [prompt() for _ in range(args.clients)]
    prompts = [prompt() for _ in range(args.requests)]
    tmp = Path(tempfile.mkdtemp(prefix="infera-stream-cpu-"))
    results = {row: measure_row(row, args, warm, prompts, tmp) for row in rows}

    roles = sorted({r for cpu in results.values() for r in cpu if r != "engine"})
    base = results.get("direct", {}).get("engine")
    print(f"\n{args.requests} streamed answers of {args.max_tokens} tokens per row, {args.clients} clients, "
          f"{args.workers} mock engines at speedup {args.speedup:g}; CPU µs per streamed token; logs {tmp}\n")
    hdr = (f"{'row':<14} | {'engines':>8} | " + " ".join(f"{r:>13}" for r in roles)
           + f" | {'path total':>10} | {'vs engines (direct)':>19}")
    print(hdr)
    print("-" * len(hdr))
    for row, cpu in results.items():
        path = sum(v for r, v in cpu.items() if r != "engine")
        ratio = f"{'(baseline)':>19}" if row == "direct" else f"{path / base:>18.2f}x" if base else f"{'-':>19}"
        print(f"{row:<14} | {cpu.get('engine', 0.0):>8.1f} | " + " ".join(f"{cpu.get(r, 0.0):>13.1f}" for r in roles)
              + f" | {path:>10.1f} | {ratio}")


if __name__ == "__main__":
    main()
