"""Deterministic mode's placement: where each step's cells land in the pool.

llama.cpp's CPU flash-attention kernel computes a step of 64 rows or more
tiled over 64-cell blocks of the pool, and a smaller step row by row in cell
order (EXACTNESS.md). So a prompt row's floats are the same in every run only
when the cells of its sequence sit on the 64-cell grid (a token's cell agrees
with its position modulo 64: placement.py), and any row's only when its
sequence's cells stay in position order. llama.cpp's allocator is first-fit
from a moving head, so before each step the free cells it would reach first
are filled with pads of a spare sequence:
- a prefill chunk of whole blocks (tiled) lands on an aligned run of free
  cells past the lane's last cell;
- every other step (decode rows of any lanes, rows computed one at a time)
  lands each lane's rows past that lane's own last cell; the engine orders a
  step's lanes by their last cells, so lanes low in the pool stay low.
The pads are freed after the step's decode (engine.py). They are imported,
not computed: a state of zeroed rows goes in through
`llama_state_seq_set_data`, which places its cells exactly where a decode of
as many tokens would. No other sequence attends to them, so their rows never
matter, and a pad of a thousand cells costs a copy of a few MiB instead of a
thousand tokens' prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from skippy_cache.placement import ALIGN, aligned_target, order_pad, pad_needed
from skippy_cache.runtime.batching import Planned
from skippy_cache.runtime.pool import CellPool
from skippy_cache.stateformat import Layout, join

#: Pad attempts per step: each import of pads may move the allocator's head,
#: so the pad count is recomputed a few times before giving up on placement.
_PAD_ROUNDS = 4


@dataclass(slots=True)
class PlacementStats:
    #: Pad cells imported to steer placement.
    pad_tokens: int = 0
    #: Steps that could not be placed as exactness needs (not bit-exact).
    unaligned_steps: int = 0


class FreePlacement:
    """Fast mode: cells go wherever llama.cpp's allocator finds room."""

    def __init__(self) -> None:
        self.stats = PlacementStats()

    def before_decode(self, planned: list[Planned], n_tokens: int, evict_one: Callable[[], bool]) -> None:
        pass


class AlignedPlacement:
    """Deterministic mode: prompt blocks on the grid, every lane's cells in position order."""

    def __init__(self, pool: CellPool, pad_seq: int, layout: Layout) -> None:
        self.pool = pool
        self.pad_seq = pad_seq
        self.layout = layout
        self.stats = PlacementStats()

    def before_decode(self, planned: list[Planned], n_tokens: int, evict_one: Callable[[], bool]) -> None:
        """Pad so that the step's `n_tokens` (its runs, then any pad row) land where they must."""
        if not self._steer(planned, n_tokens, evict_one):
            self.stats.unaligned_steps += 1

    def _steer(self, planned: list[Planned], n_tokens: int, evict_one: Callable[[], bool]) -> bool:
        cells = self.pool.cells
        first = planned[0]
        if len(planned) == 1 and first.row < 0 and first.p1 - first.p0 >= ALIGN:
            # Whole blocks (batching.py): an aligned run past the lane's last cell.
            seq, p0 = first.lane.seq_id, first.p0
            while (target := aligned_target(cells, cells.last_cell(seq), p0, n_tokens)) is None:
                if not evict_one():
                    return False
            return self._pad_until(lambda: pad_needed(cells, target, n_tokens))
        runs = [(cells.last_cell(p.lane.seq_id), p.p1 - p.p0) for p in planned]
        return self._pad_until(lambda: order_pad(cells, runs, n_tokens))

    def _pad_until(self, needed: Callable[[], int | None]) -> bool:
        for _ in range(_PAD_ROUNDS):
            pad = needed()
            if pad == 0:
                return True
            if pad is None or not self._import_pad(pad):
                return False
        return False

    def _import_pad(self, count: int) -> bool:
        """`count` more pad cells; the import clears the pad sequence first, so its old cells come back too."""
        total = self.pool.cells.seq_len(self.pad_seq) + count
        payload = join(self.layout, [bytes(total * self.layout.token_bytes)], total, seq_id=self.pad_seq)
        if not self.pool.restore(self.pad_seq, payload, total):
            return False
        self.stats.pad_tokens += count
        return True
