"""Deterministic mode's pads: imported into llama.cpp's real pool, where the mirror says they go."""

from __future__ import annotations

import time
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


def test_idle_entries_left_high_move_down_and_still_hit_bit_for_bit():
    # The entry recorded first sits lowest and leaves first; the one above it stays high over free
    # cells, widening every step's view. An idle engine moves it (with the entry of its reply,
    # which shares its cells) down onto the grid where it fits below its cells, and a hit on it
    # is still the cold run's.
    from exactmode import assert_bit_exact
    from prompts import make_tokens

    from skippy_cache.config import StageKvCacheConfig, StageKvCacheMode
    from skippy_cache.runtime.requests import GenerationRequest

    def config(**kw):
        return EngineConfig(ctx_size=4096, lanes=2, cache_dir=None, deterministic=True, check_invariants=True, **kw)

    warm = Engine(config())
    cold = Engine(config(cache=StageKvCacheConfig(mode=StageKvCacheMode.DISABLED)))
    try:
        low, high = make_tokens(warm, 500, seed=61), make_tokens(warm, 300, seed=62)
        for prompt in (low, high):
            warm.generate(GenerationRequest(tokens=prompt, max_tokens=4))
        entries = warm.call(lambda: [e.seq_id for e in warm.cache.tiers.resident.entries()])
        assert len(entries) == 4  # each prompt, and each prompt with its reply
        first_cell = warm.call(lambda: warm.pool.cells.cell_at(entries[-1], 0))
        assert first_cell >= len(low)
        before = warm.stats().placement.compactions
        assert warm.call(lambda: warm.cache.evict_one() and warm.cache.evict_one())  # the low prompt's two
        deadline = time.monotonic() + 30
        while warm.stats().placement.compactions == before:
            assert time.monotonic() < deadline, "the idle engine never moved the entries down"
            time.sleep(0.05)
        assert warm.call(lambda: warm.pool.cells.cell_at(entries[-1], 0)) == 0
        assert warm.call(lambda: warm.pool.cells.view) < first_cell + len(high)
        prompt = high + make_tokens(warm, 40, seed=63)[1:]
        on = warm.generate(GenerationRequest(tokens=prompt, max_tokens=6, keep_first_logits=True))
        off = cold.generate(GenerationRequest(tokens=prompt, max_tokens=6, keep_first_logits=True))
        # The cold run computes rows 256..299 tiled with the new ones: the hit stops on the grid.
        assert (on.stats.cache_source, on.stats.cached_tokens) == ("resident", 256)
        assert_bit_exact(on, off, "a hit on entries moved down")
        assert warm.stats().placement.unaligned_steps == 0
        assert warm.invariant_failures == []
    finally:
        warm.close()
        cold.close()
