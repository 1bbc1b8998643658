"""Deterministic mode's placement policy: aligned targets and the pad that steers a batch onto them."""

from __future__ import annotations

from skippy_cache.cells import CellMap
from skippy_cache.placement import ALIGN, aligned_target, pad_needed


def test_aligned_target_is_after_the_prefix_and_congruent_to_the_position():
    cells = CellMap(1024)
    cells.decode([(5, 0, 70)])  # someone else's cells 0..69
    cells.decode([(0, 0, 128)])  # a lane's prefix at 70..197
    target = aligned_target(cells, cells.last_cell(0), first_pos=128, length=100)
    assert target == 256
    assert target % ALIGN == 128 % ALIGN


def test_aligned_target_skips_runs_that_a_held_cell_breaks():
    cells = CellMap(1024)
    cells.decode([(0, 0, 300)])
    cells.seq_rm(0, 0, 200)  # cells 200..299 stay held
    cells.decode([(1, 0, 1)])  # cell 0
    cells.seq_cp(0, 2, 250, 251)
    cells.seq_rm(0)  # only cell 250 (seq 2) and cell 0 (seq 1) remain
    assert aligned_target(cells, -1, first_pos=0, length=64) == 64
    assert aligned_target(cells, -1, first_pos=0, length=200) == 256
    assert aligned_target(cells, -1, first_pos=3, length=100) == 3
    assert aligned_target(cells, -1, first_pos=3, length=250) == 259
    assert aligned_target(cells, -1, first_pos=0, length=769) is None


def test_pad_needed_counts_the_free_cells_before_the_target():
    cells = CellMap(1024)
    cells.decode([(0, 0, 200)])
    cells.seq_rm(0, 0, 40)  # head -> 0, cells 0..39 free
    assert pad_needed(cells, 256, 10) == 40 + (256 - 200)
    cells.decode([(7, 0, 96)])  # the pad: fills 0..39 and 200..255
    assert pad_needed(cells, 256, 10) == 0
    assert cells.find_slot(10) == list(range(256, 266))


def test_pad_needed_counts_around_the_wrap():
    cells = CellMap(128)
    cells.decode([(0, 0, 120)])
    cells.seq_rm(0, 0, 8)  # head -> 0
    cells.decode([(1, 0, 8)])  # head -> 8, cells 120..127 the only free ones
    cells.seq_rm(0, 100, -1)  # head stays at 8; frees 100..119
    cells.head = 126
    # 20 tokens: 126 <= used (100) + 40, the search starts at 126: 126, 127, then 100..109 after the wrap.
    assert pad_needed(cells, 110, 20) == 2 + 10
    # 10 tokens: 126 > 100 + 20, the restart rule starts it at 0: only 100..109.
    assert pad_needed(cells, 110, 10) == 10
