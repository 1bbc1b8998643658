"""CellLedger: distinct-cell accounting of llama.cpp's unified KV pool."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_cache.cells import CellLedger

LANE0, LANE1, ENTRY_A, ENTRY_B = 0, 1, 8, 9


def test_empty_ledger() -> None:
    ledger = CellLedger(4096)
    assert ledger.used_cells == 0
    assert ledger.free_cells == 4096
    assert ledger.pos_max(LANE0) == -1
    assert ledger.seq_len(LANE0) == 0
    assert ledger.cells_freed_by_removing({LANE0}) == 0


def test_seq_cp_shares_cells() -> None:
    ledger = CellLedger(4096)
    ledger.on_decode(LANE0, 0, 300)
    assert ledger.used_cells == 300
    ledger.on_seq_cp(LANE0, ENTRY_A, 0, 256)
    assert ledger.used_cells == 300  # shared, not copied
    assert ledger.seq_len(ENTRY_A) == 256
    assert ledger.pos_max(ENTRY_A) == 255
    assert ledger.free_cells == 4096 - 300


def test_removing_the_lane_keeps_the_entry_cells() -> None:
    ledger = CellLedger(4096)
    ledger.on_decode(LANE0, 0, 300)
    ledger.on_seq_cp(LANE0, ENTRY_A, 0, 256)
    assert ledger.cells_freed_by_removing({LANE0}) == 44
    assert ledger.cells_freed_by_removing({ENTRY_A}) == 0
    assert ledger.cells_freed_by_removing({LANE0, ENTRY_A}) == 300
    ledger.on_seq_rm(LANE0)
    assert ledger.used_cells == 256
    assert ledger.pos_max(LANE0) == -1
    assert ledger.seq_len(ENTRY_A) == 256


def test_entry_recorded_from_a_lane_started_from_an_entry_shares_cells() -> None:
    ledger = CellLedger(4096)
    ledger.on_decode(LANE0, 0, 300)
    ledger.on_seq_cp(LANE0, ENTRY_A, 0, 256)
    ledger.on_seq_rm(LANE0)
    # A hit: lane 1 starts from entry A, then prefills its own suffix.
    ledger.on_seq_cp(ENTRY_A, LANE1, 0, 256)
    ledger.on_decode(LANE1, 256, 400)
    ledger.on_seq_cp(LANE1, ENTRY_B, 0, 384)
    # A's 256 cells are held by A, lane 1 and B; the suffix adds 144. The naive
    # per-sequence sum would be 256 + 400 + 384.
    assert ledger.used_cells == 400
    assert ledger.cells_freed_by_removing({LANE1}) == 16
    assert ledger.cells_freed_by_removing({ENTRY_A}) == 0
    assert ledger.cells_freed_by_removing({ENTRY_B, LANE1}) == 144
    assert ledger.cells_freed_by_removing({ENTRY_A, ENTRY_B, LANE1}) == 400


def test_regression_reused_lane_id_does_not_share_with_longer_entry() -> None:
    # Lane 0's second run must not be mistaken for a continuation of its first:
    # entry A holds the first run's cells 100..300, the new run's 100..200 are fresh.
    ledger = CellLedger(4096)
    ledger.on_decode(LANE0, 0, 300)
    ledger.on_seq_cp(LANE0, ENTRY_A, 0, 300)
    ledger.on_seq_rm(LANE0)
    ledger.on_seq_cp(ENTRY_A, LANE0, 0, 100)
    ledger.on_decode(LANE0, 100, 200)
    assert ledger.used_cells == 300 + 100
    assert ledger.cells_freed_by_removing({ENTRY_A}) == 200
    assert ledger.cells_freed_by_removing({LANE0}) == 100
    ledger.on_seq_rm(ENTRY_A)
    assert ledger.used_cells == 200


def test_regression_truncated_lane_does_not_share_with_longer_entry() -> None:
    # Same failure through a partial removal (a lane rolled back to a shorter prefix).
    ledger = CellLedger(4096)
    ledger.on_decode(LANE0, 0, 300)
    ledger.on_seq_cp(LANE0, ENTRY_A, 0, 300)
    ledger.on_seq_rm(LANE0, 100, -1)
    assert ledger.pos_max(LANE0) == 99
    ledger.on_decode(LANE0, 100, 200)
    assert ledger.used_cells == 400


def test_partial_copy_from_the_middle_of_a_run() -> None:
    # A sub-range copy (the radix index reusing part of a longer entry) holds
    # cells strictly inside another sequence's run: counted once, not truncated.
    ledger = CellLedger(1000)
    ledger.on_decode(LANE0, 0, 40)
    ledger.on_seq_cp(LANE0, ENTRY_A, 10, 20)
    assert ledger.used_cells == 40
    assert ledger.seq_len(ENTRY_A) == 10
    assert ledger.pos_max(ENTRY_A) == 19
    assert ledger.cells_freed_by_removing({LANE0}) == 30
    ledger.on_seq_rm(LANE0)
    assert ledger.used_cells == 10


def test_token_by_token_decode_counts_each_cell_once() -> None:
    ledger = CellLedger(4096)
    ledger.on_decode(LANE0, 0, 64)
    ledger.on_seq_cp(LANE0, ENTRY_A, 0, 64)
    for pos in range(64, 1064):
        ledger.on_decode(LANE0, pos, pos + 1)
    assert ledger.used_cells == 1064
    assert ledger.seq_len(LANE0) == 1064
    assert ledger.pos_max(LANE0) == 1063
    assert ledger.cells_freed_by_removing({LANE0}) == 1000


def test_pos_max_mirrors_llama() -> None:
    ledger = CellLedger(100)
    assert ledger.pos_max(3) == -1
    ledger.on_decode(3, 0, 10)
    assert ledger.pos_max(3) == 9
    ledger.on_seq_rm(3, 5, -1)
    assert ledger.pos_max(3) == 4
    ledger.on_seq_rm(3, 0, 2)
    assert (ledger.pos_max(3), ledger.seq_len(3)) == (4, 3)
    ledger.on_seq_rm(3, -1, -1)
    assert ledger.pos_max(3) == -1
    assert ledger.used_cells == 0


def test_open_bounds_copy_everything() -> None:
    ledger = CellLedger(100)
    ledger.on_decode(LANE0, 0, 50)
    ledger.on_seq_cp(LANE0, ENTRY_A, -1, -1)
    assert ledger.seq_len(ENTRY_A) == 50
    assert ledger.used_cells == 50
    ledger.on_seq_rm(ENTRY_A, 40)
    assert ledger.seq_len(ENTRY_A) == 40


def test_empty_operations_are_no_ops() -> None:
    ledger = CellLedger(100)
    ledger.on_decode(LANE0, 10, 10)
    ledger.on_seq_cp(LANE1, ENTRY_A, 0, 50)  # empty source
    ledger.on_seq_rm(ENTRY_B)
    assert ledger.used_cells == 0
    assert ledger.pos_max(LANE0) == ledger.pos_max(ENTRY_A) == -1


def test_decode_behind_pos_max_is_refused() -> None:
    ledger = CellLedger(100)
    ledger.on_decode(LANE0, 0, 10)
    with pytest.raises(ValueError, match="already holds"):
        ledger.on_decode(LANE0, 5, 15)
    assert ledger.used_cells == 10


def test_seq_cp_onto_different_cells_is_refused() -> None:
    ledger = CellLedger(100)
    ledger.on_decode(LANE0, 0, 10)
    ledger.on_decode(LANE1, 0, 10)
    with pytest.raises(ValueError, match="two different cells"):
        ledger.on_seq_cp(LANE0, LANE1, 0, 10)
    assert ledger.used_cells == 20
    assert ledger.seq_len(LANE1) == 10


def test_seq_rm_with_inverted_range_removes_nothing() -> None:
    ledger = CellLedger(1000)
    ledger.on_decode(LANE0, 0, 300)
    ledger.on_seq_rm(LANE0, 200, 100)
    assert ledger.seq_len(LANE0) == 300  # got 400
    ledger.on_seq_cp(LANE0, ENTRY_A, -1, -1)  # raises "overlaps" on the corrupted segments
    assert ledger.used_cells == 300


def test_seq_cp_of_cells_already_held_is_a_no_op() -> None:
    ledger = CellLedger(1000)
    ledger.on_decode(LANE0, 0, 200)
    ledger.on_seq_cp(LANE0, ENTRY_A, 0, 100)
    ledger.on_seq_cp(LANE0, ENTRY_A, 0, 200)  # extend the entry to 200: raises today
    assert ledger.seq_len(ENTRY_A) == 200
    assert ledger.used_cells == 200


# -- brute force model ---------------------------------------------------------------------


class BruteForcePool:
    """Every cell an explicit identity; a sequence maps position -> cell."""

    def __init__(self) -> None:
        self.seqs: dict[int, dict[int, object]] = {}

    def decode(self, seq: int, p0: int, p1: int) -> None:
        held = self.seqs.setdefault(seq, {})
        for p in range(p0, p1):
            held[p] = object()  # a fresh cell

    def copied(self, src: int, p0: int, p1: int) -> dict[int, object]:
        lo, hi = max(p0, 0), p1 if p1 >= 0 else 1 << 62
        return {p: c for p, c in self.seqs.get(src, {}).items() if lo <= p < hi}

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self.seqs.setdefault(dst, {}).update(self.copied(src, p0, p1))

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        lo, hi = max(p0, 0), p1 if p1 >= 0 else 1 << 62
        held = self.seqs.get(seq, {})
        for p in [p for p in held if lo <= p < hi]:
            del held[p]

    def used(self, exclude: frozenset[int] = frozenset()) -> int:
        return len({id(c) for s, held in self.seqs.items() if s not in exclude for c in held.values()})

    def pos_max(self, seq: int) -> int:
        return max(self.seqs.get(seq, {}), default=-1)


SEQS = [LANE0, LANE1, ENTRY_A]
seq_ids = st.sampled_from(SEQS)
bounds = st.one_of(st.just(-1), st.integers(0, 80))
ops = st.lists(
    st.one_of(
        st.tuples(st.just("decode"), seq_ids, st.sampled_from([0, 0, 0, 1, 3]), st.integers(1, 40)),
        st.tuples(st.just("cp"), seq_ids, seq_ids, bounds, bounds),
        st.tuples(st.just("rm"), seq_ids, bounds, bounds),
        # Truncating a lane back to a shorter prefix, then decoding on (the reused-lane regression).
        st.tuples(st.just("rm"), seq_ids, st.integers(1, 40), st.just(-1)),
    ),
    min_size=8,
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.sets(seq_ids))
def test_ledger_matches_brute_force(program: list[tuple], removal: set[int]) -> None:
    ledger = CellLedger(10_000)
    pool = BruteForcePool()
    for op in program:
        if op[0] == "decode":
            _, seq, gap, length = op
            # Decode appends after what the sequence holds (llama.cpp requires it), maybe after a gap.
            p0 = pool.pos_max(seq) + 1 + gap
            ledger.on_decode(seq, p0, p0 + length)
            pool.decode(seq, p0, p0 + length)
        elif op[0] == "cp":
            _, src, dst, p0, p1 = op
            incoming = pool.copied(src, p0, p1)
            held = pool.seqs.get(dst, {})
            clash = [p for p in incoming if p in held]
            if any(held[p] is not incoming[p] for p in clash):
                # Two different cells at one position of a sequence: misuse, refused whole.
                with pytest.raises(ValueError):
                    ledger.on_seq_cp(src, dst, p0, p1)
                continue
            ledger.on_seq_cp(src, dst, p0, p1)
            pool.seq_cp(src, dst, p0, p1)
        else:
            _, seq, p0, p1 = op
            ledger.on_seq_rm(seq, p0, p1)
            pool.seq_rm(seq, p0, p1)
        assert ledger.used_cells == pool.used()
    for seq in SEQS:
        assert ledger.seq_len(seq) == len(pool.seqs.get(seq, {}))
        assert ledger.pos_max(seq) == pool.pos_max(seq)
    assert ledger.free_cells == 10_000 - pool.used()
    assert ledger.cells_freed_by_removing(removal) == pool.used() - pool.used(frozenset(removal))
