"""Overlap queries bytes to bytes, and the relay envelope, without pydantic on the hot path:
the same answers and the same accept/reject decisions as the schemas."""

from __future__ import annotations

import random

import msgpack
import pytest

from infera_common.schemas import KvRelay, OverlapQuery, OverlapReply, decode, encode
from infera_common.kv_index.held import MAX_AGE as HELD_MAX_AGE
from infera_common.kv_index.held import HeldCache
from infera_common.kv_index.index import KvIndex
from infera_common.kv_index.ingest import decode_relay
from infera_common.kv_index.prefix import PrefixIndex
from infera_kv_indexer.query import EMPTY_REPLY, answer, held_sections
from tests.kv_indexer.kv_fakes import MODEL, FakeEngine, query, tokens
from tests.kv_indexer.test_kv_index import feed


@pytest.fixture(scope="module")
def fleet() -> KvIndex:
    """40 workers holding different prefixes of one prompt, plus two that never sent events."""
    index = KvIndex()
    prompt = tokens(160)
    for i in range(40):
        wid = f"w{i:02d}"
        index.worker_joined(wid, MODEL)
        engine = FakeEngine(wid, "vllm" if i % 2 else "sglang", dp_rank=i % 3)
        feed(index, engine, engine.stored(prompt[:4 * (1 + i % 17)]))
    for wid in ("quiet-a", "quiet-b"):
        index.worker_joined(wid, MODEL)
    return index


@pytest.mark.parametrize("q", [
    query(tokens(160)),  # 40 overlaps (a 16-bit array header), two unseen
    query(tokens(160), workers=["w03", "w04", "quiet-b", "nobody"]),
    query(tokens(160), block_sizes=(4, 8)),
    query(tokens(8)),
    query(tokens(160), model="other"),
    OverlapQuery(model=MODEL, hashes={}),
])
def test_the_answer_is_exactly_the_schemas_encoding_of_the_reply(fleet, q):
    assert answer(fleet, encode(q)) == encode(fleet.overlap(q))
    assert answer(fleet, encode(q)) == encode(fleet.overlap(q))  # again, from the packed-target cache
    holdings = held_sections(fleet, lambda: 0.0)
    assert answer(fleet, encode(q), holdings) == answer(fleet, encode(q), holdings) == encode(fleet.overlap(q))


def test_queries_the_schema_coerces_are_answered_as_the_schema_reads_them(fleet):
    q = query(tokens(160))
    exact = answer(fleet, encode(q))
    coerced = {"model": MODEL, "hashes": {str(size): chain for size, chain in q.hashes.items()}}
    assert answer(fleet, msgpack.packb(coerced)) == exact  # block size as a string
    negative = {"model": MODEL, "hashes": {4: [-1, *q.hashes[4]]}}
    assert answer(fleet, msgpack.packb(negative)) == encode(fleet.overlap(OverlapQuery.model_validate(negative)))


@pytest.mark.parametrize("data", [b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"model": MODEL}),
                                  msgpack.packb({"model": MODEL, "hashes": {4: ["x"]}}),
                                  msgpack.packb({"model": 5, "hashes": {}})])
def test_a_malformed_query_raises_value_error(fleet, data):
    with pytest.raises(ValueError):
        answer(fleet, data)
    assert msgpack.unpackb(EMPTY_REPLY) == {"overlaps": [], "unseen": [], "held": []}


def test_the_reply_says_how_many_blocks_each_asked_worker_holds_matched_or_not(fleet):
    """With the record's capacity, how full each candidate's cache is: asked of every candidate,
    including those that hold none of this prompt; a worker without events is unknown, not empty."""
    q = query(tokens(4), workers=["w03", "w04", "w16", "quiet-b"])  # one block: nobody's prefix beyond it
    reply = decode(OverlapReply, answer(fleet, encode(q)))
    # w03 stored 16 tokens (4 blocks of 4) on rank 0, w04 20 on rank 1, w16 68 on rank 1
    assert [(h.worker_id, h.dp_rank, h.blocks) for h in reply.held] == [("w03", 0, 4), ("w04", 1, 5), ("w16", 1, 17)]
    assert reply.unseen == ["quiet-b"]


def test_the_relay_envelope_reads_as_the_schema_does():
    exact = KvRelay(worker_id="w1", dp_rank=2, seq=7, payload=b"p", block_size=16, ts=3.0)
    relay = decode_relay(encode(exact), now=1.0)
    assert (relay.worker_id, relay.kind, relay.dp_rank, relay.seq, relay.payload, relay.block_size, relay.ts) == \
        ("w1", "batch", 2, 7, b"p", 16, 3.0)
    lenient = decode_relay(msgpack.packb({"worker_id": "w1", "seq": "7", "dp_rank": 2.0, "ts": 3}), now=1.0)
    assert (lenient.seq, lenient.dp_rank, lenient.ts, lenient.payload) == (7, 2, 3.0, b"")
    for bad in ({"seq": 1}, {"worker_id": "w1", "kind": "other"}, {"worker_id": "w1", "seq": "x"}, [1],
                {"worker_id": "w1", "kind": "blocks", "stored": {4: [1, 2]}},
                {"worker_id": "w1", "kind": "blocks", "removed": [b"x"]},
                {"worker_id": "w1", "kind": "blocks", "seq": 3, "first_seq": 4}):
        with pytest.raises(ValueError):
            decode_relay(msgpack.packb(bad), now=1.0)


def test_a_blocks_relay_reads_as_the_schema_does():
    exact = KvRelay(worker_id="w1", kind="blocks", dp_rank=1, seq=3, first_seq=2, reset=True,
                    stored={16: b"\x01" * 8}, removed={8: b""}, ts=2.0)
    relay = decode_relay(encode(exact), now=1.0)  # the packed hashes come unpacked
    assert (relay.kind, relay.dp_rank, relay.seq, relay.first_seq, relay.reset) == ("blocks", 1, 3, 2, True)
    assert {k: list(v) for k, v in relay.stored.items()} == {16: [0x0101010101010101]}
    assert {k: list(v) for k, v in relay.removed.items()} == {8: []}
    lenient = decode_relay(msgpack.packb({"worker_id": "w1", "kind": "blocks", "reset": 1, "stored": {"16": b""},
                                          "seq": 2, "first_seq": "1"}), now=5.0)
    assert lenient.ts == 5.0  # no ts: relayed when it arrived
    assert (lenient.reset, {k: list(v) for k, v in lenient.stored.items()}, lenient.removed, lenient.first_seq) == \
        (True, {16: []}, {}, 1)
    with pytest.raises(ValueError, match="8-byte"):
        decode_relay(encode(KvRelay(worker_id="w1", kind="blocks", stored={16: b"\x01" * 7})), now=1.0)


def test_the_walk_equals_a_brute_force_walk_with_holes_filters_and_two_block_sizes():
    rng = random.Random(3)
    prefix = PrefixIndex()
    chains = {4: [rng.getrandbits(64) for _ in range(60)], 8: [rng.getrandbits(64) for _ in range(30)]}
    held: dict[tuple[str, int], dict[int, set[int]]] = {}
    for i in range(300):  # more targets than a machine word: masks of many bytes
        target = (f"w{i % 150}", i // 150)
        bit = prefix.add_target(target)
        held[target] = {}
        for size, chain in chains.items():
            n = rng.choice([0, 1, 2, rng.randrange(len(chain) + 1), len(chain)])
            held[target][size] = keep = {h for h in chain[:n] if rng.random() > 0.1}  # holes cut the prefix
            for h in keep:
                prefix.add(size, h, bit)

    def brute(sizes, workers=None) -> dict:
        out = {}
        for target, holds in held.items():
            if workers is None or target[0] in workers:
                depth = max(_depth(chains[size], holds[size]) for size in sizes)
                if depth:
                    out[target] = depth
        return out

    assert prefix.overlap(chains) == brute((4, 8))
    assert prefix.overlap({4: chains[4]}) == brute((4,))
    only = {"w3", "w77", "w149"}
    assert prefix.overlap(chains, only) == brute((4, 8), only)
    depths = prefix.overlap(chains)
    assert prefix.ordered(depths) == [(w, r, d) for (w, r), d in sorted(depths.items())]
    few = dict(list(depths.items())[:3])
    assert prefix.ordered(few) == [(w, r, d) for (w, r), d in sorted(few.items())]


def test_a_filter_whose_workers_all_hold_the_first_block():
    prefix = PrefixIndex()
    chain = [11, 12, 13, 14]
    a, b, c = (prefix.add_target((w, 0)) for w in "abc")
    for h in chain:
        prefix.add(4, h, a)
    for h in chain[:3]:
        prefix.add(4, h, b)
    prefix.add(4, chain[0], c)
    assert prefix.overlap({4: chain}, {"a", "b"}) == {("a", 0): 4, ("b", 0): 3}
    assert prefix.overlap({4: chain}, {"b"}) == {("b", 0): 3}


def _depth(chain: list[int], holds: set[int]) -> int:
    d = 0
    while d < len(chain) and chain[d] in holds:
        d += 1
    return d


def test_holdings_are_reused_for_a_moment_per_model_and_asked_workers():
    index = KvIndex()
    index.worker_joined("a", MODEL)
    engine = FakeEngine("a")
    feed(index, engine, engine.stored(tokens(8)))
    now = [0.0]
    cache = HeldCache(index, list, lambda: now[0])
    assert cache.get(MODEL, ["a"]) == [("a", 0, 2)]
    feed(index, engine, engine.stored(tokens(16)))  # two more blocks: not seen until the listing ages
    assert cache.get(MODEL, ["a"]) == [("a", 0, 2)]
    assert cache.get(MODEL, None) == [("a", 0, 4)]  # other asked workers: listed on their own
    now[0] = HELD_MAX_AGE
    assert cache.get(MODEL, ["a"]) == [("a", 0, 4)]
