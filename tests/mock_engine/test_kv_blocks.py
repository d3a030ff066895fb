"""KV block accounting: ceil(tokens / page_size) blocks per sequence against a fixed pool."""

from infera_mock_engine.kv_blocks import KvBlockManager, blocks_for


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 64) for n in (0, 1, 63, 64, 65, 128, 129)] == [0, 1, 1, 1, 2, 2, 3]


def test_reserve_grows_and_release_frees():
    kv = KvBlockManager(num_blocks=10, page_size=16)
    assert kv.reserve("a", 35)  # 3 blocks
    assert (kv.used_blocks, kv.free_blocks, kv.usage) == (3, 7, 0.3)
    assert kv.reserve("a", 48)  # still 3
    assert kv.used_blocks == 3
    assert kv.reserve("a", 49)  # 4th block
    assert kv.held("a") == 4
    assert kv.release("a") == 4
    assert kv.used_blocks == 0 and kv.usage == 0.0


def test_reserve_fails_without_change_when_blocks_run_out():
    kv = KvBlockManager(num_blocks=4, page_size=16)
    assert kv.reserve("a", 48)
    assert not kv.can_reserve("b", 17)
    assert not kv.reserve("b", 17)  # needs 2, 1 free
    assert kv.held("b") == 0 and kv.used_blocks == 3
    assert kv.reserve("b", 16)


def test_capacity_and_fit():
    kv = KvBlockManager(num_blocks=4, page_size=16)
    assert kv.capacity_tokens == 64
    assert kv.fits_at_all(64) and not kv.fits_at_all(65)
    assert kv.lookup_prefix([1, 2, 3]) == 0  # no prefix cache yet
