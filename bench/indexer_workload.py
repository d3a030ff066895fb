"""The kv-indexer bench's workload (``bench/indexer.py``): engine batches as the mock engine's vLLM
flavour publishes them, for workers that serve conversations under a few shared system prompts,
plus a few "query" conversations held partially by several workers, whose overlap answers are known.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import msgpack

from infera_common.schemas import KvRelay, OverlapReply, encode
from infera_common.subjects import kv_event_subject

MODEL = "bench-model"
BLOCK = 64
VOCAB = 128256  # Llama-3 sized vocabulary: token ids take msgpack's 5-byte form, as in production
SYSTEM_PROMPTS = 32
SYSTEM_BLOCKS = 16  # 1,024-token system prompts
QUERY_BLOCKS = 128  # 8,192-token prompt
CONV_MAX = QUERY_BLOCKS - SYSTEM_BLOCKS
PLANTED = 16  # query conversations, each held partially by several workers
PREFILL_CHUNK = 32  # blocks per prefill chunk (2,048 tokens): one BlockStored each
MASK64 = (1 << 64) - 1


# --- workload --------------------------------------------------------------------------------
def engine_hash(kind: int, conv: int, j: int) -> int:
    """A content-derived 64-bit engine hash (same block, same hash on every worker, like vLLM's)."""
    return (((kind << 56) ^ (conv << 24) ^ j) * 0x9E3779B97F4A7C15) & MASK64


class Tokens:
    """Deterministic, cheap token ids: a pool of random blocks, made unique per (conversation, block)."""

    def __init__(self, rng: random.Random) -> None:
        self.pool = [[rng.randrange(1000, VOCAB) for _ in range(BLOCK)] for _ in range(1024)]

    def block(self, conv: int, j: int) -> list[int]:
        t = self.pool[(conv * 131 + j * 7) % len(self.pool)][:]
        t[0], t[1], t[2] = conv % VOCAB, conv // VOCAB, j
        return t

    def system(self, sp: int, j: int) -> list[int]:
        return self.block(10_000_000 + sp, j)


@dataclass
class Planted:
    conv: int
    sp: int
    holders: dict[str, int]  # worker -> conversation blocks held (system prompt excluded)


@dataclass
class WorkerLoad:
    relays: list[tuple[str, bytes]]  # (subject, KvRelay bytes)
    blocks: int = 0
    events: int = 0
    stats: dict[str, int] = field(default_factory=dict)


def sp_weights() -> list[float]:
    return [1.0 / (i + 1) for i in range(SYSTEM_PROMPTS)]


def plant(rng: random.Random, workers: list[str]) -> list[Planted]:
    out = []
    for k in range(PLANTED):
        holders = rng.sample(workers, rng.randint(3, min(10, len(workers))))
        out.append(Planted(conv=k, sp=k % 4, holders={w: rng.randint(4, CONV_MAX - 4) for w in holders}))
    return out


def worker_load(w: int, wid: str, target: int, planted: list[Planted], tokens: Tokens, seed: int) -> WorkerLoad:
    """One worker's engine batches, in the order its engine would publish them."""
    rng = random.Random(seed * 1_000_003 + w)
    events: list[dict] = []
    held_sp: set[int] = set()
    count = 0

    def stored(hashes: list[int], parent: int | None, toks: list[int]) -> None:
        events.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                       "token_ids": toks, "block_size": BLOCK, "lora_id": None, "medium": "GPU",
                       "lora_name": None})

    def system_prompt(sp: int) -> int:
        nonlocal count
        if sp not in held_sp:
            held_sp.add(sp)
            toks: list[int] = []
            for j in range(SYSTEM_BLOCKS):
                toks.extend(tokens.system(sp, j))
            stored([engine_hash(1, sp, j) for j in range(SYSTEM_BLOCKS)], None, toks)
            count += SYSTEM_BLOCKS
        return engine_hash(1, sp, SYSTEM_BLOCKS - 1)

    def conversation(conv: int, sp: int, depth: int) -> None:
        nonlocal count
        parent = system_prompt(sp)
        pos = 0
        while pos < depth:  # one turn: prefill the user's message in chunks, then decode the reply
            user = min(rng.randint(2, 16), depth - pos)
            while user:
                n = min(user, PREFILL_CHUNK)
                toks: list[int] = []
                for j in range(pos, pos + n):
                    toks.extend(tokens.block(conv, j))
                hashes = [engine_hash(2, conv, j) for j in range(pos, pos + n)]
                stored(hashes, parent, toks)
                parent, pos, user, count = hashes[-1], pos + n, user - n, count + n
            for _ in range(min(rng.randint(1, 8), depth - pos)):
                h = engine_hash(2, conv, pos)
                stored([h], parent, tokens.block(conv, pos))
                parent, pos, count = h, pos + 1, count + 1

    for p in planted:
        if wid in p.holders:
            conversation(p.conv, p.sp, p.holders[wid])
    for sp in range(4):  # the popular system prompts: on every worker (the queries' prefixes)
        system_prompt(sp)
    weights = sp_weights()
    k = 0
    while count < target:
        conv = 1000 + w * 100_000 + k
        k += 1
        conversation(conv, rng.choices(range(SYSTEM_PROMPTS), weights)[0], rng.randint(8, CONV_MAX))

    subject = kv_event_subject(wid)
    relays = []
    i = seq = 0
    while i < len(events):  # a scheduler step publishes the events of several sequences at once
        n = rng.randint(1, 6)
        payload = msgpack.packb({"ts": time.time(), "events": events[i:i + n], "data_parallel_rank": 0})
        relay = KvRelay(worker_id=wid, kind="batch", dp_rank=0, seq=seq, payload=payload, block_size=BLOCK)
        relays.append((subject, encode(relay)))
        i, seq = i + n, seq + 1
    return WorkerLoad(relays, count, len(events))


def query_tokens(p: Planted, tokens: Tokens) -> list[int]:
    out: list[int] = []
    for j in range(SYSTEM_BLOCKS):
        out.extend(tokens.system(p.sp, j))
    for j in range(CONV_MAX):
        out.extend(tokens.block(p.conv, j))
    return out


def expected_reply(p: Planted, workers: list[str]) -> dict[str, int]:
    return {w: SYSTEM_BLOCKS + p.holders.get(w, 0) for w in workers}


def check(reply: OverlapReply, want: dict[str, int]) -> None:
    got = {o.worker_id: o.blocks for o in reply.overlaps}
    if got != want:
        bad = {w: (got.get(w), d) for w, d in want.items() if got.get(w) != d}
        raise RuntimeError(f"wrong overlap reply (worker: got, want): {dict(list(bad.items())[:5])}")
