"""Deterministic mode's pads: imported into llama.cpp's real pool, where the mirror says they go."""

from __future__ import annotations

import pytest

from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.native import Batch


@pytest.fixture(scope="module")
def engine():
    engine = Engine(EngineConfig(ctx_size=1024, lanes=2, deterministic=True), start=False)
    yield engine
    engine.close()


def _decode(engine: Engine, seq: int, p0: int, n: int) -> list[int]:
    batch = Batch(n)
    batch.add(seq, [1] * n, p0, False)
    assert engine.pool.decode(batch, [(seq, p0, p0 + n)]) == 0
    return sorted(engine.pool.cells.seq_cells(seq).values())


def test_a_chunk_is_steered_past_free_cells_by_imported_pads(engine):
    pool, placement = engine.pool, engine.placement
    pool.free(-1)
    _decode(engine, 0, 0, 10)  # cells 0..9: the head now sits off the 64-cell grid
    assert placement.steer(1, 0, 64, 64, lambda: False)
    pad_seq = placement.pad_seq
    # The 54 free cells before the aligned run hold pads (imported: no token decoded for them).
    assert sorted(pool.cells.seq_cells(pad_seq).values()) == list(range(10, 64))
    assert placement.stats.pad_tokens == 54 and placement.stats.unaligned_steps == 0
    assert _decode(engine, 1, 0, 64) == list(range(64, 128))
    assert pool.mismatches([0, 1, pad_seq]) == []
    pool.cells.check_invariants()
    placement.release(1, lanes_left=0)
    assert pool.cells.seq_len(pad_seq) == 0 and pool.mismatches([pad_seq]) == []


def test_more_pads_join_the_ones_already_imported(engine):
    pool, placement = engine.pool, engine.placement
    pool.free(-1)
    _decode(engine, 0, 0, 10)
    assert placement.steer(1, 0, 64, 64, lambda: False)
    _decode(engine, 1, 0, 64)
    pool.free(0)  # cells 0..9 free again, below the pads
    _decode(engine, 0, 0, 3)  # takes cells 0..2
    assert placement.steer(0, 3, 61, 61, lambda: False)
    # The pad sequence now holds the old pads and the new ones: the import replaced it whole.
    held = sorted(pool.cells.seq_cells(placement.pad_seq).values())
    assert set(range(10, 64)) <= set(held)
    # Position 3 lands on the first free cell congruent to 3 mod 64 with 61 free cells after it.
    assert _decode(engine, 0, 3, 61) == [0, 1, 2, *range(131, 192)]
    assert pool.mismatches([0, 1, placement.pad_seq]) == []
    pool.cells.check_invariants()
    placement.release(0, lanes_left=1)
    placement.release(1, lanes_left=0)
