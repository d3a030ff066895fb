"""kv-indexer: event ingest in blocks/s and overlap-query latency for an 8k-token prompt.

Builds a realistic index in process: --workers workers holding --blocks blocks in all (default
64 x ~16k = 1M), at block size 64. Every worker serves many conversations, each starting with one of
a few shared system prompts (Zipf popularity) followed by its own turns; a few "query"
conversations were served by several workers (the router moved them), each holding a different
prefix of it. Events are encoded as the mock engine's vLLM flavour puts them on the wire (msgpack
map batch, events tagged "type", one BlockStored per prefill chunk or per decoded block, a few
events per batch) and wrapped in the worker-agent's ``KvRelay``.

Measured in the same run, each figure against a baseline:

- ingest, as on the NATS plane: ``ingest()`` of the relays the worker-agent sends (``kind="blocks"``:
  each engine batch already translated to the index hashes stored and removed) in blocks/s, against
  ingest of the same engine batches relayed raw (``kind="batch"``: the indexer decodes the tokens,
  hashes and translates them itself, as it does for batches it reads from ZMQ).
- raw ingest against the floor of what it must do anyway: msgpack-decoding the same relays and
  batches and hashing every block's tokens with ``block_hash.block_hashes``.
- the worker-agent's translation (batch decode, hash, translate, relay encode) in blocks/s: work
  each agent does for its own engine only, on its own host.
- replay from JetStream (unless --no-nats): the relays of the first --replay-workers workers stored
  in a real nats-server's stream, then a kv-indexer service started on it, timed from ``start()``
  until it serves (its stream replay: the NATS client, the service's handler and its metrics); the
  agent's relays against the same engine batches relayed raw; the median of three rounds each.
- query, in process: the service's query handler work (``query.answer``: query bytes in, reply
  bytes out, each worker's holding reused as the service does) against the msgpack codec alone
  (unpack the same query, pack the same reply), and the same with the holdings listed afresh for
  every query (a service asked less than four times a second) against the reused ones; the
  ``PrefixIndex`` bitmask walk against a brute-force walk of per-worker hash sets; and
  ``KvIndex.depths`` (walk plus the reply's sorted worker list) against the walk.
- query over NATS (unless --no-nats): a real nats-server, the kv-indexer service in process
  serving the index built above on the event loop it runs on in production (uvloop when
  installed), ``nc.request`` on ``infera.kv.query``; against an echo responder on the same
  server and loop replying a message of the same size (the bus's own round trip).

The query is a 128-block (8,192-token) prompt: a system prompt every worker holds plus a
conversation several workers hold partially; every reply is checked against the planted depths.

    .venv/bin/python bench/indexer.py [--blocks 1000000] [--workers 64] [--queries 2000] [--replay-workers 16]
                                      [--no-nats]
"""

from __future__ import annotations

import argparse
import gc
import random
import resource
import statistics
import sys
import time

import msgpack

from indexer_workload import (
    BLOCK, MODEL, PLANTED, QUERY_BLOCKS, SYSTEM_BLOCKS, Tokens, check, expected_reply, plant, query_tokens, worker_load,
)
from infera_common.block_hash import ROOT, block_hashes
from infera_common.kv_translate import BlockTranslator, delta_relay
from infera_common.kv_wire import decode_batch
from infera_common.schemas import OverlapQuery, encode, encode_sparse

from infera_common.kv_index.index import KvIndex
from infera_common.kv_index.ingest import ingest
from infera_kv_indexer.query import answer, held_sections

REPLAY_ROUNDS = 3


# --- ingest ------------------------------------------------------------------------------------
def floor_decode(relays: list[tuple[str, bytes]]) -> None:
    unpack = msgpack.unpackb
    for _subject, data in relays:
        relay = unpack(data, raw=False, strict_map_key=False)
        unpack(relay["payload"], raw=False, strict_map_key=False)


def floor_decode_hash(relays: list[tuple[str, bytes]]) -> None:
    unpack = msgpack.unpackb
    for _subject, data in relays:
        relay = unpack(data, raw=False, strict_map_key=False)
        batch = unpack(relay["payload"], raw=False, strict_map_key=False)
        for ev in batch["events"]:
            block_hashes(ev["token_ids"], ev["block_size"], ROOT)


def translate(relays: list[tuple[str, bytes]], out: list[tuple[str, bytes]]) -> None:
    """What the worker-agent does with each engine batch before publishing it."""
    translators: dict[int, BlockTranslator] = {}
    unpack = msgpack.unpackb
    for subject, data in relays:
        raw = unpack(data, raw=False)  # stands in for the agent's ZMQ read: the batch bytes, seq and rank
        batch = decode_batch(raw["payload"])
        rank = batch.dp_rank if batch.dp_rank is not None else raw["dp_rank"]
        translator = translators.get(rank)
        if translator is None:
            translator = translators[rank] = BlockTranslator()
        delta = translator.apply(batch.events)
        if delta.orphaned or delta.malformed:
            raise RuntimeError(f"bench batch not translated cleanly on {subject}")
        relay = delta_relay(raw["worker_id"], rank, raw["seq"], delta, raw["block_size"])
        out.append((subject, encode_sparse(relay)))  # as the agent publishes it


def run_ingest(index: KvIndex, relays: list[tuple[str, bytes]]) -> None:
    now = time.time()
    for subject, data in relays:
        result = ingest(index, subject, data, now)
        if result.malformed or result.outcome is None or result.outcome.orphaned or result.outcome.malformed:
            out = result.outcome
            raise RuntimeError(f"bench batch not applied cleanly on {subject}: malformed={result.malformed} "
                               f"{result.error} outcome={out and (out.malformed, out.orphaned)}")


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


# --- queries ---------------------------------------------------------------------------------
def brute_force(sets: dict[str, set[int]], chain: list[int]) -> dict[str, int]:
    out = {}
    for w, held in sets.items():
        d = 0
        for h in chain:
            if h not in held:
                break
            d += 1
        if d:
            out[w] = d
    return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# --- report ----------------------------------------------------------------------------------
def fmt_rate(x: float) -> str:
    return f"{x / 1000:,.0f}k blocks/s"


def fmt_us(x: float) -> str:
    return f"{x * 1e6:,.1f} µs"


def table(rows: list[tuple[str, str, str, str, str, str]]) -> str:
    head = ("metric", "value", "baseline", "ratio", "aim", "met?")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(6)]
    line = lambda r: "| " + " | ".join(c.ljust(widths[i]) for i, c in enumerate(r)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep, *(line(r) for r in rows)])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1_000_000, help="blocks indexed in all (summed over workers)")
    ap.add_argument("--workers", type=int, default=64, help="workers (one dp rank each)")
    ap.add_argument("--queries", type=int, default=2000, help="timed queries per measurement")
    ap.add_argument("--replay-workers", type=int, default=16,
                    help="workers whose relays the JetStream replay rows store and replay (0: skip those rows)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-nats", action="store_true", help="skip the query latency over a real nats-server")
    args = ap.parse_args(argv)

    from infera_common.logs import configure_logging
    configure_logging("warning", "console")

    rng = random.Random(args.seed)
    tokens = Tokens(rng)
    workers = [f"w{i:03d}" for i in range(args.workers)]
    planted = plant(rng, workers)
    per_worker = args.blocks // args.workers

    index, raw_index = KvIndex(), KvIndex()  # fed the agent's relays / the raw engine batches
    for wid in workers:  # discovery first, as at a normal start: blocks attach at once
        index.worker_joined(wid, MODEL)
        raw_index.worker_joined(wid, MODEL)

    times = dict.fromkeys(("gen", "dec", "floor", "raw", "agent", "ing"), 0.0)
    blocks = events = batches = 0
    kept_raw: list[tuple[str, bytes]] = []  # the first --replay-workers workers' relays, for the replay rows
    kept_blocks: list[tuple[str, bytes]] = []
    kept_held = 0
    t_start = time.perf_counter()
    for w, wid in enumerate(workers):  # generate one worker's batches, then time the passes on them
        t0 = time.perf_counter()
        load = worker_load(w, wid, per_worker, planted, tokens, args.seed)
        times["gen"] += time.perf_counter() - t0
        translated: list[tuple[str, bytes]] = []
        times["agent"] += timed(translate, load.relays, translated)
        passes = [("dec", floor_decode, (load.relays,)), ("floor", floor_decode_hash, (load.relays,)),
                  ("raw", run_ingest, (raw_index, load.relays)), ("ing", run_ingest, (index, translated))]
        for name, fn, fargs in passes[w % 4:] + passes[:w % 4]:  # rotate the order: noise hits all alike
            times[name] += timed(fn, *fargs)
        blocks, events, batches = blocks + load.blocks, events + load.events, batches + len(load.relays)
        if w < args.replay_workers:
            kept_raw += load.relays
            kept_blocks += translated
            kept_held += index.worker_blocks(wid)
        del load, translated
    t_build = time.perf_counter() - t_start
    held = sum(index.worker_blocks(w) for w in workers)
    if held != sum(raw_index.worker_blocks(w) for w in workers):
        raise RuntimeError("the translated relays and the raw batches built different indexes")
    distinct = index._models[MODEL].blocks(BLOCK)  # noqa: SLF001 - a bench reports the index's size
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    # queries: precomputed as the router would send them (hashes of the 8k-token prompt)
    chains = [block_hashes(query_tokens(p, tokens), BLOCK) for p in planted]
    assert all(len(c) == QUERY_BLOCKS for c in chains)
    qmsgs = [OverlapQuery(model=MODEL, hashes={BLOCK: c}) for c in chains]
    qbytes = [encode(q) for q in qmsgs]
    wants = [expected_reply(p, workers) for p in planted]
    replies = [index.overlap(q) for q in qmsgs]
    for r, want in zip(replies, wants):
        check(r, want)
    for q, want in zip(qmsgs, wants):
        check(raw_index.overlap(q), want)
    del raw_index
    rbytes = [encode(r) for r in replies]
    for data, rb in zip(qbytes, rbytes):
        assert answer(index, data) == rb  # the handler's bytes are the schema's encoding
    rdicts = [msgpack.unpackb(rb) for rb in rbytes]
    sets = {wid: set(t.held[BLOCK]) for wid, wk in index._workers.items()  # noqa: SLF001
            for t in wk.targets.values()}
    for c, want in zip(chains, wants):
        assert brute_force(sets, c) == want

    prefix = index._models[MODEL]  # noqa: SLF001 - the walk alone, without building the reply
    handler, codec, walk, full, brute, fresh = [], [], [], [], [], []
    holdings = held_sections(index, time.monotonic)
    pc = time.perf_counter
    unpack, pack = msgpack.unpackb, msgpack.packb
    gc.collect()
    for i in range(args.queries + 100):
        k = i % len(qbytes)
        data, q, chain, rdict = qbytes[k], qmsgs[k], chains[k], rdicts[k]
        t0 = pc()
        answer(index, data, holdings)  # the service's handler work: query bytes in, reply bytes out
        t1 = pc()
        unpack(data, raw=False, strict_map_key=False)
        pack(rdict, use_bin_type=True)  # the codec alone
        t2 = pc()
        prefix.overlap(q.hashes)
        t3 = pc()
        brute_force(sets, chain)
        t4 = pc()
        index.depths(q.model, q.hashes, q.workers)
        t5 = pc()
        answer(index, data)  # every worker's holding listed and packed for this query
        t6 = pc()
        if i >= 100:
            handler.append(t1 - t0)
            codec.append(t2 - t1)
            walk.append(t3 - t2)
            brute.append(t4 - t3)
            full.append(t5 - t4)
            fresh.append(t6 - t5)
    del sets

    nats_lat: list[float] = []
    nats_base: list[float] = []
    replay_blocks = replay_raw = 0.0
    if not args.no_nats:
        from infera_common.runtime import event_loop_runner

        from indexer_nats import nats_queries, replay_rate

        with event_loop_runner() as runner:  # the service's own loop (uvloop when installed)
            nats_lat, nats_base = runner.run(nats_queries(index, qbytes, rbytes, wants, args.queries))
            if kept_raw:  # three rounds, the two kinds alternating: the median of each (this machine is noisy)
                rounds = [(runner.run(replay_rate(kept_blocks, kept_held)), runner.run(replay_rate(kept_raw, kept_held)))
                          for _ in range(REPLAY_ROUNDS)]
                replay_blocks = statistics.median(b for b, _ in rounds)
                replay_raw = statistics.median(r for _, r in rounds)

    rate = {name: blocks / t for name, t in times.items() if name != "gen"}
    ms1 = 1e-3
    yes = lambda ok: "yes" if ok else "NO"  # noqa: E731
    rows = [
        ("ingest: ingest() of the agent's relays", fmt_rate(rate["ing"]),
         f"{fmt_rate(rate['raw'])} (raw batches)", f"{rate['ing'] / rate['raw']:.2f}x",
         "≥ 500k blocks/s", yes(rate["ing"] >= 500_000)),
        ("raw ingest: ingest() of engine batches", fmt_rate(rate["raw"]),
         f"{fmt_rate(rate['floor'])} (decode+hash floor)", f"{rate['raw'] / rate['floor']:.2f}x", "", ""),
        ("  floor part: msgpack decode only", fmt_rate(rate["dec"]), "", "", "", ""),
        ("agent translation (per agent, own engine)", fmt_rate(rate["agent"]),
         f"{fmt_rate(rate['floor'])} (decode+hash floor)", f"{rate['agent'] / rate['floor']:.2f}x", "", ""),
    ]
    if replay_blocks:
        a, b = kept_held / replay_blocks, kept_held / replay_raw
        rows.append((f"replay from JetStream ({args.replay_workers} workers)", fmt_rate(a),
                     f"{fmt_rate(b)} (raw batches)", f"{a / b:.2f}x", "≥ 500k blocks/s", yes(a >= 500_000)))
    for label, q in (("p50", 0.50), ("p99", 0.99)):
        h, c = pct(handler, q), pct(codec, q)
        rows.append((f"query {label}: handler (bytes to bytes)", fmt_us(h), f"{fmt_us(c)} (msgpack codec only)",
                     f"{h / c:.2f}x", "≤ 1 ms" if label == "p99" else "", yes(h <= ms1) if label == "p99" else ""))
    for label, q in (("p50", 0.50), ("p99", 0.99)):
        a, b = pct(fresh, q), pct(handler, q)
        rows.append((f"query {label}: handler, holdings listed afresh", fmt_us(a), f"{fmt_us(b)} (reused)",
                     f"{a / b:.2f}x", "≤ 1 ms" if label == "p99" else "", yes(a <= ms1) if label == "p99" else ""))
    for label, q in (("p50", 0.50), ("p99", 0.99)):
        a, b = pct(walk, q), pct(brute, q)
        rows.append((f"query {label}: PrefixIndex walk only", fmt_us(a), f"{fmt_us(b)} (brute force)",
                     f"{a / b:.2f}x", "", ""))
    for label, q in (("p50", 0.50), ("p99", 0.99)):
        a, b = pct(full, q), pct(walk, q)
        rows.append((f"query {label}: KvIndex.depths (walk+reply)", fmt_us(a), f"{fmt_us(b)} (walk only)",
                     f"{a / b:.2f}x", "", ""))
    if nats_lat:
        for label, q in (("p50", 0.50), ("p99", 0.99)):
            a, b = pct(nats_lat, q), pct(nats_base, q)
            rows.append((f"query {label} over NATS: nc.request", fmt_us(a), f"{fmt_us(b)} (echo, same size)",
                         f"{a / b:.2f}x", "≤ 1 ms" if label == "p99" else "",
                         yes(a <= ms1) if label == "p99" else ""))

    holders = statistics.mean(len(p.holders) for p in planted)
    print(f"kv-indexer bench: {args.workers} workers, block size {BLOCK}, {held:,} blocks held "
          f"({distinct:,} distinct hashes), {events:,} events in {batches:,} batches "
          f"({blocks / events:.1f} blocks/event, {events / batches:.1f} events/batch)")
    print(f"query: {QUERY_BLOCKS} blocks ({QUERY_BLOCKS * BLOCK:,} tokens), {PLANTED} prompts, each held "
          f"partially by {holders:.1f} workers on average (and its {SYSTEM_BLOCKS}-block system prompt by all); "
          f"{args.queries} timed queries per row; replies checked")
    print(f"build {t_build:.1f}s (generation {times['gen']:.1f}s), peak RSS {rss_mb:,.0f} MB, python {sys.version.split()[0]}")
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
