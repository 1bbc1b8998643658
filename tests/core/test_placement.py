"""The allocator mirror: first-fit from head, reset rule, head moves on removal."""

from __future__ import annotations

from skippy_cache.placement import ALIGN, CellMap


def test_fresh_pool_places_in_order_and_moves_head():
    cells = CellMap(256)
    assert cells.decode([(0, 0, 10), (1, 0, 5)]) == list(range(15))
    assert cells.head == 15
    assert cells.used == 15
    assert cells.seqs[1] == {p: 10 + p for p in range(5)}


def test_removal_moves_head_back_to_the_first_freed_cell():
    cells = CellMap(256)
    cells.decode([(0, 0, 100)])
    cells.decode([(1, 0, 50)])
    cells.seq_rm(0)
    assert cells.head == 0
    assert cells.find_slot(3) == [0, 1, 2]


def test_shared_cells_are_freed_only_by_their_last_holder():
    cells = CellMap(256)
    cells.decode([(0, 0, 64)])
    cells.seq_cp(0, 9, 0, 32)
    cells.seq_rm(0)
    assert cells.used == 32
    assert cells.seqs[9] == {p: p for p in range(32)}
    assert cells.head == 32


def test_search_restarts_from_zero_when_head_is_far_past_the_used_cells():
    cells = CellMap(1024)
    cells.decode([(0, 0, 600)])
    cells.decode([(1, 0, 10)])
    cells.seq_rm(0, 0, 600)  # head -> 0 (first freed)
    cells.head = 700  # as after a later decode that was since removed
    # 700 > used (10) + 2 * 4 -> the search starts at cell 0.
    assert cells.find_slot(4) == [0, 1, 2, 3]


def test_search_wraps_at_the_end():
    cells = CellMap(16)
    cells.decode([(0, 0, 12)])
    cells.seq_rm(0, 0, 4)
    cells.head = 12
    assert cells.find_slot(6) == [12, 13, 14, 15, 0, 1]


def test_aligned_target_is_after_the_prefix_and_congruent_to_the_position():
    cells = CellMap(1024)
    cells.decode([(5, 0, 70)])  # someone else's cells 0..69
    cells.decode([(0, 0, 128)])  # a lane's prefix at 70..197
    target = cells.aligned_target(cells.last_cell(0), first_pos=128, length=100)
    assert target == 256
    assert target % ALIGN == 128 % ALIGN


def test_pad_needed_counts_the_free_cells_before_the_target():
    cells = CellMap(1024)
    cells.decode([(0, 0, 200)])
    cells.seq_rm(0, 0, 40)  # head -> 0, cells 0..39 free
    assert cells.pad_needed(256, 10) == 40 + (256 - 200)
    cells.decode([(7, 0, 96)])  # the pad: fills 0..39 and 200..255
    assert cells.pad_needed(256, 10) == 0
    assert cells.find_slot(10) == list(range(256, 266))
