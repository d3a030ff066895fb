"""Where an engine holds each block (``kv_translate`` residencies, no I/O): a second tier (vLLM's CPU
offloading, SGLang's HiCache) and a hybrid model's KV cache groups."""

from __future__ import annotations

import msgpack

from infera_common.block_hash import block_hashes
from infera_common.kv_translate import BlockTranslator, dump_translator, load_translator
from infera_common.kv_wire import BlockRemoved, BlockStored
from tests.common.test_kv_translate import stored, toks


def tiered(engine: list[int], tokens: list[int], parent: int | None = None, medium: str | None = "CPU",
           group: int | None = None) -> BlockStored:
    return BlockStored(engine, parent, tokens, 4, None, medium, group_idx=group)


def test_a_block_dropped_from_the_gpu_but_kept_by_the_cpu_tier_stays_held_until_the_tier_drops_it():
    t = BlockTranslator()
    h = block_hashes(toks(8), 4)
    assert t.apply([stored([11, 12], toks(8)), tiered([11, 12], toks(8))]).stored == {4: set(h)}  # offloaded
    gpu_gone = t.apply([BlockRemoved([11, 12], "GPU")])
    assert gpu_gone.blocks() == (0, 0) and gpu_gone.unknown_removed == 0  # a hit still: loaded back
    assert t.apply([BlockRemoved([12], "CPU")]).removed == {4: {h[1]}}
    assert {s: set(v) for s, v in t.held().items()} == {4: {h[0]}}


def test_a_removal_from_a_tier_that_never_stored_the_block_changes_nothing():
    t = BlockTranslator()
    t.apply([stored([11], toks(4))])
    d = t.apply([BlockRemoved([11], "CPU"), BlockRemoved([11], "GPU", 1)])
    assert d.blocks() == (0, 0) and d.unknown_removed == 2
    assert t.apply([BlockRemoved([11], None)]).blocks() == (0, 1)  # no medium: the GPU's


def test_a_block_only_a_tier_holds_is_held_and_its_children_chain_through_it():
    """Blocks the GPU evicted, or an engine prefetched from storage: the CPU tier's own stores."""
    t = BlockTranslator()
    h = block_hashes(toks(8), 4)
    assert t.apply([tiered([11], toks(4))]).stored == {4: {h[0]}}
    assert t.apply([tiered([12], toks(4, 104), parent=11)]).stored == {4: {h[1]}}  # parent known through the tier
    assert t.apply([stored([12], toks(4, 104), parent=11), BlockRemoved([12], "CPU")]).blocks() == (0, 0)  # GPU has it
    assert t.apply([BlockRemoved([12], "GPU")]).removed == {4: {h[1]}}


def test_a_tiers_placeholder_store_adds_its_residency_to_a_known_block_and_is_otherwise_dropped():
    """vLLM's offloading connector, unless asked to describe its blocks: block_size 0, no tokens."""
    t = BlockTranslator()
    h = block_hashes(toks(8), 4)
    t.apply([stored([11, 12], toks(8))])
    d = t.apply([BlockStored([12, 99], None, [], 0, None, "CPU")])
    assert d.blocks() == (0, 0) and d.malformed == d.orphaned == 0
    assert t.apply([BlockRemoved([11, 12], "GPU")]).removed == {4: {h[0]}}  # 12 lives on in the tier
    assert t.apply([BlockRemoved([12, 99], "CPU")]).removed == {4: {h[1]}}


def test_a_hybrid_models_block_leaves_the_index_when_its_last_kv_cache_group_evicts_it():
    t = BlockTranslator()
    h = block_hashes(toks(4), 4)[0]
    t.apply([tiered([11], toks(4), medium="GPU", group=0), tiered([11], toks(4), medium="GPU", group=1)])
    assert t.apply([BlockRemoved([11], "GPU", 1)]).blocks() == (0, 0)  # the sliding-window group's copy
    assert t.apply([BlockRemoved([11], "GPU", 0)]).removed == {4: {h}}


def test_a_replayed_tier_store_is_harmless_and_a_reused_hash_forgets_the_old_blocks_tiers():
    t = BlockTranslator()
    t.apply([stored([11], toks(4)), tiered([11], toks(4)), tiered([11], toks(4))])  # the tier's store replayed
    assert t.apply([BlockRemoved([11], "CPU"), BlockRemoved([11], "GPU")]).blocks() == (0, 1)
    t.apply([stored([21], toks(4, 300)), tiered([21], toks(4, 300))])
    other = block_hashes(toks(4, 700), 4)[0]
    assert t.apply([stored([21], toks(4, 700))]).stored == {4: {other}}  # the engine reused hash 21
    assert t.apply([BlockRemoved([21], "GPU")]).removed == {4: {other}}  # no CPU copy of the new content


def test_pages_folded_into_index_blocks_follow_the_gpu_alone():
    t = BlockTranslator(8)
    h = block_hashes(toks(8), 8)
    t.apply([stored([1], toks(4)), stored([2], toks(4, 104), parent=1)])
    d = t.apply([tiered([1], toks(4)), BlockRemoved([2], "CPU")])  # skipped
    assert d.blocks() == (0, 0) and d.malformed == d.orphaned == d.unknown_removed == 0
    assert t.apply([BlockRemoved([2], "GPU")]).removed == {8: set(h)}


def test_a_translator_rebuilt_from_its_dump_keeps_each_blocks_residencies():
    t = BlockTranslator()
    h = block_hashes(toks(8), 4)
    t.apply([stored([11, 12], toks(8)), tiered([12], toks(4, 104), parent=11), BlockRemoved([12], "GPU")])
    restored = load_translator(msgpack.unpackb(msgpack.packb(dump_translator(t)), strict_map_key=False))
    for one in (t, restored):
        assert one.apply([BlockRemoved([11, 12], "GPU")]).removed == {4: {h[0]}}
        assert one.apply([BlockRemoved([12], "CPU")]).removed == {4: {h[1]}}
