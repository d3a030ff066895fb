"""The prefix index without I/O: engine batches in (both encodings), overlap answers out."""

from __future__ import annotations

import random

import msgpack
import pytest

from infera_common.block_hash import block_hashes, pack_hashes
from infera_common.kv_wire import decode_batch
from infera_common.schemas import KvRelay, encode
from infera_common.kv_index.index import KvIndex
from infera_common.kv_index.ingest import ingest
from infera_common.kv_index.prefix import PrefixIndex
from tests.kv_indexer.kv_fakes import MODEL, FakeEngine, cleared_relay, depths, query, tokens

FLAVOURS = ["vllm", "sglang"]


@pytest.fixture(autouse=True, params=["batch", "blocks"])
def relay_kind(request, monkeypatch) -> str:
    """Every test twice: raw engine batches (translated by the indexer) and the worker-agent's
    translated relays. Both must leave the same index."""
    monkeypatch.setattr(FakeEngine, "relay_kind", request.param)
    return request.param


def feed(index: KvIndex, engine: FakeEngine, *events, seq: int | None = None, now: float = 0.0):
    return ingest(index, engine.subject, engine.relay(*events, seq=seq), now)


def indexed(*workers: str) -> KvIndex:
    index = KvIndex()
    for w in workers:
        index.worker_joined(w, MODEL)
    return index


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_chain_stored_over_two_events_matches_through_the_parent(flavour, relay_kind):
    index, engine = indexed("w1"), FakeEngine("w1", flavour)
    system, turn2 = tokens(16), tokens(16) + tokens(8, start=5000)
    feed(index, engine, engine.stored(system))
    second = engine.stored(turn2)  # only the two new blocks, parent = the engine hash of block 3
    assert (second["parent_block_hash"] if flavour == "vllm" else second[2]) == engine.engine_hash(system, 3)
    out = feed(index, engine, second).outcome
    assert out.stored == 2
    if relay_kind == "batch":
        assert out.applied == {"BlockStored": 1} and out.orphaned == 0
    assert depths(index.overlap(query(turn2))) == {("w1", 0): 6}
    assert depths(index.overlap(query(system + tokens(8, start=7000)))) == {("w1", 0): 4}
    # the same new tokens under another prefix are a different chain: no match at all
    assert depths(index.overlap(query(tokens(8, start=5000)))) == {}


def test_both_encodings_index_the_same_blocks_despite_different_engine_hashes():
    index = indexed("v", "s")
    v, s = FakeEngine("v", "vllm"), FakeEngine("s", "sglang")
    prompt = tokens(20)
    feed(index, v, v.stored(prompt))
    feed(index, s, s.stored(prompt[:12]))
    assert v.engine_hash(prompt, 0) != s.engine_hash(prompt, 0)
    assert depths(index.overlap(query(prompt))) == {("v", 0): 5, ("s", 0): 3}


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_removal_by_engine_hash_cuts_the_prefix_at_the_first_missing_block(flavour, relay_kind):
    index, engine = indexed("w1"), FakeEngine("w1", flavour)
    prompt = tokens(24)
    feed(index, engine, engine.stored(prompt))
    removed = engine.removed(prompt[:12], 2)  # block 2 only; blocks 3.. stay cached
    out = feed(index, engine, removed).outcome
    assert out.removed == 1 and out.stored == 0
    if relay_kind == "batch":
        assert out.applied == {"BlockRemoved": 1}
    assert depths(index.overlap(query(prompt))) == {("w1", 0): 2}
    assert index.worker_blocks("w1") == 5


def test_removing_unknown_engine_hashes_is_ignored_and_counted(relay_kind):
    index, engine = indexed("w1"), FakeEngine("w1")
    prompt = tokens(8)
    feed(index, engine, engine.stored(prompt))
    out = feed(index, engine, {"type": "BlockRemoved", "block_hashes": [12345, 678], "medium": "GPU"}).outcome
    assert out.removed == 0
    if relay_kind == "batch":  # (the worker-agent counts these when it translates)
        assert out.unknown_removed == 2 and out.malformed == 0
    assert depths(index.overlap(query(prompt))) == {("w1", 0): 2}


def test_a_block_whose_parent_is_unknown_is_dropped_not_indexed_at_the_root(relay_kind):
    index, engine = indexed("w1"), FakeEngine("w1")
    prompt = tokens(16)
    engine.stored(prompt[:8])  # the engine cached these, but their event never reached the index
    out = feed(index, engine, engine.stored(prompt)).outcome
    assert out.stored == 0
    if relay_kind == "batch":  # (the worker-agent counts these when it translates)
        assert out.orphaned == 2 and out.applied == {}
    assert depths(index.overlap(query(prompt[8:]))) == {}  # not mistaken for a prefix from the root
    assert depths(index.overlap(query(prompt))) == {}


def test_all_blocks_cleared_empties_only_that_target():
    index = indexed("w1")
    r0, r1 = FakeEngine("w1", dp_rank=0), FakeEngine("w1", dp_rank=1)
    prompt = tokens(12)
    feed(index, r0, r0.stored(prompt))
    feed(index, r1, r1.stored(prompt))
    feed(index, r1, r1.cleared())
    assert depths(index.overlap(query(prompt))) == {("w1", 0): 3}


@pytest.mark.parametrize("rank, left", [(None, {}), (1, {("w1", 0): 3})])
def test_a_cleared_relay_drops_the_rank_or_the_whole_worker_and_restarts_its_seq(rank, left):
    index = indexed("w1")
    r0, r1 = FakeEngine("w1", dp_rank=0), FakeEngine("w1", dp_rank=1)
    prompt = tokens(12)
    feed(index, r0, r0.stored(prompt), seq=7)
    feed(index, r1, r1.stored(prompt), seq=7)
    ingest(index, r0.subject, cleared_relay("w1", rank), 0.0)
    assert depths(index.overlap(query(prompt))) == left
    assert index.overlap(query(prompt)).unseen == []  # still seen: known to hold (nearly) nothing
    r1b = FakeEngine("w1", dp_rank=1, seed=1)  # the restarted engine counts from 0 again
    out = feed(index, r1b, r1b.stored(prompt[:4]), seq=0).outcome
    assert not out.duplicate
    assert depths(index.overlap(query(prompt)))[("w1", 1)] == 1


def test_dp_ranks_are_separate_targets_and_the_batch_rank_wins():
    index = indexed("w1")
    r0, r1 = FakeEngine("w1", "sglang", dp_rank=0), FakeEngine("w1", "vllm", dp_rank=1)
    a, b = tokens(12), tokens(8, start=3000)
    feed(index, r0, r0.stored(a))
    feed(index, r1, r1.stored(a[:8]), r1.stored(b))
    assert depths(index.overlap(query(a))) == {("w1", 0): 3, ("w1", 1): 2}
    assert depths(index.overlap(query(b))) == {("w1", 1): 2}
    # a batch without a rank takes the relay's
    batch = msgpack.packb([1.0, [["BlockStored", [9], None, tokens(4, start=8000), 4, None, None]]])
    relay = encode(KvRelay(worker_id="w1", dp_rank=3, seq=0, payload=batch))
    ingest(index, r0.subject, relay, 0.0)
    assert depths(index.overlap(query(tokens(4, start=8000)))) == {("w1", 3): 1}


def test_block_sizes_are_matched_separately_in_each_workers_blocks():
    index = indexed("small", "big")
    small, big = FakeEngine("small", block_size=4), FakeEngine("big", "sglang", block_size=8)
    prompt = tokens(40)
    feed(index, small, small.stored(prompt[:20]))
    feed(index, big, big.stored(prompt))
    reply = index.overlap(query(prompt, block_sizes=(4, 8)))
    assert depths(reply) == {("small", 0): 5, ("big", 0): 5}
    assert depths(index.overlap(query(prompt, block_sizes=(4,)))) == {("small", 0): 5}


def test_unseen_lists_the_models_workers_without_events_and_workers_filters():
    index = indexed("w1", "w2", "w3")
    index.worker_joined("other", "another-model")
    engine = FakeEngine("w1")
    prompt = tokens(8)
    feed(index, engine, engine.stored(prompt))
    reply = index.overlap(query(prompt))
    assert depths(reply) == {("w1", 0): 2} and reply.unseen == ["w2", "w3"]
    only = index.overlap(query(prompt, workers=["w2"]))
    assert only.overlaps == [] and only.unseen == ["w2"]
    assert index.overlap(query(prompt, model="unknown")).overlaps == []


def test_a_worker_leaving_discovery_disappears_at_once_and_its_blocks_go_after_the_grace():
    index = indexed("w1", "w2")
    e1, e2 = FakeEngine("w1"), FakeEngine("w2")
    prompt = tokens(8)
    feed(index, e1, e1.stored(prompt))
    feed(index, e2, e2.stored(prompt))
    index.worker_left("w1", now=1000.0)
    reply = index.overlap(query(prompt))
    assert depths(reply) == {("w2", 0): 2} and reply.unseen == []
    assert index.held(MODEL) == [("w2", 0, 2)]
    assert index.expire_unattached(now=1000.0 + 59, grace=60.0) == []  # the grace counts from the leave
    assert index.expire_unattached(now=1000.0 + 61, grace=60.0) == ["w1"]
    assert index.worker_blocks("w1") == 0


def test_a_worker_back_after_an_outage_with_the_same_engine_has_its_blocks_again():
    """A broker outage longer than the discovery TTL: every worker left and came back, their engines'
    caches intact. Blocks stored before it are never announced again: the index must still have them
    (it forgot them, and the router sent those prompts anywhere)."""
    index = KvIndex()
    index.worker_joined("w1", MODEL, started_at=5.0)
    engine = FakeEngine("w1")
    old, during = tokens(8), tokens(8, start=5000)
    feed(index, engine, engine.stored(old))
    index.worker_left("w1", now=10.0)
    feed(index, engine, engine.stored(during))  # relayed while it was out of discovery
    index.worker_joined("w1", MODEL, started_at=5.0)
    assert depths(index.overlap(query(old))) == depths(index.overlap(query(during))) == {("w1", 0): 2}


def test_a_worker_back_with_a_restarted_engine_starts_empty():
    index = KvIndex()
    index.worker_joined("w1", MODEL, started_at=5.0)
    engine = FakeEngine("w1")
    old = tokens(8)
    feed(index, engine, engine.stored(old))
    index.worker_left("w1", now=10.0)
    index.worker_joined("w1", MODEL, started_at=20.0)  # another start of the worker: an empty cache
    assert depths(index.overlap(query(old))) == {}
    fresh = FakeEngine("w1")
    feed(index, fresh, fresh.stored(old))  # the new engine's seq starts again: not taken for a duplicate
    assert depths(index.overlap(query(old))) == {("w1", 0): 2}


def test_a_restarted_engine_whose_cleared_and_blocks_came_before_its_record_keeps_them():
    """The new agent's ``cleared`` and first events can reach the indexer before its new record."""
    index = KvIndex()
    index.worker_joined("w1", MODEL, started_at=5.0)
    old_engine, new_engine = FakeEngine("w1"), FakeEngine("w1")
    old, new = tokens(8), tokens(8, start=7000)
    feed(index, old_engine, old_engine.stored(old))
    index.worker_left("w1", now=10.0)
    index.clear("w1", None, 11.0)
    feed(index, new_engine, new_engine.stored(new))
    index.worker_joined("w1", MODEL, started_at=20.0)
    assert depths(index.overlap(query(old))) == {}
    assert depths(index.overlap(query(new))) == {("w1", 0): 2}


@pytest.mark.parametrize("meanwhile", ["left", "cleared"])
def test_a_raw_batch_still_being_applied_when_its_worker_left_or_was_cleared_changes_no_answer(meanwhile):
    """The ZMQ path applies a batch in slices: discovery may drop the worker, or its engine restart
    clear it, before the batch's last slice."""
    index = indexed("w1")
    engine = FakeEngine("w1", "sglang")
    prompt = tokens(8)
    batch = decode_batch(engine.batch([engine.stored(prompt)]))
    raw = index.open_batch("w1", 0, 0, 0.0)
    raw.translator.apply(batch.events, into=raw.delta)
    index.worker_left("w1", 0.0) if meanwhile == "left" else index.clear("w1", None, 0.0)
    out = index.close_batch(raw)
    assert out.applied == {"BlockStored": 1}
    assert depths(index.overlap(query(prompt))) == {}
    if meanwhile == "cleared":
        assert out.stored == 0  # the batch belonged to the engine before the restart


def test_events_before_the_discovery_record_attach_when_it_arrives_or_expire():
    index = KvIndex()
    early, stale = FakeEngine("early"), FakeEngine("stale")
    prompt = tokens(12)
    feed(index, early, early.stored(prompt), now=100.0)
    feed(index, stale, stale.stored(prompt), now=100.0)
    assert index.overlap(query(prompt)).overlaps == []  # no model known: answered for nobody
    index.worker_joined("early", MODEL)
    assert depths(index.overlap(query(prompt))) == {("early", 0): 3}
    assert index.expire_unattached(now=130.0, grace=60.0) == []
    assert index.expire_unattached(now=161.0, grace=60.0) == ["stale"]
    index.worker_joined("stale", MODEL)
    assert depths(index.overlap(query(prompt))) == {("early", 0): 3}
    assert index.overlap(query(prompt)).unseen == ["stale"]


def test_a_worker_that_changes_model_moves_its_blocks():
    index = indexed("w1")
    engine = FakeEngine("w1")
    prompt = tokens(8)
    feed(index, engine, engine.stored(prompt))
    index.worker_joined("w1", "model-b")
    assert index.overlap(query(prompt)).overlaps == []
    assert depths(index.overlap(query(prompt, model="model-b"))) == {("w1", 0): 2}


def test_duplicate_seqs_are_skipped_and_gaps_counted():
    index, engine = indexed("w1"), FakeEngine("w1")
    a, b = tokens(8), tokens(8, start=2000)
    assert feed(index, engine, engine.stored(a), seq=5).outcome.gap == 0  # first seen: no gap claimed
    again = engine.relay({"type": "BlockRemoved", "block_hashes": [engine.engine_hash(a, 0)]}, seq=5)
    assert ingest(index, engine.subject, again, 0.0).outcome.duplicate
    assert depths(index.overlap(query(a))) == {("w1", 0): 2}  # the replayed removal was not applied
    assert feed(index, engine, engine.stored(b), seq=9).outcome.gap == 3
    assert depths(index.overlap(query(b))) == {("w1", 0): 2}


def test_malformed_messages_change_nothing_and_bad_events_do_not_spoil_their_batch(relay_kind):
    index, engine = indexed("w1"), FakeEngine("w1")
    prompt = tokens(8)
    assert ingest(index, engine.subject, b"\xc1garbage", 0.0).malformed == "relay"
    wrong_subject = ingest(index, "infera.kv.events.w2", engine.relay(engine.stored(prompt)), 0.0)
    assert wrong_subject.malformed == "relay"
    bad_batch = encode(KvRelay(worker_id="w1", seq=50, payload=b"\x93not a batch"))
    assert ingest(index, engine.subject, bad_batch, 0.0).malformed == "batch"
    assert index.overlap(query(prompt)).unseen == ["w1"]  # nothing readable arrived
    engine = FakeEngine("w1", seed=2)
    out = feed(index, engine, {"type": "Nonsense"},
               ["BlockStored", [1], None, [-5, 2, 3, 4], 4, None, None],  # token id out of range
               ["BlockStored", [2], None, ["a", 2, 3, 4], 4, None, None],  # token id not an integer
               engine.stored(prompt)).outcome
    assert out.stored == 2
    if relay_kind == "batch":  # (the worker-agent counts these when it translates)
        assert out.malformed == 3 and out.applied == {"BlockStored": 1}
    assert depths(index.overlap(query(prompt))) == {("w1", 0): 2}


def test_two_engine_hashes_of_one_chain_keep_the_block_until_both_are_removed():
    index, engine = indexed("w1"), FakeEngine("w1")
    block = tokens(4)
    stored = {"type": "BlockStored", "parent_block_hash": None, "token_ids": block, "block_size": 4}
    feed(index, engine, {**stored, "block_hashes": [111]}, {**stored, "block_hashes": [222]})
    feed(index, engine, {"type": "BlockRemoved", "block_hashes": [111]})
    assert depths(index.overlap(query(block))) == {("w1", 0): 1}
    feed(index, engine, {"type": "BlockRemoved", "block_hashes": [222]})
    assert depths(index.overlap(query(block))) == {}


def test_blocks_an_adapter_computed_match_only_requests_for_that_adapter():
    index, engine = indexed("w1"), FakeEngine("w1")
    prompt = tokens(8)
    stored = {"type": "BlockStored", "parent_block_hash": None, "token_ids": prompt[:4], "block_size": 4,
              "lora_id": 1, "lora_name": "sql"}
    feed(index, engine, {**stored, "block_hashes": [111]},
         {**stored, "block_hashes": [112], "parent_block_hash": 111, "token_ids": prompt[4:]},
         {**stored, "block_hashes": [211], "lora_id": 2, "lora_name": "chat"})
    assert depths(index.overlap(query(prompt, adapter="sql"))) == {("w1", 0): 2}
    assert depths(index.overlap(query(prompt, adapter="chat"))) == {("w1", 0): 1}
    assert depths(index.overlap(query(prompt))) == {}  # the base model holds none of it
    feed(index, engine, {**stored, "block_hashes": [311], "lora_id": 9, "lora_name": None})  # a number alone
    assert depths(index.overlap(query(prompt))) == {}
    feed(index, engine, {**stored, "block_hashes": [411], "lora_id": None, "lora_name": None})
    assert depths(index.overlap(query(prompt))) == {("w1", 0): 1}
    feed(index, engine, {"type": "BlockRemoved", "block_hashes": [112]})
    assert depths(index.overlap(query(prompt, adapter="sql"))) == {("w1", 0): 1}


def test_a_salted_prompts_blocks_match_only_its_salt_and_an_images_none_after_it():
    index, engine = indexed("w1"), FakeEngine("w1")
    prompt = tokens(12)
    stored = {"type": "BlockStored", "parent_block_hash": None, "token_ids": prompt, "block_size": 4}
    # vLLM 0.32: the salt in the first block's extra keys (after the adapter's name), the adapter's on every block
    feed(index, engine, {**stored, "block_hashes": [11, 12, 13], "extra_keys": [["tenant-a"], None, None]},
         {**stored, "block_hashes": [21, 22, 23], "lora_name": "sql", "lora_id": 1,
          "extra_keys": [["sql", "tenant-a"], ["sql"], ["sql"]]})
    assert depths(index.overlap(query(prompt, salt="tenant-a"))) == {("w1", 0): 3}
    assert depths(index.overlap(query(prompt, adapter="sql", salt="tenant-a"))) == {("w1", 0): 3}
    assert depths(index.overlap(query(prompt))) == {}  # unsalted: none of it
    assert depths(index.overlap(query(prompt, salt="tenant-b"))) == {}
    assert depths(index.overlap(query(prompt, adapter="sql"))) == {}
    # an image in the second block ([identifier, offset]) or prompt embeddings (bytes): the tokens
    # there do not say what the engine computed, so that block and every one after it match nothing
    feed(index, engine, {**stored, "block_hashes": [31, 32, 33], "extra_keys": [None, [["img-1", 0]], None]},
         {**stored, "block_hashes": [41, 42, 43], "lora_name": "chat", "lora_id": 2,
          "extra_keys": [["chat"], ["chat"], ["chat", b"\x01digest"]]})
    assert depths(index.overlap(query(prompt))) == {("w1", 0): 1}
    assert depths(index.overlap(query(prompt, adapter="chat"))) == {("w1", 0): 2}
    # SGLang 0.5.23 names the salt in a field of its own, on every event of the chain
    feed(index, engine, {**stored, "block_hashes": [51], "token_ids": prompt[:4], "cache_salt": "tenant-c"},
         {**stored, "block_hashes": [52], "token_ids": prompt[4:8], "parent_block_hash": 51,
          "cache_salt": "tenant-c"})
    assert depths(index.overlap(query(prompt, salt="tenant-c"))) == {("w1", 0): 2}


def test_prefix_match_stops_at_the_first_missing_block():
    prefix = PrefixIndex()
    chain = block_hashes(tokens(20), 4)
    a, b = prefix.add_target(("a", 0)), prefix.add_target(("b", 0))
    for i in (0, 1, 3, 4):  # a lacks block 2
        prefix.add(4, chain[i], a)
    for i in (1, 2, 3, 4):  # b lacks block 0: nothing matches
        prefix.add(4, chain[i], b)
    assert prefix.overlap({4: chain}) == {("a", 0): 2}
    assert prefix.overlap({4: chain}, workers={"b"}) == {}
    assert prefix.overlap({4: []}) == {} and prefix.overlap({8: chain}) == {}


def test_overlap_equals_a_brute_force_walk_for_many_workers():
    rng = random.Random(7)
    index = KvIndex()
    trunk = tokens(400)
    engines, held = {}, {}
    for i in range(50):
        wid = f"w{i}"
        index.worker_joined(wid, MODEL)
        engines[wid] = engine = FakeEngine(wid, FLAVOURS[i % 2])
        depth = rng.randrange(0, 101)
        branch = trunk[:depth * 4] + tokens(8, start=10_000 * (i + 1))  # then a private branch
        feed(index, engine, engine.stored(branch))
        gone = rng.randrange(0, 101)
        if gone < depth:  # evict the tail from block `gone` on, branch included
            feed(index, engine, engine.removed(branch, gone))
            depth = gone
        held[wid] = depth
    got = {w: n for (w, _), n in depths(index.overlap(query(trunk))).items()}
    assert got == {w: n for w, n in held.items() if n}
    # a removed target's bit is reused without leaking its old blocks into the new owner
    index.worker_left("w0", 0.0)
    index.worker_joined("fresh", MODEL)
    fresh = FakeEngine("fresh")
    feed(index, fresh, fresh.stored(trunk[:4]))
    got = {w: n for (w, _), n in depths(index.overlap(query(trunk))).items()}
    assert got == {**{w: n for w, n in held.items() if n and w != "w0"}, "fresh": 1}


def test_an_engine_hash_reused_for_other_content_moves_to_it():
    index, engine = indexed("w1"), FakeEngine("w1")
    a, b = tokens(8), tokens(8, start=9000)
    stored = {"type": "BlockStored", "parent_block_hash": None, "block_size": 4}
    feed(index, engine, {**stored, "block_hashes": [1, 2], "token_ids": a})
    assert depths(index.overlap(query(a))) == {("w1", 0): 2}
    feed(index, engine, {**stored, "block_hashes": [3, 1], "token_ids": b})  # hash 1 now names b's 2nd block
    assert depths(index.overlap(query(a))) == {}  # a's first block is gone
    assert depths(index.overlap(query(b))) == {("w1", 0): 2}
    assert index.worker_blocks("w1") == 3  # a's second block (hash 2) stays until removed


def blocks_relay(seq: int, stored=None, removed=None, reset: bool = False, rank: int = 0,
                 first_seq: int | None = None) -> bytes:
    return encode(KvRelay(worker_id="w1", kind="blocks", dp_rank=rank, seq=seq, first_seq=first_seq, reset=reset,
                          stored={4: pack_hashes(stored)} if stored else {},
                          removed={4: pack_hashes(removed)} if removed else {}))


def test_translated_relays_are_set_updates_that_repeat_harmlessly_and_torn_ones_change_nothing():
    index = indexed("w1")
    subject = FakeEngine("w1").subject
    a, b = block_hashes(tokens(12), 4), block_hashes(tokens(8, start=4000), 4)
    out = ingest(index, subject, blocks_relay(0, stored=a), 0.0).outcome
    assert (out.stored, out.removed) == (3, 0)
    out = ingest(index, subject, blocks_relay(1, stored=a[:2] + b), 0.0).outcome  # two of them held already
    assert (out.stored, out.removed) == (2, 0) and index.worker_blocks("w1") == 5
    torn = encode(KvRelay(worker_id="w1", kind="blocks", seq=2, removed={4: pack_hashes(a)[:-1]}))
    assert ingest(index, subject, torn, 0.0).malformed == "relay"
    assert depths(index.overlap(query(tokens(12)))) == {("w1", 0): 3}  # nothing of it applied
    out = ingest(index, subject, blocks_relay(3, removed=[a[1], 999]), 0.0).outcome  # 999: never held
    assert (out.stored, out.removed, out.gap) == (0, 1, 1)
    assert depths(index.overlap(query(tokens(12)))) == {("w1", 0): 1}
    assert ingest(index, subject, blocks_relay(3, removed=a), 0.0).outcome.duplicate
    ingest(index, subject, blocks_relay(4, stored=a[1:2], reset=True), 0.0)
    assert index.worker_blocks("w1") == 1 and depths(index.overlap(query(tokens(12)))) == {}
    ingest(index, subject, blocks_relay(0, stored=a, rank=1), 0.0)
    assert depths(index.overlap(query(tokens(12)))) == {("w1", 1): 3}


def test_a_relay_carrying_several_batches_counts_a_gap_only_before_its_first_and_reapplies_harmlessly():
    index = indexed("w1")
    subject = FakeEngine("w1").subject
    a = block_hashes(tokens(12), 4)
    ingest(index, subject, blocks_relay(0, stored=a[:1]), 0.0)
    out = ingest(index, subject, blocks_relay(4, stored=a[:2], first_seq=1), 0.0).outcome  # batches 1..4
    assert (out.gap, out.stored, out.duplicate) == (0, 1, False)
    # the agent resends batches 4..6 (batch 4's ack was lost, though it reached the stream)
    out = ingest(index, subject, blocks_relay(6, stored=a, removed=[999], first_seq=4), 0.0).outcome
    assert (out.gap, out.stored, out.removed) == (0, 1, 0)
    assert depths(index.overlap(query(tokens(12)))) == {("w1", 0): 3}
    assert ingest(index, subject, blocks_relay(9, first_seq=8), 0.0).outcome.gap == 1


def test_a_state_relay_replaces_the_targets_holding_unless_the_index_applied_a_later_batch():
    index = indexed("w1")
    engine = FakeEngine("w1")
    kept, evicted, later = tokens(8), tokens(8, start=5000), tokens(8, start=7000)
    feed(index, engine, engine.stored(evicted))
    state_seq = engine.seq + 1  # the agent's state after its next batch, which the index never saw
    held = [*block_hashes(kept, 4)]
    out = index.apply_state("w1", 0, state_seq, True, {4: held[:1]}, 0.0)  # in two parts
    index.apply_state("w1", 0, state_seq, False, {4: held[1:]}, 0.0)
    assert out.stored == 1 and not out.duplicate
    assert depths(index.overlap(query(kept))) == {("w1", 0): 2}
    assert depths(index.overlap(query(evicted))) == {}  # the state is the whole holding: the rest is gone
    engine.seq = state_seq
    feed(index, engine, engine.stored(later))  # the batches after the state apply on top of it
    assert depths(index.overlap(query(later))) == {("w1", 0): 2}
    stale = index.apply_state("w1", 0, state_seq, True, {4: []}, 0.0)  # an old state read again
    assert stale.duplicate and depths(index.overlap(query(kept))) == {("w1", 0): 2}
