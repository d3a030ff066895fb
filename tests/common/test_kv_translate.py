"""Engine events -> where each touched index hash of one rank ends (kv_translate, no I/O)."""

from __future__ import annotations

import random

import msgpack

import pytest

from infera_common.block_hash import block_hashes, unpack_hashes
from infera_common.int_columns import pack_column, unpack_column, unpack_map
from infera_common.kv_translate import BlockDelta, BlockTranslator, delta_relay, dump_translator, load_translator
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


def test_a_hash_touched_twice_in_one_batch_ends_where_its_last_event_left_it():
    t = BlockTranslator()
    t.apply([stored([1], toks(4))])
    h, other = block_hashes(toks(4), 4)[0], block_hashes(toks(4, 500), 4)[0]
    again = t.apply([BlockRemoved(block_hashes=[1]), stored([2], toks(4))])  # evicted and re-cached
    assert again.stored == {4: {h}} and again.removed == {4: set()}
    gone = t.apply([stored([3], toks(4, 500)), BlockRemoved(block_hashes=[3, 2])])
    assert gone.stored == {4: set()} and gone.removed == {4: {h, other}}
    assert gone.blocks() == (0, 2)


def test_one_index_block_named_by_two_engine_hashes_goes_only_with_the_last():
    t = BlockTranslator()
    both = t.apply([stored([1], toks(4)), stored([2], toks(4))])  # same tokens, e.g. another LoRA
    assert both.blocks() == (1, 0)
    assert t.apply([BlockRemoved(block_hashes=[1])]).blocks() == (0, 0)
    assert t.apply([BlockRemoved(block_hashes=[2])]).blocks() == (0, 1)


def test_cleared_resets_and_only_what_follows_it_in_the_batch_counts():
    t = BlockTranslator()
    t.apply([stored([1, 2], toks(8))])
    d = t.apply([stored([3], toks(4, 700)), AllBlocksCleared(), stored([4], toks(4, 800)),
                 stored([5], toks(4, 900)), BlockRemoved(block_hashes=[5])])
    assert d.reset and d.removed == {4: set(block_hashes(toks(4, 900), 4))}
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


def random_batches(seed: int, n: int) -> list[list]:
    """An engine's batches: stores under random cached parents, removals of cached blocks, clears."""
    rng = random.Random(seed)
    cached: list[int] = []  # engine hashes the engine holds
    next_hash, out = 1, []
    for _ in range(n):
        events: list = []
        for _ in range(rng.randint(1, 5)):
            roll = rng.random()
            if roll < 0.5 or not cached:
                parent = rng.choice(cached) if cached and rng.random() < 0.6 else None
                k = rng.randint(1, 3)
                engine = list(range(next_hash, next_hash + k))
                next_hash += k
                events.append(stored(engine, [rng.randrange(50) for _ in range(4 * k)], parent))
                cached += engine
            elif roll < 0.97:
                gone = rng.sample(cached, min(len(cached), rng.randint(1, 3)))
                events.append(BlockRemoved(block_hashes=gone))
                cached = [h for h in cached if h not in gone]
            else:
                events.append(AllBlocksCleared())
                cached = []
        out.append(events)
    return out


def apply_delta(held: set[int], d) -> None:
    if d.reset:
        held.clear()
    for hashes in d.removed.values():
        held -= hashes
    for hashes in d.stored.values():
        held |= hashes


def test_a_random_history_replayed_as_set_updates_gives_the_held_set_even_with_some_deltas_applied_twice():
    rng = random.Random(9)
    t = BlockTranslator()
    held: set[int] = set()
    for events in random_batches(3, 300):
        d = t.apply(events)
        apply_delta(held, d)
        if rng.random() < 0.2:
            apply_delta(held, d)  # a relay delivered twice
        assert not any(d.stored.get(s, set()) & d.removed.get(s, set()) for s in d.stored)
        assert held == set(t.held().get(4, ()))


def test_batches_gathered_into_one_delta_give_the_same_end_whether_or_not_the_first_arrived():
    """The worker-agent's resend: batch deltas that failed to publish, gathered with the next ones."""
    batches = random_batches(5, 200)
    for cut in range(0, 200, 7):
        one, gathered = BlockTranslator(), BlockTranslator()
        held, lost, late = set(), set(), set()  # each batch applied / first batch of each pair lost
        for i, events in enumerate(batches):
            apply_delta(held, one.apply(events))
            if i == cut:
                carried = gathered.apply(events)  # its publish failed (or reached the stream unacknowledged)
                apply_delta(late, carried)  # ... in which case the indexer applied it already
                continue
            if i == cut + 1:
                d = gathered.apply(events, into=carried)
                apply_delta(lost, d)
                apply_delta(late, d)
                continue
            d = gathered.apply(events)
            apply_delta(lost, d)
            apply_delta(late, d)
        assert lost == held == late, cut


def test_the_relay_carries_the_delta_packed_leaves_out_empty_sizes_and_names_a_first_seq_only_for_several():
    t = BlockTranslator()
    t.apply([stored([1], toks(4))])
    d = t.apply([stored([2], toks(4, 300)), BlockRemoved(block_hashes=[1])])
    d = t.apply([BlockRemoved(block_hashes=[2])], into=d)  # stored [2] ends removed: the size's stored set is empty
    relay = delta_relay("w1", 2, 17, d, 4)
    assert (relay.kind, relay.dp_rank, relay.seq, relay.first_seq, relay.stored) == ("blocks", 2, 17, None, {})
    assert sorted(unpack_hashes(relay.removed[4])) == sorted(block_hashes(toks(4), 4) + block_hashes(toks(4, 300), 4))
    assert delta_relay("w1", 2, 17, d, 4, first_seq=17).first_seq is None
    assert delta_relay("w1", 2, 17, d, 4, first_seq=15).first_seq == 15


def test_a_relay_sent_sparse_decodes_to_the_same_relay_in_fewer_bytes():
    from infera_common.schemas import KvRelay, decode, encode, encode_sparse

    t = BlockTranslator()
    relay = delta_relay("w1", 0, 5, t.apply([stored([1], toks(8))]), 4)
    sparse = encode_sparse(relay)
    assert decode(KvRelay, sparse) == relay
    assert len(sparse) < len(encode(relay)) and b"payload" not in sparse and b"first_seq" not in sparse
    cleared = KvRelay(worker_id="w1", kind="cleared")
    assert decode(KvRelay, encode_sparse(cleared)) == cleared


def test_applied_in_slices_it_pauses_every_so_many_blocks_and_ends_where_apply_ends():
    batches = random_batches(11, 60)
    whole, sliced = BlockTranslator(), BlockTranslator()
    for events in batches:
        expected = whole.apply(events)
        got = BlockDelta()
        pauses = sum(1 for _ in sliced.apply_in_slices(iter(events), got, blocks=3))
        assert (got.reset, got.stored, got.removed, got.applied) == \
            (expected.reset, expected.stored, expected.removed, expected.applied)
        touched = sum(len(e.block_hashes) if not isinstance(e, AllBlocksCleared) else 1 for e in events)
        assert touched // 3 - len(events) <= pauses <= touched // 3  # whole events: a slice may run over
    assert dict(sliced.held()) == dict(whole.held())


def test_a_prompts_blocks_stored_one_event_each_are_applied_a_slice_at_a_time():
    chain = [stored([i + 1], toks(4, 100 + 4 * i), parent=i or None) for i in range(100)]
    t = BlockTranslator()
    d = BlockDelta()
    pauses = list(t.apply_in_slices(chain, d, blocks=32))
    assert len(pauses) == 3 and d.blocks() == (100, 0) and d.applied == {"BlockStored": 100}
    assert d.stored == {4: set(block_hashes(toks(400), 4))}


def per_block_chains(seed: int, n: int) -> list[list]:
    """SGLang-style batches: one BlockStored per block, chained, some chains broken (another LoRA,
    a parent never stored, a bad token id), with removals in between."""
    rng = random.Random(seed)
    out, next_hash, cached = [], 1, []
    for _ in range(n):
        events: list = []
        parent = rng.choice(cached) if cached and rng.random() < 0.5 else None
        for _ in range(rng.randint(1, 40)):
            roll = rng.random()
            tokens = [rng.randrange(30) for _ in range(4)]
            if roll < 0.03:
                tokens[2] = -1  # unhashable: this event is malformed, its children orphans
            ev = stored([next_hash], tokens, parent)
            if roll > 0.97:
                ev.lora_id = 7
            elif 0.93 < roll <= 0.97:
                ev.parent_block_hash = 10**9  # never stored
            events.append(ev)
            cached.append(next_hash)
            parent, next_hash = next_hash, next_hash + 1
            if rng.random() < 0.05:
                gone = rng.sample(cached, min(len(cached), 2))
                events.append(BlockRemoved(block_hashes=gone))
                cached = [h for h in cached if h not in gone]
        out.append(events)
    return out


@pytest.mark.parametrize("slice_blocks", [1, 5, 32])
def test_one_block_events_applied_in_slices_of_any_size_give_what_apply_gives(slice_blocks):
    whole, sliced = BlockTranslator(), BlockTranslator()
    for events in per_block_chains(4, 80):
        expected = whole.apply(events)
        got = BlockDelta()
        for _ in sliced.apply_in_slices(events, got, blocks=slice_blocks):
            pass
        assert got == expected
    assert dict(sliced.held()) == dict(whole.held())


# --- small pages indexed in larger blocks (kv_coarse) ----------------------------------------------

def pages(tokens: list[int], first_hash: int, parent: int | None = None, size: int = 1) -> BlockStored:
    """SGLang-style: one page per ``size`` tokens, engine hashes counting up from ``first_hash``."""
    n = len(tokens) // size
    return BlockStored(block_hashes=list(range(first_hash, first_hash + n)), parent_block_hash=parent,
                       token_ids=tokens, block_size=size)


def test_pages_of_one_token_are_indexed_in_blocks_of_the_index_size_and_a_partial_block_is_not():
    t = BlockTranslator(index_size=4)
    d = t.apply([pages(toks(10), 1)])
    assert d.stored == {4: set(block_hashes(toks(10), 4))}  # two blocks; tokens 8 and 9 wait for more
    assert dict(t.held()) == {4: set(block_hashes(toks(10), 4))}


def test_a_prefix_stored_over_several_events_gets_the_hashes_of_one_stored_at_once():
    t = BlockTranslator(index_size=4)
    t.apply([pages(toks(10), 1)])  # pages 1..10
    more = t.apply([pages(toks(7, 110), 11, parent=10)])  # the conversation's next turn: tokens 10..16
    whole = toks(17)
    assert more.stored == {4: set(block_hashes(whole, 4)[2:])} and more.removed == {4: set()}
    assert set(t.held()[4]) == set(block_hashes(whole, 4))


def test_a_branch_from_inside_a_block_chains_from_the_blocks_before_it():
    t = BlockTranslator(index_size=4)
    t.apply([pages(toks(8), 1)])
    branch = t.apply([pages([7, 7, 7, 7, 7], 50, parent=6)])  # shares tokens 0..5, then differs
    expect = block_hashes(toks(6) + [7, 7, 7, 7, 7], 4)
    assert branch.stored == {4: {expect[1]}}  # block 0 is shared (held already); block 1 is new
    assert set(t.held()[4]) == set(block_hashes(toks(8), 4)) | {expect[1]}


def test_the_tail_evicted_first_takes_its_block_with_the_page_that_completes_it():
    t = BlockTranslator(index_size=4)
    t.apply([pages(toks(8), 1)])
    first, second = block_hashes(toks(8), 4)
    gone = t.apply([BlockRemoved(block_hashes=[8, 7])])  # pages 8 and 7: block 1 is no longer whole
    assert gone.removed == {4: {second}} and gone.stored == {4: set()}
    assert t.apply([BlockRemoved(block_hashes=[6, 5])]).blocks() == (0, 0)  # inside no held block
    back = t.apply([pages(toks(4, 104), 15, parent=4)])  # recomputed under new engine hashes
    assert back.stored == {4: {second}} and set(t.held()[4]) == {first, second}


def test_pages_that_do_not_divide_the_index_size_are_indexed_as_they_are():
    t = BlockTranslator(index_size=4)
    d = t.apply([stored([1, 2], toks(6), size=3), stored([3], toks(8, 300), size=8)])
    assert d.stored == {3: set(block_hashes(toks(6), 3)), 8: set(block_hashes(toks(8, 300), 8))}


def test_coarse_orphans_unknown_removals_and_bad_tokens_are_counted_and_cleared_resets():
    t = BlockTranslator(index_size=4)
    d = t.apply([pages(toks(4), 1, parent=999), BlockRemoved(block_hashes=[12345]),
                 pages([1, 2, -3, 4], 20)])
    assert (d.orphaned, d.unknown_removed, d.malformed) == (4, 1, 1) and not any(t.held().values())
    t.apply([pages(toks(4), 1)])
    again = t.apply([AllBlocksCleared(), pages(toks(4), 1)])
    assert again.reset and again.stored == {4: set(block_hashes(toks(4), 4))}


@pytest.mark.parametrize(("page", "index_size", "per_page"), [(1, 4, True), (1, 4, False), (2, 8, True),
                                                             (4, 16, False)])
def test_a_random_engine_history_leaves_held_exactly_the_whole_blocks_of_the_engines_pages(page, index_size, per_page):
    """An engine with a prefix tree of pages (children hashed from parent and tokens, as engines do),
    storing runs under any page it holds and evicting leaves, in one event per run or (SGLang) per
    page; after every batch the translator holds exactly the index blocks all of whose pages the
    engine holds."""
    rng = random.Random(page * 1000 + index_size + per_page)
    t = BlockTranslator(index_size=index_size)
    parent_of: dict[int, int | None] = {}  # engine hash -> parent engine hash (the held pages)
    tokens_of: dict[int, list[int]] = {}

    def path(h: int) -> list[int]:
        out: list[int] = []
        while h is not None:
            out[:0] = tokens_of[h]
            h = parent_of[h]
        return out

    def expected() -> set[int]:
        want = set()
        for h in parent_of:
            tokens = path(h)
            if len(tokens) % index_size == 0:
                want.add(block_hashes(tokens, index_size)[-1])
        return want

    for _ in range(150):
        batch = []
        for _ in range(rng.randint(1, 3)):
            if parent_of and rng.random() < 0.35:  # evict a few leaves, tail first
                gone = []
                for _ in range(rng.randint(1, 6)):
                    leaves = [h for h in parent_of if h not in set(parent_of.values())]
                    if not leaves:
                        break
                    leaf = rng.choice(leaves)
                    gone.append(leaf)
                    del parent_of[leaf], tokens_of[leaf]
                batch += [BlockRemoved(block_hashes=[h]) for h in gone] if per_page else [BlockRemoved(gone)]
                continue
            under = rng.choice([None, *parent_of]) if parent_of else None
            run, hashes, prev = [], [], under
            for _ in range(rng.randint(1, 3 * index_size // page)):
                chunk = [rng.randrange(4) for _ in range(page)]  # few values: shared prefixes happen
                h = hash((prev, tuple(chunk))) & (2**63 - 1)
                if h in parent_of and parent_of[h] != prev:
                    break
                parent_of[h], tokens_of[h] = prev, chunk
                hashes.append(h)
                run.extend(chunk)
                prev = h
            if hashes and per_page:
                parents = [under, *hashes[:-1]]
                batch += [BlockStored(block_hashes=[h], parent_block_hash=p, token_ids=run[i * page:(i + 1) * page],
                                      block_size=page) for i, (h, p) in enumerate(zip(hashes, parents))]
            elif hashes:
                batch.append(BlockStored(block_hashes=hashes, parent_block_hash=under, token_ids=run,
                                         block_size=page))
        delta = BlockDelta()
        for _ in t.apply_in_slices(batch, delta, blocks=rng.choice([1, 3, 32])):
            pass
        assert not (delta.orphaned or delta.unknown_removed or delta.malformed)
        assert delta.applied == {k: v for k, v in (("BlockStored", sum(type(e) is BlockStored for e in batch)),
                                                   ("BlockRemoved", sum(type(e) is BlockRemoved for e in batch))) if v}
        assert set(t.held().get(index_size, ())) == expected()


def test_a_bad_token_inside_a_run_of_one_page_events_costs_that_event_and_what_hangs_from_it():
    t = BlockTranslator(index_size=2)
    events = [BlockStored([i + 1], i or None, [tok], 1) for i, tok in enumerate([5, 6, -7, 8])]
    d = t.apply(events)
    assert (d.malformed, d.orphaned) == (1, 1) and d.applied == {"BlockStored": 2}
    assert d.stored == {2: set(block_hashes([5, 6], 2))}


def _older_dump(state: dict) -> dict:
    """A dump as agents wrote it before session 25: maps as lists of pairs, no folded block counts."""
    pairs = lambda packed: [list(kv) for kv in unpack_map(packed).items()]  # noqa: E731
    return {**state, "sizes": {size: pairs(m) for size, m in state["sizes"].items()},
            "coarse": [{k: pairs(v) if k == "pages" else v for k, v in c.items() if k != "refs"}
                       for c in state["coarse"]]}


def _hashes_from(offset: int, events: list) -> list:
    """The events with every engine hash moved by ``offset`` (SGLang's are signed 64-bit, vLLM's not)."""
    moved = lambda h: None if h is None else h + offset  # noqa: E731
    return [BlockStored([moved(h) for h in e.block_hashes], moved(e.parent_block_hash), e.token_ids, e.block_size)
            if type(e) is BlockStored else BlockRemoved([moved(h) for h in e.block_hashes])
            if type(e) is BlockRemoved else e for e in events]


@pytest.mark.parametrize("hashes", [0, -(1 << 63), (1 << 64) - 10**6], ids=["small", "signed", "unsigned"])
@pytest.mark.parametrize("dump", ["columns", "older-pairs"])
@pytest.mark.parametrize("index_size", [None, 8], ids=["pages", "folded-pages"])
def test_a_translator_rebuilt_from_its_dump_continues_exactly_as_the_original(index_size, dump, hashes):
    """What an index reads from the worker-agent (``/kv_state``) when it starts following an engine
    late: the next batches, stored on top of old blocks or removing them, must give the same changes
    as the translator that saw the whole history (not orphans, not unknown removals). Whatever the
    engine's hash range, and from an older agent's dump too."""
    batches = [_hashes_from(hashes, events) for events in random_batches(11, 300)]
    original = BlockTranslator(index_size)
    for events in batches[:150]:
        original.apply(events)
    state = dump_translator(original)
    state = _older_dump(state) if dump == "older-pairs" else state
    restored = load_translator(msgpack.unpackb(msgpack.packb(state), strict_map_key=False))
    assert {s: set(h) for s, h in restored.held().items()} == {s: set(h) for s, h in original.held().items()}
    for events in batches[150:]:
        a, b = original.apply(events), restored.apply(events)
        assert (a.reset, a.stored, a.removed, a.orphaned, a.unknown_removed) == (
            b.reset, b.stored, b.removed, b.orphaned, b.unknown_removed)
    assert {s: set(h) for s, h in restored.held().items()} == {s: set(h) for s, h in original.held().items()}


@pytest.mark.parametrize("values, packed_as", [
    ([3, -5, 1 << 62], "q"), ([(1 << 64) - 1, 0], "Q"), ([-1, 1 << 63], None), ([], "q"),
])
def test_integer_columns_keep_every_value_in_the_smallest_type_that_holds_them(values, packed_as):
    packed = pack_column(values)
    assert (packed["t"] if isinstance(packed, dict) else None) == packed_as
    assert unpack_column(msgpack.unpackb(msgpack.packb(packed))) == values
    with pytest.raises((ValueError, KeyError, TypeError)):
        unpack_map({"k": pack_column([1, 2]), "v": pack_column([1])})

