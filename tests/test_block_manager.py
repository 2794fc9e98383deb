import pytest

from engine.block_manager import BlockManager, OutOfBlocks


def test_allocate_maps_positions_to_slots():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(7, 6)
    table = bm.block_table(7)
    assert len(table) == 2 and bm.num_free == 2 and bm.length(7) == 6
    assert bm.slots(7, 0, 6) == [table[p // 4] * 4 + p % 4 for p in range(6)]
    bm.allocate(7, 3)                         # crosses into a third block
    table = bm.block_table(7)
    assert len(table) == 3 and bm.slots(7, 6, 9) == [table[p // 4] * 4 + p % 4 for p in range(6, 9)]


def test_exhaustion_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate(1, 5)
    before = (bm.num_free, list(bm.block_table(1)), bm.length(1))
    with pytest.raises(OutOfBlocks, match="exhausted"):
        bm.allocate(1, 8)
    assert (bm.num_free, bm.block_table(1), bm.length(1)) == before
    with pytest.raises(OutOfBlocks):
        bm.allocate(2, 9)
    assert 2 not in bm.tables                 # a failed first allocation leaves no empty table behind


def test_truncate_rolls_back_and_frees_whole_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(1, 5)
    bm.allocate(1, 10)                        # a speculative tree appended: 15 tokens, 4 blocks
    assert bm.num_free == 4
    bm.truncate(1, 6)                         # 2 accepted drafts kept
    assert bm.length(1) == 6 and len(bm.block_table(1)) == 2 and bm.num_free == 6
    bm.allocate(1, 2)
    assert bm.length(1) == 8 and len(bm.block_table(1)) == 2
    with pytest.raises(ValueError):
        bm.truncate(1, 9)


def test_free_returns_every_block_and_blocks_are_reused():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate(1, 6)
    assert bm.num_free == 0
    old = set(bm.block_table(1))
    bm.free(1)
    assert bm.num_free == 3 and bm.length(1) == 0
    bm.allocate(2, 6)
    assert set(bm.block_table(2)) == old


def test_slots_out_of_range():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate(1, 3)
    with pytest.raises(IndexError):
        bm.slots(1, 0, 4)
