"""Engine events -> the net change of one rank's index hashes (kv_translate, no I/O)."""

from __future__ import annotations

import random

from infera_common.block_hash import block_hashes, unpack_hashes
from infera_common.kv_translate import BlockTranslator, delta_relay
from infera_common.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored


def stored(engine: list[int], tokens: list[int], parent: int | None = None, size: int = 4) -> BlockStored:
    return BlockStored(block_hashes=engine, parent_block_hash=parent, token_ids=tokens, block_size=size)


def toks(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def test_a_stored_chain_becomes_its_index_hashes_and_a_child_chains_through_its_parent():
    t = BlockTranslator()
    first = t.apply([stored([11, 12], toks(8))])
    chain = block_hashes(toks(8), 4)
    assert first.stored == {4: set(chain)} and first.removed == {} and not first.reset
    child = t.apply([stored([13], toks(4, 900), parent=12)])
    assert child.stored == {4: {block_hashes(toks(4, 900), 4, chain[1])[0]}}
    assert child.applied == {"BlockStored": 1}


def test_stored_then_removed_in_one_batch_is_no_change_and_removed_then_stored_again_is_none_either():
    t = BlockTranslator()
    t.apply([stored([1], toks(4))])
    h = block_hashes(toks(4), 4)[0]
    again = t.apply([BlockRemoved(block_hashes=[1]), stored([2], toks(4))])  # evicted and re-cached
    assert again.stored.get(4, set()) == set() and again.removed.get(4, set()) == set()
    gone = t.apply([stored([3], toks(4, 500)), BlockRemoved(block_hashes=[3, 2])])
    assert gone.stored.get(4, set()) == set() and gone.removed == {4: {h}}
    assert gone.blocks() == (0, 1)


def test_one_index_block_named_by_two_engine_hashes_goes_only_with_the_last():
    t = BlockTranslator()
    both = t.apply([stored([1], toks(4)), stored([2], toks(4))])  # same tokens, e.g. another LoRA
    assert both.blocks() == (1, 0)
    assert t.apply([BlockRemoved(block_hashes=[1])]).blocks() == (0, 0)
    assert t.apply([BlockRemoved(block_hashes=[2])]).blocks() == (0, 1)


def test_cleared_resets_and_only_what_follows_it_in_the_batch_is_stored():
    t = BlockTranslator()
    t.apply([stored([1, 2], toks(8))])
    d = t.apply([stored([3], toks(4, 700)), AllBlocksCleared(), stored([4], toks(4, 800)),
                 stored([5], toks(4, 900)), BlockRemoved(block_hashes=[5])])
    assert d.reset and d.removed == {}
    assert d.stored == {4: set(block_hashes(toks(4, 800), 4))}
    assert dict(t.held()) == {4: d.stored[4]}


def test_orphans_unknown_removals_and_bad_token_ids_are_counted_and_skipped():
    t = BlockTranslator()
    d = t.apply([stored([1, 2], toks(8), parent=99), BlockRemoved(block_hashes=[42]),
                 stored([3], [-1, 0, 0, 0]), stored([4], ["x", 0, 0, 0]), stored([5], toks(4))])
    assert (d.orphaned, d.unknown_removed, d.malformed) == (2, 1, 2)
    assert d.stored == {4: set(block_hashes(toks(4), 4))}
    assert d.applied == {"BlockStored": 1, "BlockRemoved": 1}


def test_block_sizes_are_kept_apart():
    t = BlockTranslator()
    d = t.apply([stored([1], toks(4), size=4), stored([2], toks(8), size=8)])
    assert d.stored == {4: set(block_hashes(toks(4), 4)), 8: set(block_hashes(toks(8), 8))}
    assert t.apply([BlockRemoved(block_hashes=[2])]).removed == {8: set(block_hashes(toks(8), 8))}


def test_the_deltas_of_a_random_history_replayed_as_set_updates_give_the_held_set():
    rng = random.Random(3)
    t = BlockTranslator()
    held: set[int] = set()
    cached: list[int] = []  # engine hashes the engine holds
    parents: dict[int, int] = {}
    next_hash = 1
    for _ in range(300):
        events = []
        for _ in range(rng.randint(1, 5)):
            roll = rng.random()
            if roll < 0.5 or not cached:
                parent = rng.choice(cached) if cached and rng.random() < 0.6 else None
                n = rng.randint(1, 3)
                engine = list(range(next_hash, next_hash + n))
                next_hash += n
                events.append(stored(engine, [rng.randrange(50) for _ in range(4 * n)], parent))
                cached += engine
                parents.update(dict.fromkeys(engine, parent))
            elif roll < 0.97:
                gone = rng.sample(cached, min(len(cached), rng.randint(1, 3)))
                events.append(BlockRemoved(block_hashes=gone))
                cached = [h for h in cached if h not in gone]
            else:
                events.append(AllBlocksCleared())
                cached = []
        d = t.apply(events)
        if d.reset:
            held.clear()
        for hashes in d.removed.values():
            assert hashes <= held  # only what was held is ever removed
            held -= hashes
        for hashes in d.stored.values():
            assert not hashes & held  # only what was not held is ever stored
            held |= hashes
        assert held == set(t.held().get(4, ()))


def test_the_relay_carries_the_delta_packed_and_leaves_out_empty_sizes():
    t = BlockTranslator()
    t.apply([stored([1], toks(4))])
    d = t.apply([stored([2], toks(4, 300)), BlockRemoved(block_hashes=[2])])  # nothing net
    relay = delta_relay("w1", 2, 17, d, 4)
    assert (relay.kind, relay.dp_rank, relay.seq, relay.stored, relay.removed) == ("blocks", 2, 17, {}, {})
    relay = delta_relay("w1", 0, 18, t.apply([BlockRemoved(block_hashes=[1])]), 4)
    assert list(unpack_hashes(relay.removed[4])) == block_hashes(toks(4), 4)
