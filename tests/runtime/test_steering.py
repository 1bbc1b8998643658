"""Deterministic mode's pads: imported into llama.cpp's real pool, where the mirror says they go."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prompts import make_tokens

from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.batching import Planned
from skippy_cache.runtime.native import Batch
from skippy_cache.runtime.requests import Event, GenerationRequest

pytestmark = pytest.mark.model


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


def test_a_lane_scattered_between_the_free_runs_moves_down_so_another_lane_s_blocks_land_on_the_grid(engine):
    engine.pool.free(-1)
    filler = engine.placement.pad_seq
    n_cells = engine.pool.cells.n_cells
    # Lane 0's rows sit in three places (as a decoding lane's rows land in the gaps between
    # entries), so no free run holds lane 1's 192 cells and its next block; lane 1 sits at the top.
    _decode(engine, [(filler, 0, 200)])
    _decode(engine, [(0, 0, 10)])
    _decode(engine, [(filler, 200, 440)])
    _decode(engine, [(0, 10, 20)])
    _decode(engine, [(filler, 440, 740)])
    _decode(engine, [(0, 20, 30)])
    _decode(engine, [(filler, 740, n_cells - 222)])
    _decode(engine, [(1, 0, 192)])
    assert _cells(engine, 1) == list(range(n_cells - 192, n_cells))
    engine.pool.free(filler)
    before = engine.placement.stats.relocations
    engine.placement.before_decode([Planned(SimpleNamespace(seq_id=1), 192, 256, -1)], 64, lambda: False,
                                   {0: 0, 1: 0})
    _decode(engine, [(1, 192, 256)])
    # Lane 0 went to the first cells, lane 1 to the next aligned run, its new block right after it.
    # Lane 0 went down in one run, and lane 1 with it onto an aligned run, its new block right after it.
    lane0, lane1 = _cells(engine, 0), _cells(engine, 1)
    assert lane0 == list(range(lane0[0], lane0[0] + 30))
    assert lane1[0] % 64 == 0 and lane1 == list(range(lane1[0], lane1[0] + 256))
    assert engine.placement.stats.relocations - before >= 2
    assert engine.placement.stats.unaligned_steps == 0
    assert engine.pool.mismatches([0, 1, filler]) == []
    engine.pool.cells.check_invariants()
    engine.placement.clear_pads()


def test_two_lanes_rows_land_in_their_own_rooms_past_pads_punched_for_them(engine):
    engine.pool.free(-1)
    pad_seq = engine.placement.pad_seq
    _decode(engine, [(0, 0, 64), (pad_seq, 0, 64), (1, 0, 64)])  # lane 0: 0..63, pads: 64..127, lane 1: 128..191
    planned = [Planned(SimpleNamespace(seq_id=seq), 64, 65, row) for row, seq in enumerate((0, 1))]
    for step in range(3):
        engine.placement.before_decode(planned, 2, lambda: False, {0: 16, 1: 16})
        _decode(engine, [(0, 64 + step, 65 + step), (1, 64 + step, 65 + step)])
        planned = [Planned(p.lane, p.p0 + 1, p.p1 + 1, p.row) for p in planned]
        # The mirror agrees with llama.cpp after pads were taken off single cells.
        assert engine.pool.mismatches([0, 1, pad_seq]) == []
    # Each lane's rows right past its own cells: without rooms, lane 0's would have gone past lane 1's.
    assert _cells(engine, 0) == list(range(67))
    assert _cells(engine, 1) == list(range(128, 195))
    assert engine.placement.stats.room_steps >= 3
    engine.pool.cells.check_invariants()
    engine.placement.clear_pads()


def test_lanes_started_together_each_keep_their_cells_in_one_run():
    # A lane's chunk of whole blocks lands where the rest of its prompt and its first tokens fit,
    # outside the rooms of the lanes before it; its last rows and tokens then go right past its
    # own cells. Without rooms, the lanes' last blocks and tokens climbed past each other.
    engine = Engine(EngineConfig(ctx_size=4096, lanes=4, deterministic=True, check_invariants=True), start=False)
    try:
        for i in range(4):
            engine.submit(GenerationRequest(tokens=make_tokens(engine, 150 + 10 * i, seed=590 + i), max_tokens=8),
                          lambda event: None)
        while engine.step():
            for lane in engine.scheduler.lanes:
                cells = _cells(engine, lane.seq_id)
                if cells:
                    assert cells == list(range(cells[0], cells[0] + len(cells))), f"lane {lane.seq_id}"
        assert engine.invariant_failures == []
        assert engine.placement.stats.room_steps > 0 and engine.placement.stats.unaligned_steps == 0
    finally:
        engine.close(drain=False)


def test_a_starting_lane_takes_an_unused_entry_s_cells_rather_than_widen_the_view():
    # An entry nobody uses sits low in the pool, a running lane above it. A new prompt placed past
    # that lane would widen every step's KV view for as long as it runs: the entry is demoted to
    # the store instead, the new lane takes its cells, and the entry's prompt still hits (restored).
    engine = Engine(EngineConfig(ctx_size=4096, lanes=2, deterministic=True, check_invariants=True, idle_tokens=0),
                    start=False)
    try:
        first = make_tokens(engine, 200, seed=600)
        engine.submit(GenerationRequest(tokens=first, max_tokens=1), lambda event: None)
        while engine.step():
            pass
        (entry,) = engine.cache.tiers.resident.entries()
        assert _cells(engine, entry.seq_id)[0] == 0
        engine.submit(GenerationRequest(tokens=make_tokens(engine, 600, seed=601), max_tokens=50), lambda event: None)
        while not any(lane.generated for lane in engine.scheduler.lanes):
            engine.step()
        (running,) = engine.scheduler.lanes
        assert _cells(engine, running.seq_id)[0] == 256  # past the entry's cells
        engine.submit(GenerationRequest(tokens=make_tokens(engine, 150, seed=602), max_tokens=4), lambda event: None)
        while len(engine.scheduler.lanes) < 2 or not all(engine.pool.cells.seq_len(lane.seq_id)
                                                         for lane in engine.scheduler.lanes):
            engine.step()
        (new,) = [lane for lane in engine.scheduler.lanes if lane is not running]
        assert _cells(engine, new.seq_id)[0] == 0
        assert entry.page_id not in engine.cache.tiers.resident
        while engine.step():
            pass
        events: list[Event] = []
        engine.submit(GenerationRequest(tokens=first, max_tokens=1), events.append)
        while engine.step():
            pass
        (done,) = [event for sink, event, _ in engine._outbox if sink == events.append]
        assert done.stats.cached_tokens > 0
        assert engine.invariant_failures == []
    finally:
        engine.close(drain=False)
