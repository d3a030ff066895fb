"""The index key: chained XXH3-64 block hashes, the same for the router and the indexer."""

import struct
from array import array

import pytest
from xxhash import xxh3_64_intdigest

from infera_common.block_hash import ROOT, adapter_root, block_hashes, chain, pack_tokens, token_array, unpack_tokens


def test_the_definition_and_its_pinned_values():
    tokens = list(range(100, 108))
    first = xxh3_64_intdigest(struct.pack("<4I", 100, 101, 102, 103), ROOT)
    second = xxh3_64_intdigest(struct.pack("<4I", 104, 105, 106, 107), first)
    assert block_hashes(tokens, 4) == [first, second]
    # pinned: a router and an indexer of different releases must agree, or every query misses
    assert block_hashes(tokens, 4) == [16799746667763160996, 12319338517275567270]
    assert block_hashes([0, 2**32 - 1, 128255, 7], 2) == [8875325589831069942, 387019999641581226]


def test_an_adapters_chains_start_from_a_root_of_their_own():
    tokens = list(range(100, 108))
    assert adapter_root(None) == ROOT
    sql = adapter_root("sql-lora")
    assert sql == xxh3_64_intdigest(b"infera-lora\x00sql-lora")
    assert sql == 14285212072467619117  # pinned, as the base model's chains are
    assert len({ROOT, sql, adapter_root("sql-lora2"), adapter_root("SQL-lora")}) == 4
    under_sql = block_hashes(tokens, 4, sql)
    assert under_sql[1] == chain(under_sql[0], tokens[4:])  # the chain goes on as the base model's does
    assert not set(under_sql) & set(block_hashes(tokens, 4))


def test_full_blocks_only_and_a_prefix_identity():
    hashes = block_hashes(list(range(10)), 4)
    assert len(hashes) == 2  # the partial third block has no hash
    assert hashes[0] == chain(ROOT, [0, 1, 2, 3]) and hashes[1] == chain(hashes[0], [4, 5, 6, 7])
    # same block tokens under a different parent: a different hash
    assert block_hashes([4, 5, 6, 7], 4)[0] != hashes[1]
    assert block_hashes(list(range(8)), 8) != hashes[1:]
    assert block_hashes([1, 2, 3], 4) == []


def test_an_event_continues_its_parents_chain_as_the_router_hashes_the_whole_prompt():
    prompt = list(range(5000, 5000 + 64 * 5 + 9))
    whole = block_hashes(prompt, 64)
    head = block_hashes(prompt[:128], 64)  # one BlockStored ...
    tail = block_hashes(prompt[128:], 64, parent=head[-1])  # ... and the next, chained on its parent
    assert head + tail == whole and len(whole) == 5


def test_any_sequence_of_token_ids_hashes_the_same():
    tokens = [3, 1 << 20, 70000, 5]
    assert block_hashes(tokens, 2) == block_hashes(tuple(tokens), 2) == block_hashes(array("q", tokens), 2)
    assert block_hashes(tokens, 2) == block_hashes(token_array(tokens), 2)  # the zero-copy path
    assert block_hashes(tokens + [9], 2) == block_hashes(token_array(tokens + [9]), 2)  # and its partial tail


def test_packed_token_ids_round_trip_as_little_endian_words():
    tokens = [0, 1, 2**32 - 1, 70000]
    packed = pack_tokens(tokens)
    assert packed == struct.pack("<4I", *tokens)
    assert list(unpack_tokens(packed)) == tokens
    with pytest.raises(ValueError, match="4-byte"):
        unpack_tokens(packed[:-1])


@pytest.mark.parametrize("bad, error", [([-1, 2], OverflowError), ([2**32, 2], OverflowError),
                                        ([1.5, 2], TypeError), (["a", 2], TypeError)])
def test_token_ids_outside_32_bits_or_not_integers_raise(bad, error):
    with pytest.raises(error):
        block_hashes(bad, 2)
    with pytest.raises(error):
        token_array(bad)
    with pytest.raises(error):
        pack_tokens(bad)


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)
