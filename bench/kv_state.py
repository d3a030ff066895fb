"""What ``GET /kv_state`` costs on the ZMQ plane: a worker-agent dumping every rank's translator, and
an index (``infera.server``) loading it, on their event loops, while each of them stalls.

An index that starts following a worker (its own restart, or the worker back in discovery after a
blip) reads that state before the engine's replay. A translator holds one entry per engine page:
with SGLang's default page of one token (folded into index blocks of 16) that is one per cached
token, and an engine's KV pool holds millions. Built here in process (no fleet): one translator per
case, fed runs of 4,096-token sequences, then for each dump format the agent's side (dump, msgpack)
and the index's (unpack, load, ``KvIndex.restore_target``), best of ``--repeat``. The baseline is
the format before session 25 (every map as a msgpack list of pairs, the folded pages' block counts
recomputed page by page at load), measured in the same run.

    .venv/bin/python bench/kv_state.py [--tokens 1048576] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import msgpack

from infera_common.kv_index.index import KvIndex
from infera_common.kv_translate import BlockTranslator, dump_translator, load_translator
from infera_common.kv_wire import BlockStored

SEQUENCE = 4096  # tokens per stored sequence
INDEX_SIZE = 16


def build(tokens: int, page: int) -> BlockTranslator:
    """A translator after ``tokens`` tokens of pages of ``page`` tokens were stored, in sequences."""
    translator = BlockTranslator(INDEX_SIZE)
    engine_hash = 1
    for s in range(tokens // SEQUENCE):
        parent, events = None, []
        for i in range(0, SEQUENCE, page):
            ids = [(s * 7919 + i + j) % 30000 + 1 for j in range(page)]
            events.append(BlockStored(block_hashes=[engine_hash], parent_block_hash=parent, token_ids=ids,
                                      block_size=page))
            parent, engine_hash = engine_hash, engine_hash + 1
        translator.apply(events)
    return translator


def legacy_dump(translator: BlockTranslator) -> dict:
    """The dump as it was before session 25: lists of pairs, no block counts."""
    return {
        "index_size": translator.index_size,
        "sizes": {size: [[e, i] for e, i in b.engine.items()] for size, b in translator._sizes.items()},
        "coarse": [{"page_size": c.page_size, "index_size": c.index_size, "next": c._next,
                    "pages": [[h, key] for h, key in c.pages.items()],
                    "runs": [[rid, r.parent, r.data, r.lead, r.blocks, r.live] for rid, r in c._runs.items()]}
                   for c in translator._coarse.values()],
    }


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def measure(translator: BlockTranslator, dump: Callable[[BlockTranslator], dict], repeat: int) -> dict:
    t_dump, state = timed(lambda: dump(translator), repeat)
    t_pack, raw = timed(lambda: msgpack.packb([{"dp_rank": 0, "seq": 9, "translator": state}], use_bin_type=True),
                        repeat)
    t_unpack, states = timed(lambda: msgpack.unpackb(raw, strict_map_key=False), repeat)
    t_load, loaded = timed(lambda: load_translator(states[0]["translator"]), repeat)

    def restore() -> int:
        index = KvIndex()
        index.worker_joined("w", "m", INDEX_SIZE, started_at=1.0)
        index.restore_target("w", 0, 9, loaded, 1.0)
        return index.worker_blocks("w")

    t_restore, blocks = timed(restore, repeat)
    assert blocks == len(next(iter(translator.held().values())))
    return {"agent": t_dump + t_pack, "mb": len(raw) / 1e6, "unpack": t_unpack, "load": t_load,
            "restore": t_restore, "index": t_unpack + t_load + t_restore, "blocks": blocks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1 << 20, help="cached tokens per rank (default 1,048,576)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"{args.tokens:,} cached tokens in one rank, index blocks of {INDEX_SIZE}; best of {args.repeat}; seconds\n")
    print("| engine pages | format | agent: dump + pack | MB | index: unpack | load | restore | index total | "
          "index blocks |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for page, name in ((1, "SGLang, 1 token (folded)"), (16, "vLLM, 16 tokens")):
        translator = build(args.tokens, page)
        rows = {fmt: measure(translator, dump, args.repeat)
                for fmt, dump in (("pairs (before)", legacy_dump), ("columns", dump_translator))}
        for fmt, r in rows.items():
            print(f"| {name} | {fmt} | {r['agent']:.3f} | {r['mb']:.1f} | {r['unpack']:.3f} | {r['load']:.3f} | "
                  f"{r['restore']:.3f} | {r['index']:.3f} | {r['blocks']:,} |")
        old, new = rows["pairs (before)"], rows["columns"]
        ratios.append((name, old["agent"] / new["agent"], old["index"] / new["index"]))
    print()
    for name, agent, index in ratios:
        print(f"{name}: columns are {agent:.1f}x faster for the agent, {index:.1f}x for the index")


if __name__ == "__main__":
    main()
