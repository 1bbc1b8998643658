"""CellMap: the mirror of llama.cpp's unified KV pool (distinct cells, placement, head)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_cache.cells import CellMap

LANE0, LANE1, ENTRY_A, ENTRY_B = 0, 1, 8, 9


# -- distinct-cell accounting ----------------------------------------------------------------


def test_empty_map() -> None:
    cells = CellMap(4096)
    assert cells.used_cells == 0
    assert cells.free_cells == 4096
    assert cells.pos_max(LANE0) == -1
    assert cells.seq_len(LANE0) == 0
    assert cells.last_cell(LANE0) == -1
    assert cells.sequences() == []
    assert cells.cells_freed_by_removing({LANE0}) == 0
    cells.check_invariants()


def test_view_runs_to_the_highest_used_cell() -> None:
    # llama.cpp's KV view spans every cell up to the highest used one, free cells below it included.
    cells = CellMap(4096)
    assert cells.view == 0
    cells.decode([(LANE0, 0, 300), (LANE1, 0, 200)])
    assert cells.view == 500
    cells.seq_rm(LANE0)
    assert cells.view == 500
    cells.seq_rm(LANE1)
    assert cells.view == 0


def test_seq_cp_shares_cells() -> None:
    cells = CellMap(4096)
    cells.decode([(LANE0, 0, 300)])
    assert cells.used_cells == 300
    cells.seq_cp(LANE0, ENTRY_A, 0, 256)
    assert cells.used_cells == 300  # shared, not copied
    assert cells.seq_len(ENTRY_A) == 256
    assert cells.pos_max(ENTRY_A) == 255
    assert cells.free_cells == 4096 - 300
    assert cells.seq_cells(ENTRY_A) == {p: p for p in range(256)}
    assert cells.holders[:256].tolist() == [2] * 256
    assert cells.sequences() == [LANE0, ENTRY_A]
    cells.check_invariants()


def test_removing_the_lane_keeps_the_entry_cells() -> None:
    cells = CellMap(4096)
    cells.decode([(LANE0, 0, 300)])
    cells.seq_cp(LANE0, ENTRY_A, 0, 256)
    assert cells.cells_freed_by_removing({LANE0}) == 44
    assert cells.cells_freed_by_removing({ENTRY_A}) == 0
    assert cells.cells_freed_by_removing({LANE0, ENTRY_A}) == 300
    cells.seq_rm(LANE0)
    assert cells.used_cells == 256
    assert cells.pos_max(LANE0) == -1
    assert cells.seq_len(ENTRY_A) == 256
    assert cells.head == 256  # the first cell freed
    cells.check_invariants()


def test_entry_recorded_from_a_lane_started_from_an_entry_shares_cells() -> None:
    cells = CellMap(4096)
    cells.decode([(LANE0, 0, 300)])
    cells.seq_cp(LANE0, ENTRY_A, 0, 256)
    cells.seq_rm(LANE0)
    # A hit: lane 1 starts from entry A, then prefills its own suffix.
    cells.seq_cp(ENTRY_A, LANE1, 0, 256)
    cells.decode([(LANE1, 256, 400)])
    cells.seq_cp(LANE1, ENTRY_B, 0, 384)
    # A's 256 cells are held by A, lane 1 and B; the suffix adds 144. The naive
    # per-sequence sum would be 256 + 400 + 384.
    assert cells.used_cells == 400
    assert cells.cells_freed_by_removing({LANE1}) == 16
    assert cells.cells_freed_by_removing({ENTRY_A}) == 0
    assert cells.cells_freed_by_removing({ENTRY_B, LANE1}) == 144
    assert cells.cells_freed_by_removing({ENTRY_A, ENTRY_B, LANE1}) == 400
    # Cells held, shared ones counted once: what the pool audit compares with used cells.
    assert cells.cells_held({ENTRY_A}) == 256
    assert cells.cells_held({ENTRY_A, ENTRY_B}) == 384
    assert cells.cells_held({ENTRY_A, ENTRY_B, LANE1, LANE0}) == cells.used_cells == 400
    assert cells.cells_held({LANE0}) == cells.cells_held(set()) == 0
    cells.check_invariants()


def test_regression_reused_lane_id_does_not_share_with_longer_entry() -> None:
    # Lane 0's second run must not be mistaken for a continuation of its first:
    # entry A holds the first run's cells 100..300, the new run's 100..200 are fresh.
    cells = CellMap(4096)
    cells.decode([(LANE0, 0, 300)])
    cells.seq_cp(LANE0, ENTRY_A, 0, 300)
    cells.seq_rm(LANE0)
    cells.seq_cp(ENTRY_A, LANE0, 0, 100)
    assert cells.decode([(LANE0, 100, 200)]) == list(range(300, 400))
    assert cells.used_cells == 300 + 100
    assert cells.cells_freed_by_removing({ENTRY_A}) == 200
    assert cells.cells_freed_by_removing({LANE0}) == 100
    cells.seq_rm(ENTRY_A)
    assert cells.used_cells == 200
    assert cells.head == 100  # cells 100..299 freed
    cells.check_invariants()


def test_regression_truncated_lane_does_not_share_with_longer_entry() -> None:
    # Same failure through a partial removal (a lane rolled back to a shorter prefix).
    cells = CellMap(4096)
    cells.decode([(LANE0, 0, 300)])
    cells.seq_cp(LANE0, ENTRY_A, 0, 300)
    cells.seq_rm(LANE0, 100, -1)
    assert cells.pos_max(LANE0) == 99
    assert cells.head == 300  # nothing freed: entry A still holds 100..299
    cells.decode([(LANE0, 100, 200)])
    assert cells.used_cells == 400
    cells.check_invariants()


def test_partial_copy_from_the_middle_of_a_run() -> None:
    # A sub-range copy (the radix index reusing part of a longer entry) holds
    # cells strictly inside another sequence's run: counted once, not truncated.
    cells = CellMap(1000)
    cells.decode([(LANE0, 0, 40)])
    cells.seq_cp(LANE0, ENTRY_A, 10, 20)
    assert cells.used_cells == 40
    assert cells.seq_len(ENTRY_A) == 10
    assert cells.pos_max(ENTRY_A) == 19
    assert cells.cells_freed_by_removing({LANE0}) == 30
    cells.seq_rm(LANE0)
    assert cells.used_cells == 10
    assert cells.head == 0
    assert cells.find_slot(12) == list(range(10)) + [20, 21]  # around entry A's cells
    cells.check_invariants()


def test_token_by_token_decode_counts_each_cell_once() -> None:
    cells = CellMap(4096)
    cells.decode([(LANE0, 0, 64)])
    cells.seq_cp(LANE0, ENTRY_A, 0, 64)
    for pos in range(64, 1064):
        assert cells.decode([(LANE0, pos, pos + 1)]) == [pos]
    assert cells.used_cells == 1064
    assert cells.seq_len(LANE0) == 1064
    assert cells.pos_max(LANE0) == 1063
    assert cells.last_cell(LANE0) == 1063
    assert cells.cells_freed_by_removing({LANE0}) == 1000
    cells.check_invariants()


def test_pos_max_mirrors_llama() -> None:
    cells = CellMap(100)
    assert cells.pos_max(3) == -1
    cells.decode([(3, 0, 10)])
    assert cells.pos_max(3) == 9
    cells.seq_rm(3, 5, -1)
    assert cells.pos_max(3) == 4
    cells.seq_rm(3, 0, 2)
    assert (cells.pos_max(3), cells.seq_len(3)) == (4, 3)
    assert cells.seq_cells(3) == {2: 2, 3: 3, 4: 4}
    cells.seq_rm(3, -1, -1)
    assert cells.pos_max(3) == -1
    assert cells.used_cells == 0
    assert cells.sequences() == []
    cells.check_invariants()


def test_open_bounds_copy_everything() -> None:
    cells = CellMap(100)
    cells.decode([(LANE0, 0, 50)])
    cells.seq_cp(LANE0, ENTRY_A, -1, -1)
    assert cells.seq_len(ENTRY_A) == 50
    assert cells.used_cells == 50
    cells.seq_rm(ENTRY_A, 40)
    assert cells.seq_len(ENTRY_A) == 40
    cells.check_invariants()


def test_empty_operations_are_no_ops() -> None:
    cells = CellMap(100)
    assert cells.decode([(LANE0, 10, 10)]) == []
    assert cells.decode([]) == []
    cells.seq_cp(LANE1, ENTRY_A, 0, 50)  # empty source
    cells.seq_cp(LANE0, LANE0, 0, 50)
    cells.seq_rm(ENTRY_B)
    assert cells.restore(LANE1, 0) == []
    assert cells.used_cells == 0
    assert cells.head == 0
    assert cells.pos_max(LANE0) == cells.pos_max(ENTRY_A) == -1
    assert cells.sequences() == []
    cells.check_invariants()


def test_decode_behind_pos_max_is_refused() -> None:
    cells = CellMap(100)
    cells.decode([(LANE0, 0, 10)])
    with pytest.raises(ValueError, match="already holds"):
        cells.decode([(LANE0, 5, 15)])
    assert cells.used_cells == 10
    assert cells.head == 10
    cells.check_invariants()


def test_one_sequence_twice_at_a_position_in_a_batch_is_refused() -> None:
    cells = CellMap(100)
    with pytest.raises(ValueError, match="twice"):
        cells.decode([(LANE0, 0, 10), (LANE1, 0, 4), (LANE0, 9, 12)])
    assert cells.used_cells == 0
    cells.check_invariants()


def test_decode_into_a_gap_of_the_sequence_is_booked() -> None:
    cells = CellMap(100)
    cells.decode([(LANE0, 0, 10)])
    cells.seq_rm(LANE0, 3, 6)  # head -> 3
    assert cells.decode([(LANE0, 3, 5)]) == [3, 4]
    assert cells.seq_cells(LANE0) == {p: p for p in range(10) if p != 5}
    cells.check_invariants()


def test_decode_without_a_slot_is_refused() -> None:
    cells = CellMap(16)
    cells.decode([(LANE0, 0, 12)])
    assert cells.find_slot(5) is None
    with pytest.raises(ValueError, match="no slot"):
        cells.decode([(LANE1, 0, 5)])
    assert (cells.used_cells, cells.head) == (12, 12)
    assert cells.find_slot(17) is None
    cells.check_invariants()


def test_seq_cp_onto_different_cells_is_refused() -> None:
    cells = CellMap(100)
    cells.decode([(LANE0, 0, 10)])
    cells.decode([(LANE1, 0, 10)])
    with pytest.raises(ValueError, match="two different cells"):
        cells.seq_cp(LANE0, LANE1, 0, 10)
    assert cells.used_cells == 20
    assert cells.seq_len(LANE1) == 10
    assert cells.seq_cells(LANE1) == {p: 10 + p for p in range(10)}
    cells.check_invariants()


def test_seq_rm_with_inverted_range_removes_nothing() -> None:
    cells = CellMap(1000)
    cells.decode([(LANE0, 0, 300)])
    cells.seq_rm(LANE0, 200, 100)
    assert cells.seq_len(LANE0) == 300
    cells.seq_cp(LANE0, ENTRY_A, -1, -1)
    assert cells.used_cells == 300
    cells.check_invariants()


def test_seq_cp_of_cells_already_held_is_a_no_op() -> None:
    cells = CellMap(1000)
    cells.decode([(LANE0, 0, 200)])
    cells.seq_cp(LANE0, ENTRY_A, 0, 100)
    cells.seq_cp(LANE0, ENTRY_A, 0, 200)  # extend the entry to 200
    assert cells.seq_len(ENTRY_A) == 200
    assert cells.used_cells == 200
    assert cells.holders[:200].tolist() == [2] * 200
    cells.check_invariants()


def test_seq_cp_fills_holes_of_the_destination() -> None:
    cells = CellMap(1000)
    cells.decode([(LANE0, 0, 50)])
    cells.seq_cp(LANE0, ENTRY_A, 0, 10)
    cells.seq_cp(LANE0, ENTRY_A, 30, 40)
    cells.seq_cp(LANE0, ENTRY_A, 5, 35)
    assert cells.seq_cells(ENTRY_A) == {p: p for p in range(40)}
    cells.check_invariants()


def test_seq_rm_of_every_sequence() -> None:
    cells = CellMap(100)
    cells.decode([(LANE0, 0, 20), (LANE1, 0, 20)])
    cells.seq_cp(LANE0, ENTRY_A, -1, -1)
    cells.seq_rm(-1, 10, -1)
    assert [cells.pos_max(s) for s in (LANE0, LANE1, ENTRY_A)] == [9, 9, 9]
    assert cells.used_cells == 20
    assert cells.head == 10  # the first freed: lane 0's position 10
    cells.check_invariants()


# -- the allocator: first-fit from head, reset rule, head moves on removal --------------------


def test_fresh_pool_places_in_order_and_moves_head() -> None:
    cells = CellMap(256)
    assert cells.decode([(0, 0, 10), (1, 0, 5)]) == list(range(15))
    assert cells.head == 15
    assert cells.used_cells == 15
    assert cells.seq_cells(1) == {p: 10 + p for p in range(5)}


def test_removal_moves_head_back_to_the_first_freed_cell() -> None:
    cells = CellMap(256)
    cells.decode([(0, 0, 100)])
    cells.decode([(1, 0, 50)])
    cells.seq_rm(0)
    assert cells.head == 0
    assert cells.find_slot(3) == [0, 1, 2]


def test_shared_cells_are_freed_only_by_their_last_holder() -> None:
    cells = CellMap(256)
    cells.decode([(0, 0, 64)])
    cells.seq_cp(0, 9, 0, 32)
    cells.seq_rm(0)
    assert cells.used_cells == 32
    assert cells.seq_cells(9) == {p: p for p in range(32)}
    assert cells.head == 32


def test_search_restarts_from_zero_when_head_is_far_past_the_used_cells() -> None:
    cells = CellMap(1024)
    cells.decode([(0, 0, 600)])
    cells.decode([(1, 0, 10)])
    cells.seq_rm(0, 0, 600)  # head -> 0 (first freed)
    cells.head = 700  # a state booked events do not reach (see the restart-rule regression below)
    # 700 > used (10) + 2 * 4 -> the search starts at cell 0.
    assert cells.search_start(4) == 0
    assert cells.find_slot(4) == [0, 1, 2, 3]


def test_search_wraps_at_the_end() -> None:
    cells = CellMap(16)
    cells.decode([(0, 0, 12)])
    cells.seq_rm(0, 0, 4)
    cells.head = 12
    assert cells.find_slot(6) == [12, 13, 14, 15, 0, 1]


def test_head_past_the_last_cell_wraps_to_zero() -> None:
    cells = CellMap(16)
    cells.decode([(0, 0, 16)])
    assert cells.head == 16
    cells.seq_rm(0, 0, 2)
    cells.seq_rm(0, 12, -1)
    assert cells.head == 0  # the first freed, cell 0
    cells.decode([(1, 0, 2)])
    assert cells.head == 2
    assert cells.decode([(1, 2, 5)]) == [12, 13, 14]
    assert cells.decode([(1, 5, 6)]) == [15]
    assert cells.head == 16
    assert cells.find_slot(1) is None
    cells.check_invariants()


# -- restore (llama_state_seq_set_data) -------------------------------------------------------


def test_restore_clears_the_sequence_then_takes_free_cells_from_head() -> None:
    cells = CellMap(64)
    cells.decode([(LANE0, 0, 8)])  # cells 0..7
    cells.decode([(LANE1, 0, 8)])  # cells 8..15
    cells.seq_rm(LANE0, 2, 4)  # frees 2, 3; head -> 2
    # Not contiguous: llama.cpp's state_read_meta uses find_slot(ubatch, cont=false).
    assert cells.restore(ENTRY_A, 5) == [2, 3, 16, 17, 18]
    assert cells.seq_cells(ENTRY_A) == {0: 2, 1: 3, 2: 16, 3: 17, 4: 18}
    assert cells.head == 19
    # Restoring into a sequence that holds cells clears it first: head moves back to its first cell.
    assert cells.restore(LANE1, 3) == [8, 9, 10]
    assert cells.used_cells == 6 + 3 + 5
    assert cells.head == 11
    cells.check_invariants()


def test_restore_places_positions_in_payload_order() -> None:
    cells = CellMap(32)
    cells.decode([(LANE0, 0, 4)])
    cells.seq_rm(LANE0, 0, 2)  # positions 2, 3 at cells 2, 3; 0, 1 free
    cells.decode([(LANE0, 4, 6)])  # at cells 0, 1: the lane's cells are out of position order
    assert cells.state_order(LANE0) == [4, 5, 2, 3]
    order = cells.state_order(LANE0)
    assert cells.restore(ENTRY_A, 4, order=[p - 2 for p in order]) == [4, 5, 6, 7]
    assert cells.seq_cells(ENTRY_A) == {2: 4, 3: 5, 0: 6, 1: 7}
    cells.check_invariants()


def test_later_positions_restored_then_joined_to_an_entry_s_leading_cells() -> None:
    # A restore that extends a resident entry: the lane imports only positions [4, 7), then
    # joins the entry's cells of [0, 4); those cells stay held by both.
    cells = CellMap(32)
    cells.decode([(ENTRY_A, 0, 6)])  # cells 0..5
    assert cells.restore(LANE0, 3, order=[4, 5, 6]) == [6, 7, 8]
    cells.seq_cp(ENTRY_A, LANE0, 0, 4)
    assert cells.seq_cells(LANE0) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 6, 5: 7, 6: 8}
    assert (cells.cell_at(LANE0, 3), cells.cell_at(LANE0, 6), cells.cell_at(LANE0, 7)) == (3, 8, -1)
    assert cells.cell_at(LANE1, 0) == -1
    assert cells.used_cells == 9
    cells.seq_rm(ENTRY_A)
    assert cells.used_cells == 7 and cells.pos_max(LANE0) == 6
    cells.check_invariants()


def test_restore_without_room_returns_none_and_leaves_the_sequence_cleared() -> None:
    cells = CellMap(16)
    cells.decode([(LANE0, 0, 10), (LANE1, 0, 4)])
    assert cells.restore(LANE1, 7) is None  # 2 free + lane 1's own 4 < 7
    assert cells.pos_max(LANE1) == -1
    assert cells.used_cells == 10
    assert cells.head == 10
    assert cells.restore(LANE1, 6) == list(range(10, 16))
    assert cells.restore(LANE0, 17) is None  # more than the pool: cleared all the same
    assert cells.pos_max(LANE0) == -1
    assert cells.head == 0
    cells.check_invariants()


def test_restore_refuses_a_bad_order() -> None:
    cells = CellMap(16)
    with pytest.raises(ValueError, match="distinct"):
        cells.restore(LANE0, 3, order=[0, 1, 1])
    with pytest.raises(ValueError, match="distinct"):
        cells.restore(LANE0, 3, order=[0, 1])


def test_holders_cannot_be_written_through() -> None:
    cells = CellMap(8)
    with pytest.raises(ValueError):
        cells.holders[0] = 1
    assert cells.is_free(0)


# -- against a transcription of llama.cpp -----------------------------------------------------


class LlamaCells:
    """llama-kv-cache.cpp's unified cache (one stream, no SWA), transcribed one cell at a time.

    `pos[i]` and `seq[i]` are llama_kv_cells' arrays; the loops are those of
    `find_slot`, `apply_ubatch`, `seq_rm`, `seq_cp` and `state_read_meta`.
    It lets a sequence hold two cells at one position, as llama.cpp does.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.pos = [-1] * size
        self.seq: list[set[int]] = [set() for _ in range(size)]
        self.head = 0

    def used(self) -> int:
        return sum(p != -1 for p in self.pos)

    def find_slot(self, n_tokens: int) -> list[int] | None:
        head_cur = self.head
        if head_cur > self.used() + 2 * n_tokens:
            head_cur = 0
        if n_tokens > self.size:
            return None
        n_tested = 0
        idxs: list[int] = []
        while True:
            if head_cur + 1 > self.size:
                n_tested += self.size - head_cur
                head_cur = 0
                continue
            idx = head_cur
            head_cur += 1
            n_tested += 1
            if self.pos[idx] == -1:
                idxs.append(idx)
            if len(idxs) == n_tokens:
                return idxs
            if n_tested >= self.size:
                return None

    def apply_ubatch(self, idxs: list[int], tokens: list[tuple[int, int]]) -> None:
        for idx, (seq, pos) in zip(idxs, tokens, strict=True):
            assert self.pos[idx] == -1
            self.pos[idx] = pos
            self.seq[idx].add(seq)
        self.head = idxs[-1] + 1

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> None:
        p0 = max(p0, 0)
        p1 = p1 if p1 >= 0 else 1 << 62
        new_head = self.size
        for i in range(self.size):
            if not p0 <= self.pos[i] < p1:
                continue
            if seq_id < 0:
                self.seq[i].clear()
            elif seq_id in self.seq[i]:
                self.seq[i].discard(seq_id)
            else:
                continue
            if not self.seq[i]:
                self.pos[i] = -1
                if new_head == self.size:
                    new_head = i
        if new_head != self.size and new_head < self.head:
            self.head = new_head

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        if src == dst:
            return
        p0 = max(p0, 0)
        p1 = p1 if p1 >= 0 else 1 << 62
        for i in range(self.size):
            if p0 <= self.pos[i] < p1 and src in self.seq[i]:
                self.seq[i].add(dst)

    def state_read(self, seq: int, order: list[int]) -> list[int] | None:
        if not order:  # cell_count == 0: the stream is skipped
            return []
        if len(order) > self.size:
            self.seq_rm(seq, -1, -1)  # state_clear after the failed read
            return None
        self.seq_rm(seq, -1, -1)
        idxs = self.find_slot(len(order))
        if idxs is None:
            return None
        self.apply_ubatch(idxs, [(seq, p) for p in order])
        return idxs

    def held(self, seq: int) -> list[tuple[int, int]]:
        """(position, cell) pairs of `seq`, positions possibly repeated."""
        return sorted((self.pos[i], i) for i in range(self.size) if seq in self.seq[i])

    def state_order(self, seq: int) -> list[int]:
        return [self.pos[i] for i in range(self.size) if seq in self.seq[i]]


SEQS = [LANE0, LANE1, ENTRY_A, ENTRY_B]
seq_ids = st.sampled_from(SEQS)
bounds = st.one_of(st.just(-1), st.integers(0, 80))
runs = st.lists(
    st.tuples(seq_ids, st.sampled_from([0, 0, 0, 1, 3]), st.integers(1, 40)),
    min_size=1,
    max_size=3,
    unique_by=lambda run: run[0],
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("decode"), runs),
        st.tuples(st.just("cp"), seq_ids, seq_ids, bounds, bounds),
        st.tuples(st.just("rm"), seq_ids, bounds, bounds),
        # Truncating a lane back to a shorter prefix, then decoding on (the reused-lane regression).
        st.tuples(st.just("rm"), seq_ids, st.integers(1, 40), st.just(-1)),
        st.tuples(st.just("rm"), st.just(-1), bounds, bounds),
        st.tuples(st.just("restore"), seq_ids, st.integers(0, 90)),
        # A payload saved from another sequence: its positions in its cell order.
        st.tuples(st.just("restore_from"), seq_ids, seq_ids),
    ),
    min_size=8,
    max_size=40,
)


def assert_same(cells: CellMap, ref: LlamaCells) -> None:
    cells.check_invariants()
    assert cells.head == ref.head
    assert cells.used_cells == ref.used()
    assert cells.free_cells == ref.size - ref.used()
    assert cells.holders.tolist() == [len(s) for s in ref.seq]
    every = {seq: ref.held(seq) for seq in SEQS}
    # Distinct cells any sequence holds (llama.cpp counts a cell used while it has a position).
    assert cells.used_cells == len({cell for held in every.values() for _, cell in held})
    for seq, held in every.items():
        assert cells.seq_cells(seq) == dict(held)
        assert cells.pos_max(seq) == max((p for p, _ in held), default=-1)
        assert cells.seq_len(seq) == len(held)
        assert cells.last_cell(seq) == max((c for _, c in held), default=-1)
        assert cells.state_order(seq) == [p for p, _ in sorted(held, key=lambda pc: pc[1])]
    assert cells.sequences() == sorted(seq for seq, held in every.items() if held)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([48, 160, 512]), ops, st.sets(seq_ids))
def test_cell_map_matches_llama_cpp(n_cells: int, program: list[tuple], removal: set[int]) -> None:
    cells = CellMap(n_cells)
    ref = LlamaCells(n_cells)
    for op in program:
        if op[0] == "decode":
            # Each run appends after what its sequence holds (llama.cpp requires it), maybe after a gap.
            batch = []
            for seq, gap, length in op[1]:
                p0 = ref.held(seq)[-1][0] + 1 + gap if ref.held(seq) else gap
                batch.append((seq, p0, p0 + length))
            tokens = [(seq, p) for seq, p0, p1 in batch for p in range(p0, p1)]
            slot = ref.find_slot(len(tokens))
            if slot is None:
                with pytest.raises(ValueError, match="no slot"):
                    cells.decode(batch)
            else:
                assert cells.decode(batch) == slot
                ref.apply_ubatch(slot, tokens)
        elif op[0] == "cp":
            _, src, dst, p0, p1 = op
            lo, hi = max(p0, 0), p1 if p1 >= 0 else 1 << 62
            incoming = {p: c for p, c in ref.held(src) if lo <= p < hi}
            held = dict(ref.held(dst))
            if src != dst and any(held.get(p, c) != c for p, c in incoming.items()):
                # llama.cpp would give dst two cells at one position: misuse, refused whole.
                with pytest.raises(ValueError, match="two different cells"):
                    cells.seq_cp(src, dst, p0, p1)
            else:
                cells.seq_cp(src, dst, p0, p1)
                ref.seq_cp(src, dst, p0, p1)
        elif op[0] == "rm":
            _, seq, p0, p1 = op
            cells.seq_rm(seq, p0, p1)
            ref.seq_rm(seq, p0, p1)
        elif op[0] == "restore":
            _, seq, n = op
            assert cells.restore(seq, n) == ref.state_read(seq, list(range(n)))
        else:
            _, seq, saved = op
            order = ref.state_order(saved)
            assert cells.state_order(saved) == order
            assert cells.restore(seq, len(order), order=order) == ref.state_read(seq, order)
        assert_same(cells, ref)
        assert cells.holders[: cells.head].all(), "a booked event left a free cell below head"
    leaving = {c for s in removal for _, c in ref.held(s)}
    staying = {c for s in SEQS if s not in removal for _, c in ref.held(s)}
    assert cells.cells_freed_by_removing(removal) == len(leaving - staying)


def test_regression_restart_rule_is_mirrored() -> None:
    # Booked events keep every cell below head used, so the restart rule
    # (head > used + 2 * n) is reached only by setting head: it still must agree.
    cells, ref = CellMap(64), LlamaCells(64)
    for m in (cells, ref):
        m.head = 40
    assert cells.find_slot(4) == ref.find_slot(4) == [0, 1, 2, 3]
    assert cells.find_slot(20) == ref.find_slot(20) == list(range(40, 60))
    assert cells.find_slot(30) == ref.find_slot(30) == list(range(40, 64)) + list(range(6))
    assert np.array_equal(cells.holders, np.zeros(64, np.int32))
