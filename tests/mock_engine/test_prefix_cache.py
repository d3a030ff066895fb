"""The paged prefix cache on its own: reuse, reference counts, LRU and tail-first eviction, events."""

import random

import pytest

from infera_mock_engine.block_hasher import BlockHasher
from infera_mock_engine.kv_blocks import blocks_for
from infera_mock_engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from infera_mock_engine.prefix_cache import PrefixCache

BS = 4


def toks(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def run_seq(cache: PrefixCache, sid, tokens: list[int], extra: int = 1) -> int:
    """Admit, compute every token, release: the sequence's full blocks end up cached. Returns the hit."""
    hit = cache.admit(sid, tokens, len(tokens) + extra)
    assert hit is not None
    cache.commit(sid, tokens, len(tokens))
    cache.release(sid)
    return hit


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 64) for n in (0, 1, 63, 64, 65, 128, 129)] == [0, 1, 1, 1, 2, 2, 3]


def test_admit_grow_release_accounting_and_refusal_without_change():
    cache = PrefixCache(num_blocks=4, block_size=16)
    assert cache.admit("a", toks(0, 35), 35) == 0  # 3 blocks
    assert (cache.used_blocks, cache.free_blocks, cache.usage) == (3, 1, 0.75)
    assert cache.grow("a", 48) and cache.held("a") == 3
    assert not cache.grow("a", 65)  # needs 2 more, 1 free
    assert cache.held("a") == 3
    assert cache.admit("b", toks(100, 17), 17) is None  # needs 2
    assert cache.held("b") == 0 and cache.used_blocks == 3
    assert cache.release("a") == 3 and cache.used_blocks == 0
    assert cache.capacity_tokens == 64 and cache.fits_at_all(64) and not cache.fits_at_all(65)
    cache.verify()


def test_a_repeated_prompt_reuses_its_full_blocks_but_recomputes_the_last_token():
    cache = PrefixCache(16, BS)
    prompt = toks(0, 10)  # 2 full blocks + 2 tokens
    assert run_seq(cache, "a", prompt) == 0
    assert cache.match(prompt) == 8
    assert run_seq(cache, "b", prompt) == 8
    exact = toks(50, 8)  # exactly 2 blocks: the second cannot be a hit, its last token must be computed
    run_seq(cache, "c", exact)
    assert cache.match(exact) == 4
    assert cache.match(prompt[:4] + [999] * 6) == 4  # shares only the first block
    assert cache.match([999] + prompt[1:]) == 0  # chained: a different first block changes everything


def test_running_sequences_share_blocks_and_finished_ones_stay_cached():
    cache = PrefixCache(16, BS)
    prompt = toks(0, 9)
    cache.admit("a", prompt, 10)
    cache.commit("a", prompt, 9)
    assert cache.admit("b", prompt, 10) == 8  # a is still running: its full blocks are shared
    assert cache.used_blocks == 3 + 1  # a: 3 blocks; b: the 2 shared + 1 of its own
    cache.release("a")
    cache.release("b")
    assert cache.used_blocks == 0 and cache.usage == 0.0  # usage counts referenced blocks only
    assert cache.cached_blocks == 2 and cache.evictable_blocks == 2
    cache.verify()


def test_unreferenced_chains_are_evicted_lru_first_and_tail_first():
    cache = PrefixCache(6, BS)
    a, b = toks(0, 12), toks(100, 12)  # 3 full blocks each; run_seq needs a 4th for the next token
    run_seq(cache, "a", a, extra=0)
    run_seq(cache, "b", b, extra=0)
    a_hashes = cache.take_events()[0].block_hashes
    cache.take_events()
    assert cache.cached_blocks == 6 and cache.free_blocks == 6
    assert cache.admit("c", toks(500, 2), 2) == 0  # one block: evicts a's LAST block (a is LRU)
    assert cache.take_events() == [BlockRemoved([a_hashes[2]])]
    assert cache.match(a) == 8 and cache.match(b) == 8  # b's tail: last token recomputed anyway
    assert cache.admit("d", toks(600, 8), 8) == 0  # two more: a's remaining blocks, tail first
    assert cache.take_events() == [BlockRemoved([a_hashes[1]]), BlockRemoved([a_hashes[0]])]
    assert cache.match(a) == 0 and cache.match(b) == 8
    cache.verify()


def test_reuse_refreshes_a_chain_so_the_other_one_is_evicted_first():
    cache = PrefixCache(4, BS)
    a, b = toks(0, 8), toks(100, 8)
    run_seq(cache, "a", a, extra=0)
    run_seq(cache, "b", b, extra=0)
    assert run_seq(cache, "a2", a + [7], extra=0) == 8  # a touched again: b is now least recently used
    cache.take_events()
    cache.admit("c", toks(500, 4), 4)
    assert cache.match(a + [1]) == 8 and cache.match(b + [1]) == 4


def test_capacity_pressure_never_evicts_referenced_blocks():
    cache = PrefixCache(4, BS)
    a = toks(0, 12)
    cache.admit("a", a, 12)
    cache.commit("a", a, 12)
    cache.take_events()
    assert cache.admit("b", toks(100, 8), 8) is None  # 1 block free, a's 3 are referenced
    assert cache.take_events() == [] and cache.cached_blocks == 3
    assert cache.admit("b", toks(100, 4), 4) == 0
    cache.verify()


def test_store_events_chain_parents_across_commits_and_carry_the_block_tokens():
    cache = PrefixCache(16, BS, BlockHasher(b"seed", signed=True))
    seq = toks(0, 6)
    cache.admit("s", seq, 7)
    cache.commit("s", seq, 6)  # one full block
    (first,) = cache.take_events()
    assert isinstance(first, BlockStored) and first.parent_block_hash is None
    assert first.token_ids == seq[:4] and first.block_size == BS and len(first.block_hashes) == 1
    seq += [6, 7, 8, 9, 10, 11]  # decoding fills two more blocks
    cache.grow("s", 13)
    cache.commit("s", seq, 12)
    (cont,) = cache.take_events()
    assert cont.parent_block_hash == first.block_hashes[0]
    assert cont.token_ids == seq[4:12] and len(cont.block_hashes) == 2
    assert len(cont.token_ids) == len(cont.block_hashes) * BS
    assert cache.cached_hashes() == {*first.block_hashes, *cont.block_hashes}


def test_the_same_prefix_computed_twice_at_once_is_stored_once_and_shared():
    cache = PrefixCache(16, BS)
    p = toks(0, 9)
    cache.admit("a", p, 10)
    cache.admit("b", p, 10)  # admitted before a committed anything: no hit
    cache.commit("a", p, 9)
    cache.commit("b", p, 9)
    events = cache.take_events()
    assert len(events) == 1 and len(events[0].block_hashes) == 2
    assert cache.used_blocks == 4  # 2 shared + one partial block each
    cache.release("a")
    cache.release("b")
    assert cache.cached_blocks == 2
    cache.verify()


def test_clear_is_refused_while_blocks_are_referenced_then_drops_everything():
    cache = PrefixCache(8, BS)
    p = toks(0, 8)
    cache.admit("a", p, 9)
    cache.commit("a", p, 8)
    cache.take_events()
    assert not cache.clear() and cache.take_events() == []
    cache.release("a")
    assert cache.clear()
    assert cache.take_events() == [AllBlocksCleared()]
    assert cache.cached_blocks == 0 and cache.match(p + [1]) == 0 and cache.free_blocks == 8
    cache.verify()


def test_engine_hashes_depend_on_the_seed_and_sglang_style_ones_are_signed():
    tokens = [[i, i + 1, i + 2, i + 3] for i in range(50)]
    one, same, other = BlockHasher(b"x"), BlockHasher(b"x"), BlockHasher(b"y")
    assert [one.external(one.digest(None, t)) for t in tokens] == [same.external(same.digest(None, t)) for t in tokens]
    assert one.external(one.digest(None, tokens[0])) != other.external(other.digest(None, tokens[0]))
    unsigned = [one.external(one.digest(None, t)) for t in tokens]
    signed = [BlockHasher(b"x", signed=True).external(one.digest(None, t)) for t in tokens]
    assert all(0 <= h < 2**64 for h in unsigned)
    assert all(-(2**63) <= h < 2**63 for h in signed) and any(h < 0 for h in signed)


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_keep_every_invariant_and_the_events_add_up(seed):
    rng = random.Random(seed)
    cache = PrefixCache(num_blocks=24, block_size=BS, hasher=BlockHasher(b"p", signed=bool(seed % 2)))
    prefixes = [toks(1000 * i, rng.randint(4, 20)) for i in range(4)]  # shared system prompts
    live: dict[int, list[int]] = {}
    published: set[int] = set()
    for step in range(400):
        op = rng.random()
        if op < 0.35 or not live:
            tokens = rng.choice(prefixes) + [rng.randint(0, 50) for _ in range(rng.randint(1, 10))]
            hit = cache.admit(step, tokens, len(tokens) + 1)
            if hit is not None:
                assert hit % BS == 0 and hit < len(tokens)
                live[step] = tokens
        elif op < 0.7:
            sid = rng.choice(list(live))
            tokens = live[sid]
            cache.commit(sid, tokens, rng.randint(0, len(tokens)))
        elif op < 0.85:
            sid = rng.choice(list(live))
            live[sid].append(rng.randint(0, 50))
            if not cache.grow(sid, len(live[sid]) + 1):
                live[sid].pop()
        else:
            sid = rng.choice(list(live))
            cache.release(sid)
            del live[sid]
        if rng.random() < 0.02:
            cache.clear()
        for event in cache.take_events():
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * BS
                assert event.parent_block_hash is None or event.parent_block_hash in published
                assert not published & set(event.block_hashes)
                published |= set(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= published
                published -= set(event.block_hashes)
            else:
                published.clear()
        cache.verify()
        assert cache.used_blocks + cache.free_blocks == cache.num_blocks
        assert all(cache.ref_count(b) >= 0 for b in range(cache.num_blocks))
        assert published == cache.cached_hashes()
