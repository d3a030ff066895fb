"""A replicated control plane: two kv-indexers, two routers and two frontends over one nats-server.

Starts the `infera up` topology (kv-aware) with ``--workers`` mock workers plus a second
kv-indexer, router and frontend, and sends open-loop chat requests (``--rate`` per second,
alternating between the frontends; two thirds of them open with one of six ~520-token system
prompts, so kv-aware has prefixes to find; a third of the answers are 100-300 tokens long, so
the workers holding those prefixes are also decoding other requests). Three scenarios, each
against its baseline in the same run:

- ``routers``: the same traffic with one router, then with two. Per fleet: the requests whose
  system prompt the engine did not find cached (a prefix miss; the first request of each prompt
  must miss), the token hit ratio, latency.
- ``router-freeze``: two routers; one is stopped (SIGSTOP) for ``--freeze`` seconds, then resumed.
  Per window (before, frozen, after): requests answered, failed, prefix misses, latency; and the
  answers the engines produced against the answers clients got (work for nobody).
- ``indexer-freeze``: the same with one of the two kv-indexers stopped instead.

    .venv/bin/python bench/ha.py [--scenario routers router-freeze indexer-freeze] [--workers 4]
                                 [--rate 12] [--seconds 60] [--freeze 20]

Both scenarios come from the HA audit of session 28 (docs/benchmarks.md, "Replicated control plane").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from benchfleet import spawn, start_fleet, stop_fleet
from infera.fleet_plan import plan_fleet
from infera.procs import free_port, wait_port
from infera_common.models import BUNDLED_MODEL_NAME

SYSTEM_PROMPTS = [" ".join(f"rule{p}-{i}" for i in range(170)) for p in range(6)]  # ~520 tokens each
HIT_TOKENS = 448  # a prefix found cached covers at least 7 of its 8 full blocks of 64


def replicate(procs: list, tmp: Path) -> tuple[list, str]:
    """A second kv-indexer, router and frontend on the fleet's nats-server: (processes, frontend URL)."""
    argv = procs[1].args  # the kv-indexer's command line names the NATS URL
    nats_url = argv[argv.index("--nats-url") + 1]
    port = free_port()
    plan = plan_fleet(nats_url=nats_url, host="127.0.0.1", port=port, workers=1, router_policy="kv-aware",
                      engine_args=[], metrics_ports=[free_port() for _ in range(3)])
    extra = [spawn(spec.argv(sys.executable), tmp / f"{spec.name}-2.log")
             for spec in plan if spec.role in ("kv-indexer", "router", "frontend")]
    wait_port("127.0.0.1", port, 30)
    return extra, f"http://127.0.0.1:{port}"


async def one(session: aiohttp.ClientSession, url: str, rng: random.Random, out: list) -> None:
    prefix = rng.randrange(len(SYSTEM_PROMPTS)) if rng.random() < 2 / 3 else None
    messages = [{"role": "user", "content": f"question {rng.random():.12f}"}]
    if prefix is not None:
        messages.insert(0, {"role": "system", "content": SYSTEM_PROMPTS[prefix]})
    out_tokens = rng.randint(8, 40) if rng.random() < 2 / 3 else rng.randint(100, 300)  # some long answers
    body = {"model": BUNDLED_MODEL_NAME, "messages": messages, "max_tokens": out_tokens}
    t0 = time.monotonic()
    rec = {"t": t0, "prefix": prefix, "status": 0, "cached": 0, "prompt": 0}
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            rec["status"] = r.status
            if r.status == 200:
                usage = (await r.json())["usage"]
                rec["prompt"] = usage["prompt_tokens"]
                rec["cached"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except aiohttp.ClientError:
        pass
    rec["latency"] = time.monotonic() - t0
    out.append(rec)


async def traffic(urls: list[str], rate: float, seconds: float, seed: int, during=None) -> list[dict]:
    rng, out, tasks = random.Random(seed), [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        side = asyncio.ensure_future(during()) if during else None
        start = time.monotonic()
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            tasks.append(asyncio.ensure_future(one(session, urls[i % len(urls)], rng, out)))
        await asyncio.gather(*tasks)
        if side is not None:
            await side
    return out


def stats(recs: list[dict]) -> dict:
    ok = [r for r in recs if r["status"] == 200]
    lat = sorted(r["latency"] for r in ok)
    prefixed = [r for r in ok if r["prefix"] is not None]
    return {"n": len(recs), "ok": len(ok), "failed": len(recs) - len(ok),
            "p50": statistics.median(lat) * 1000 if lat else 0.0,
            "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000 if lat else 0.0,
            "misses": sum(1 for r in prefixed if r["cached"] < HIT_TOKENS),
            "hit": sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok))}


def engine_answers(agent_ports: list[int]) -> int:
    """Requests the worker-agents finished ``ok`` (their engines answered them)."""
    total = 0
    for port in agent_ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        found = re.findall(r'^infera_agent_requests_total\{outcome="ok"\} (\S+)', text, re.M)
        total += sum(int(float(v)) for v in found)
    return total


def fleet(tmp: Path, workers: int, routers: int):
    ports = [free_port() for _ in range(workers + 2)]
    procs, url, _ = start_fleet(tmp, workers=workers, policy="kv-aware", engine_args=[], metrics_ports=ports)
    urls = [url]
    if routers == 2:
        extra, url2 = replicate(procs, tmp)
        procs += extra
        urls.append(url2)
        time.sleep(2)  # the second router and indexer subscribe, and have read the fleet
    return procs, urls, ports[2:]


def scenario_routers(args) -> None:
    rows = []
    for routers in (1, 2):
        with tempfile.TemporaryDirectory(prefix=f"bench-ha-{routers}r-") as tmp:
            procs, urls, _ = fleet(Path(tmp), args.workers, routers)
            if routers == 1:
                urls = urls * 2  # the same two streams of requests, both through the one frontend
            try:
                rows.append((routers, stats(asyncio.run(traffic(urls, args.rate, args.seconds, seed=7)))))
            finally:
                stop_fleet(procs)
    print(f"\nscenario routers: {args.workers} mock workers, {args.rate:g} req/s for {args.seconds:g} s, "
          f"6 system prompts (at least {len(SYSTEM_PROMPTS)} prefix misses are unavoidable)\n")
    print("routers | answered | prefix misses | token hit ratio | p50 ms | p99 ms")
    print("---|---|---|---|---|---")
    for routers, s in rows:
        print(f"{routers} | {s['ok']}/{s['n']} | {s['misses']} | {s['hit']:.3f} | {s['p50']:.0f} | {s['p99']:.0f}")
    base, two = rows[0][1], rows[1][1]
    print(f"\ntwo routers against one: prefix misses {two['misses']} vs {base['misses']} "
          f"({two['misses'] / max(1, base['misses']):.2f}x), hit ratio {two['hit'] / max(1e-9, base['hit']):.3f}x")


#: The service a freeze scenario stops, and its place among the processes replicate() adds (kv-indexer,
#: router, frontend): the second of its kind.
FROZEN = {"router-freeze": ("infera_router", -2), "indexer-freeze": ("infera_kv_indexer", -3)}


def scenario_freeze(args, scenario: str) -> None:
    module, index = FROZEN[scenario]
    with tempfile.TemporaryDirectory(prefix=f"bench-ha-{scenario}-") as tmp:
        procs, urls, agent_ports = fleet(Path(tmp), args.workers, 2)
        frozen = procs[index]
        assert module in frozen.args
        marks: dict[str, float] = {}

        async def freeze() -> None:
            await asyncio.sleep(args.seconds)
            marks["stop"] = time.monotonic()
            os.kill(frozen.pid, signal.SIGSTOP)
            await asyncio.sleep(args.freeze)
            os.kill(frozen.pid, signal.SIGCONT)
            marks["cont"] = time.monotonic()

        try:
            recs = asyncio.run(traffic(urls, args.rate, 2 * args.seconds + args.freeze, seed=11, during=freeze))
            time.sleep(5)  # whatever the woken router still places, the engines answer meanwhile
            answered = engine_answers(agent_ports)
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
            stop_fleet(procs)
    windows = [("before", [r for r in recs if r["t"] < marks["stop"]]),
               ("frozen", [r for r in recs if marks["stop"] <= r["t"] < marks["cont"]]),
               ("after", [r for r in recs if r["t"] >= marks["cont"]])]
    what = module.removeprefix("infera_").replace("_", "-")
    print(f"\nscenario {scenario}: {args.workers} mock workers, 2 routers and 2 kv-indexers, {args.rate:g} req/s; "
          f"one {what} SIGSTOPped for {args.freeze:g} s\n")
    print("window | sent | answered | failed | prefix misses | token hit ratio | p50 ms | p99 ms")
    print("---|---|---|---|---|---|---|---")
    for name, w in windows:
        s = stats(w)
        print(f"{name} | {s['n']} | {s['ok']} | {s['failed']} | {s['misses']} | {s['hit']:.3f} | {s['p50']:.0f} | "
              f"{s['p99']:.0f}")
    steady, during = stats(windows[0][1]), stats(windows[1][1])
    clients = sum(1 for r in recs if r["status"] == 200)
    print(f"\nfrozen window against before: p99 {during['p99'] / max(1e-9, steady['p99']):.1f}x, "
          f"failed {during['failed']}/{during['n']}; engines answered {answered} requests, clients got {clients} "
          f"({answered - clients} for nobody)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", nargs="+", default=["routers", "router-freeze", "indexer-freeze"],
                    choices=["routers", *FROZEN])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate", type=float, default=12.0, help="requests per second")
    ap.add_argument("--seconds", type=float, default=60.0, help="length of the routers run; of each window around "
                    "the freeze")
    ap.add_argument("--freeze", type=float, default=20.0, help="seconds the router (or kv-indexer) stays stopped")
    args = ap.parse_args()
    if "routers" in args.scenario:
        scenario_routers(args)
    for scenario in FROZEN:
        if scenario in args.scenario:
            scenario_freeze(args, scenario)


if __name__ == "__main__":
    main()
