"""Deterministic mode's placement policy: aligned targets and the pads that steer a batch onto them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from skippy_cache.cells import CellMap
from skippy_cache.placement import (
    ALIGN,
    aligned_target,
    cover_plan,
    order_pad,
    pad_needed,
    room_targets,
    rooms_mask,
)


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


def test_order_pad_is_zero_when_the_rows_already_land_past_the_cell():
    cells = CellMap(256)
    cells.decode([(0, 0, 10)])
    assert order_pad(cells, [(cells.last_cell(0), 1)], n_tokens=2) == 0


def test_order_pad_fills_the_free_cells_before_the_sequence_s_last_cell():
    cells = CellMap(256)
    cells.decode([(0, 0, 10), (1, 0, 10)])  # seq 1 on cells 10..19
    cells.seq_rm(0)  # head -> 0: cells 0..9 come first
    assert order_pad(cells, [(cells.last_cell(1), 1)], n_tokens=2) == 10
    cells.decode([(7, 0, 10)])  # the pad
    assert cells.find_slot(2)[0] == 20


def test_order_pad_is_none_when_too_few_cells_lie_past_the_sequence():
    cells = CellMap(64)
    cells.decode([(0, 0, 62)])
    cells.seq_rm(0, 0, 10)
    assert order_pad(cells, [(cells.last_cell(0), 3)], n_tokens=3) is None


def test_order_pad_puts_each_run_past_its_own_sequence_only():
    cells = CellMap(256)
    cells.decode([(0, 0, 10), (1, 0, 100)])  # seq 0 on cells 0..9, seq 1 on 10..109
    cells.seq_rm(1, 0, 50)  # cells 10..59 free again
    cells.head = 0
    # Seq 0's row may take cell 10; seq 1's must come past 109: pad the 49 free cells between.
    assert order_pad(cells, [(cells.last_cell(0), 1), (cells.last_cell(1), 1)], n_tokens=2) == 49
    # In the other order seq 1's row comes first, so every free cell up to 109 is padded.
    assert order_pad(cells, [(cells.last_cell(1), 1), (cells.last_cell(0), 1)], n_tokens=2) == 50


def test_order_pad_keeps_a_run_off_the_allocator_s_wrap():
    cells = CellMap(128)
    cells.decode([(0, 0, 120)])
    cells.seq_rm(0, 0, 5)  # cells 0..4 free, 5..119 held, 120..127 free
    cells.head = 120  # the search goes 120..127, then wraps to 0..4
    # Three rows of a new sequence fit before the wrap.
    assert order_pad(cells, [(-1, 3)], n_tokens=3) == 0
    # Ten would straddle it and land out of position order (127, then 0): no pad helps.
    assert order_pad(cells, [(-1, 10)], n_tokens=10) is None


@given(
    held=st.lists(st.booleans(), min_size=8, max_size=200),
    above=st.integers(-1, 199),
    n_rows=st.integers(1, 8),
    extra=st.integers(0, 1),
)
def test_after_order_pad_the_rows_land_past_the_cell(held, above, n_rows, extra):
    # Pads take the first free cells in the allocator's search order, as the batch after
    # them does; with the head at 0 both searches start there.
    n = len(held)
    cells = CellMap(n)
    cells.decode([(1, 0, n)])  # seq 1 on every cell, position == cell
    for cell, used in enumerate(held):
        if not used:
            cells.seq_rm(1, cell, cell + 1)
    cells.head = 0
    above = min(above, n - 1)
    n_tokens = n_rows + extra
    pad = order_pad(cells, [(above, n_rows)], n_tokens)
    free_past = sum(not held[c] for c in range(above + 1, n))
    # Searching from cell 0, every free cell up to `above` comes first: those are the pads.
    assert (pad is None) == (free_past < n_tokens)
    if pad is None:
        return
    assert pad == sum(not held[c] for c in range(above + 1))
    if pad:
        cells.decode([(7, 0, pad)])
        cells.head = 0
    slot = cells.find_slot(n_tokens)
    assert slot is not None and min(slot[:n_rows]) > above


PAD = 7


def test_rooms_mask_holds_the_cells_past_each_lane_s_last_cell():
    mask = rooms_mask(100, [(9, 5), (-1, 10), (40, 0), (95, 10)])
    assert mask.nonzero()[0].tolist() == [10, 11, 12, 13, 14, 96, 97, 98, 99]


def test_aligned_target_keeps_off_taken_cells():
    cells = CellMap(512)
    cells.decode([(0, 0, 64)])
    taken = (cells.holders != 0) | rooms_mask(512, [(63, 100)])  # the lane at 0..63 grows into 64..163
    assert aligned_target(cells, 63, first_pos=0, length=64) == 64
    assert aligned_target(cells, 63, first_pos=0, length=64, taken=taken) == 192
    taken[:64] = False  # as if the lane's cells were freed
    assert aligned_target(cells, -1, first_pos=0, length=64, taken=taken) == 0


def test_room_targets_are_the_cells_right_past_each_lane():
    cells = CellMap(256)
    cells.decode([(0, 0, 10)])  # lane 0 on 0..9
    cells.decode([(PAD, 0, 20)])  # pads on 10..29
    cells.decode([(1, 0, 10)])  # lane 1 on 30..39
    assert room_targets(cells, [(9, 2), (39, 1)], PAD) == [10, 11, 40]
    # Past lane 0 sit the pads, then lane 1's cells: 21 rows would reach them.
    assert room_targets(cells, [(9, 21)], PAD) is None
    # The allocator hands out cells in its search order: lane 1's run cannot come first.
    assert room_targets(cells, [(39, 1), (9, 1)], PAD) is None
    assert room_targets(cells, [(-1, 1)], PAD) is None


def _apply(cells: CellMap, plan: tuple[int, list[tuple[int, int]]]) -> None:
    total, punch = plan
    if total:
        assert cells.restore(PAD, total) is not None
    for p0, p1 in punch:
        cells.seq_rm(PAD, p0, p1)


def test_a_lane_s_next_row_punched_out_of_its_padded_room_needs_no_import():
    cells = CellMap(256)
    cells.decode([(0, 0, 10), (PAD, 0, 20), (1, 0, 10)])  # lane 0: 0..9, pads 10..29, lane 1: 30..39
    cells.head = 40
    plan = cover_plan(cells, PAD, [10, 40], n_tokens=2)
    assert plan == (0, [(0, 1)])
    _apply(cells, plan)
    assert cells.find_slot(2) == [10, 40]


@given(
    held=st.lists(st.sampled_from([0, 0, 1, 2]), min_size=16, max_size=160),
    lanes=st.lists(st.tuples(st.integers(0, 159), st.integers(1, 4)), min_size=1, max_size=4),
    head=st.integers(0, 160),
    pad_row=st.integers(0, 1),
)
def test_after_a_cover_plan_the_rows_land_on_their_targets(held, lanes, head, pad_row):
    # Cells are free (0), another sequence's (1) or pads (2); each lane's last cell is taken
    # from `lanes`. Whatever the pool, a plan that is returned lands every row on its target.
    n = len(held)
    cells = CellMap(n)
    cells.decode([(9, 0, n)])
    for cell, kind in enumerate(held):
        if kind != 1:
            cells.seq_rm(9, cell, cell + 1)
    cells.head = 0
    pads = [cell for cell, kind in enumerate(held) if kind == 2]
    if pads:
        free_before = [c for c in range(n) if held[c] == 0 or held[c] == 2]
        # Pads land on the first free cells: make the free cells before them pads, in order.
        cells.decode([(PAD, 0, free_before.index(pads[-1]) + 1)])
    cells.head = min(head, n)
    runs = sorted({(min(last, n - 1), rows) for last, rows in lanes})
    targets = room_targets(cells, runs, PAD)
    if targets is None:
        return
    n_tokens = len(targets) + pad_row
    plan = cover_plan(cells, PAD, targets, n_tokens)
    if plan is None:
        return
    _apply(cells, plan)
    cells.check_invariants()
    assert cells.find_slot(n_tokens)[: len(targets)] == targets
