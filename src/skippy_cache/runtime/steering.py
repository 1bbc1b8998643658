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
  step's lanes by their last cells, so lanes low in the pool stay low;
- a state restored from the store onto an empty lane lands on an aligned run,
  as the whole blocks it holds did when they were computed (past the cells it
  shares with a resident entry, when it goes on from one);
- a lane with no free cells past its own (lanes climb the pool as they grow)
  is moved down: exported, and imported back onto an aligned run.
Pads stay while lanes run, those of a step and those that landed a restore
(the engine frees them when it idles, and the books count them as free
cells: `make_room` frees them first): freed after every step or restore,
they would hand the allocator back the very cells the next step's rows must
skip, and every decode row, or the first step after a restore, would cost a
pad import of them again. They are imported, not computed: a state of
zeroed rows goes in through
`llama_state_seq_set_data`, which places its cells exactly where a decode of
as many tokens would. No other sequence attends to them, so their rows never
matter, and a pad of a thousand cells costs a copy of a few MiB instead of a
thousand tokens' prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from skippy_cache.placement import ALIGN, aligned_target, order_pad, pad_needed
from skippy_cache.runtime.batching import Planned
from skippy_cache.runtime.pool import CellPool
from skippy_cache.stateformat import Layout, zeroed

#: Pad attempts per step: each import of pads may move the allocator's head,
#: so the pad count is recomputed a few times before giving up on placement.
_PAD_ROUNDS = 4


@dataclass(slots=True)
class PlacementStats:
    #: Pad cells imported to steer placement.
    pad_tokens: int = 0
    #: Steps that could not be placed as exactness needs (not bit-exact).
    unaligned_steps: int = 0
    #: Lanes moved down the pool (exported, imported on the grid) for want of room past their cells.
    relocations: int = 0


class Placement(Protocol):
    stats: PlacementStats

    def before_decode(self, planned: list[Planned], n_tokens: int, evict_one: Callable[[], bool]) -> None:
        """Pad so that the step's `n_tokens` land where they must."""

    def place_import(
        self, seq_id: int, n_cells: int, evict_one: Callable[[], bool], after: int = -1, start: int = 0
    ) -> bool:
        """Pad so that `n_cells` of positions from `start` imported onto the empty `seq_id` land where
        they must, past cell `after` (the shared cells they go on from); False if they cannot."""

    def clear_pads(self) -> None:
        """Free the pads (the engine idles, or the next placement wants the lowest free cells)."""


class FreePlacement:
    """Fast mode: cells go wherever llama.cpp's allocator finds room."""

    def __init__(self) -> None:
        self.stats = PlacementStats()

    def before_decode(self, planned: list[Planned], n_tokens: int, evict_one: Callable[[], bool]) -> None:
        pass

    def place_import(
        self, seq_id: int, n_cells: int, evict_one: Callable[[], bool], after: int = -1, start: int = 0
    ) -> bool:
        return True

    def clear_pads(self) -> None:
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

    def place_import(
        self, seq_id: int, n_cells: int, evict_one: Callable[[], bool], after: int = -1, start: int = 0
    ) -> bool:
        """A restore of positions [start, start + n_cells) lands on an aligned run past cell `after`,
        as a chunk of whole blocks would.

        False when it cannot: the caller then prefills instead (a restore
        refused is counted as a miss for want of room, not as an unaligned step).
        """
        self.clear_pads()
        return self._land_import(n_cells, 0, evict_one, after, start)

    def clear_pads(self) -> None:
        if self.pool.cells.seq_len(self.pad_seq):
            self.pool.free(self.pad_seq)

    def _steer(self, planned: list[Planned], n_tokens: int, evict_one: Callable[[], bool]) -> bool:
        if self._place(planned, n_tokens):
            return True
        # No room past some lane's last cell: lanes climb the pool as they grow
        # (each step lands past their cells), and a long-lived lane reaches the
        # top. Move the step's lanes down, highest first, until the step fits.
        cells = self.pool.cells
        for seq in sorted({p.lane.seq_id for p in planned}, key=cells.last_cell, reverse=True):
            self.clear_pads()
            if not self._relocate(seq, n_tokens, evict_one):
                return False
            if self._place(planned, n_tokens):
                return True
        return False

    def _place(self, planned: list[Planned], n_tokens: int) -> bool:
        cells = self.pool.cells
        first = planned[0]
        if len(planned) == 1 and first.row < 0 and first.p1 - first.p0 >= ALIGN:
            # Whole blocks (batching.py): the lowest aligned run past the lane's last cell, which
            # pads kept from earlier steps must not hide.
            self.clear_pads()
            target = aligned_target(cells, cells.last_cell(first.lane.seq_id), first.p0, n_tokens)
            return target is not None and self._pad_until(lambda: pad_needed(cells, target, n_tokens))
        return self._pad_until(
            lambda: order_pad(cells, [(cells.last_cell(p.lane.seq_id), p.p1 - p.p0) for p in planned], n_tokens)
        )

    def _relocate(self, seq_id: int, room: int, evict_one: Callable[[], bool]) -> bool:
        """Move a lane's cells to the lowest aligned run of free cells with `room` more free after it,
        evicting entries until there is one; False if there is none even then.

        Its KV is exported and imported back: the same rows, in the same
        position order, on the grid, so every later row computes as it would
        have where the lane was.
        """
        n = self.pool.cells.seq_len(seq_id)
        state = self.pool.export(seq_id)
        self.pool.free(seq_id)
        placed = self._land_import(n, room, evict_one)
        while not self.pool.restore(seq_id, state, n):
            # The lane's own cells were freed, but cells it shared stay held by entries.
            self.clear_pads()
            if not evict_one():
                raise RuntimeError(f"a lane's {n} cells could not be imported back after a move")
        self.clear_pads()
        self.stats.relocations += 1
        return placed

    def _land_import(
        self, n_cells: int, room: int, evict_one: Callable[[], bool], after: int = -1, start: int = 0
    ) -> bool:
        """Pad so that positions [start, start + n_cells) imported onto an empty sequence land on the
        lowest aligned run of free cells past `after` with `room` more free after it, evicting
        entries until there is one; False if there is none even then."""
        cells = self.pool.cells
        while (target := aligned_target(cells, after, start, n_cells + room)) is None:
            if not evict_one():
                return False
        return self._pad_until(lambda: pad_needed(cells, target, n_cells))

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
        payload = zeroed(self.layout, total, seq_id=self.pad_seq)
        if not self.pool.restore(self.pad_seq, payload, total):
            return False
        self.stats.pad_tokens += count
        return True
