"""Deterministic mode's pads: imported into llama.cpp's real pool, where the mirror says they go."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.batching import Planned
from skippy_cache.runtime.native import Batch


@pytest.fixture(scope="module")
def engine():
    engine = Engine(EngineConfig(ctx_size=1024, lanes=2, deterministic=True), start=False)
    yield engine
    engine.close()


def _decode(engine: Engine, runs: list[tuple[int, int, int]]) -> None:
    batch = Batch(sum(p1 - p0 for _, p0, p1 in runs))
    for seq, p0, p1 in runs:
        batch.add(seq, [1] * (p1 - p0), p0, False)
    assert engine.pool.decode(batch, runs) == 0


def _cells(engine: Engine, seq: int) -> list[int]:
    held = engine.pool.cells.seq_cells(seq)
    return [held[pos] for pos in sorted(held)]


def _step(engine: Engine, seq: int, p0: int, p1: int, row: int) -> None:
    """What the engine does around one step's decode: pad, decode (with a pad row if one row), free the pads."""
    placement, pad_seq = engine.placement, engine.placement.pad_seq
    n_tokens = max(p1 - p0, 2)
    placement.before_decode([Planned(SimpleNamespace(seq_id=seq), p0, p1, row)], n_tokens, lambda: False)
    runs = [(seq, p0, p1)]
    if n_tokens > p1 - p0:
        pos = engine.pool.cells.pos_max(pad_seq) + 1
        runs.append((pad_seq, pos, pos + 1))
    _decode(engine, runs)
    assert engine.pool.mismatches([0, 1, pad_seq]) == []
    engine.pool.free(pad_seq)


def test_whole_blocks_land_on_the_grid_past_imported_pads(engine):
    engine.pool.free(-1)
    _decode(engine, [(0, 0, 10)])  # cells 0..9: the head now sits off the 64-cell grid
    before = engine.placement.stats.pad_tokens
    _step(engine, 1, 0, 64, -1)
    # The 54 free cells before the aligned run held pads (imported: no token was decoded for them).
    assert _cells(engine, 1) == list(range(64, 128))
    assert engine.placement.stats.pad_tokens - before == 54
    assert engine.placement.stats.unaligned_steps == 0
    engine.pool.cells.check_invariants()


def test_a_decode_row_lands_past_its_sequence_s_last_cell(engine):
    engine.pool.free(-1)
    _decode(engine, [(0, 0, 10), (1, 0, 10)])  # seq 0 on cells 0..9, seq 1 on 10..19
    engine.pool.free(0)  # the allocator's head goes back to cell 0
    _step(engine, 1, 10, 11, 0)
    # Position 10 after its sequence's cells, though cells 0..9 were free and first in line.
    assert _cells(engine, 1) == list(range(10, 21))
    assert engine.placement.stats.unaligned_steps == 0
    assert engine.pool.cells.seq_len(engine.placement.pad_seq) == 0
    engine.pool.cells.check_invariants()


def test_a_restore_lands_on_the_grid(engine):
    engine.pool.free(-1)
    _decode(engine, [(1, 0, 64)])
    state = engine.pool.export(1)
    engine.pool.free(1)
    _decode(engine, [(0, 0, 10)])  # the next free cell, 10, is off the grid
    assert engine.placement.place_import(1, 64, lambda: False)
    assert engine.pool.restore(1, state, 64)
    engine.placement.clear_pads()
    assert _cells(engine, 1) == list(range(64, 128))
    assert engine.pool.mismatches([0, 1]) == []
    engine.pool.cells.check_invariants()


def test_a_lane_with_no_room_past_its_cells_moves_down_the_grid(engine):
    engine.pool.free(-1)
    n_cells = engine.pool.cells.n_cells
    for p0 in range(0, n_cells - 100, 256):
        _decode(engine, [(1, p0, min(p0 + 256, n_cells - 100))])
    _decode(engine, [(0, 0, 100)])  # seq 0 holds the pool's last 100 cells
    engine.pool.free(1)
    before = engine.placement.stats.relocations
    _step(engine, 0, 100, 101, 0)
    # Moved to the first cells (its 100 rows unchanged, in position order), its new row after them.
    assert _cells(engine, 0) == list(range(101))
    assert engine.placement.stats.relocations - before == 1
    assert engine.placement.stats.unaligned_steps == 0
    engine.pool.cells.check_invariants()
