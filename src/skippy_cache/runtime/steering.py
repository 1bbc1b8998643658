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
- a lane grows into a room: a chunk that starts a lane lands where the rest of
  its prompt and its first tokens fit after it, outside the other lanes' rooms,
  and a lane's later rows land right past its own cells, the free cells
  between the lanes' next rows covered by pads. Without rooms a lane's next
  rows went to the first free cells past every lane in the step (the
  allocator hands a batch consecutive free cells), so the lanes' last blocks
  and tokens climbed the pool together, and the KV view that every step
  walks grew with every step until a lane was moved down;
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

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from skippy_cache.placement import (
    ALIGN,
    aligned_target,
    cover_plan,
    order_pad,
    pad_needed,
    room_targets,
    rooms_mask,
)
from skippy_cache.runtime.batching import Planned
from skippy_cache.runtime.pool import CellPool
from skippy_cache.stateformat import Layout, zeroed

#: Demotes the least recently used unpinned entry whose sequence the callable picks; False if none.
EvictWhere = Callable[[Callable[[int], bool]], bool]

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
    #: Steps of rows computed one at a time whose lanes all grew into their own rooms.
    room_steps: int = 0


class Placement(Protocol):
    stats: PlacementStats

    def before_decode(
        self,
        planned: list[Planned],
        n_tokens: int,
        evict_one: Callable[[], bool],
        rooms: Mapping[int, int] | None = None,
        evict_where: EvictWhere | None = None,
    ) -> None:
        """Pad so that the step's `n_tokens` land where they must; `rooms` maps each running lane's
        sequence to the cells it may still grow by past its last cell, and `evict_where` demotes an
        entry whose cells a starting lane should take."""

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

    def before_decode(
        self,
        planned: list[Planned],
        n_tokens: int,
        evict_one: Callable[[], bool],
        rooms: Mapping[int, int] | None = None,
        evict_where: EvictWhere | None = None,
    ) -> None:
        pass

    def place_import(
        self, seq_id: int, n_cells: int, evict_one: Callable[[], bool], after: int = -1, start: int = 0
    ) -> bool:
        return True

    def clear_pads(self) -> None:
        pass


class AlignedPlacement:
    """Deterministic mode: prompt blocks on the grid, every lane's cells in position order."""

    def __init__(self, pool: CellPool, pad_seq: int, layout: Layout | tuple[Layout, ...]) -> None:
        self.pool = pool
        self.pad_seq = pad_seq
        self.layout = layout
        self.stats = PlacementStats()

    def before_decode(
        self,
        planned: list[Planned],
        n_tokens: int,
        evict_one: Callable[[], bool],
        rooms: Mapping[int, int] | None = None,
        evict_where: EvictWhere | None = None,
    ) -> None:
        """Pad so that the step's `n_tokens` (its runs, then any pad row) land where they must."""
        if not self._steer(planned, n_tokens, evict_one, rooms or {}, evict_where):
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

    def _steer(
        self,
        planned: list[Planned],
        n_tokens: int,
        evict_one: Callable[[], bool],
        rooms: Mapping[int, int],
        evict_where: EvictWhere | None,
    ) -> bool:
        if self._place(planned, n_tokens, rooms, evict_where):
            return True
        # No room past some lane's last cell: lanes climb the pool as they grow
        # (each step lands past their cells), and a long-lived lane reaches the
        # top. Move the step's lanes down, highest first, until the step fits.
        cells = self.pool.cells
        stepping = sorted({p.lane.seq_id for p in planned}, key=cells.last_cell, reverse=True)
        if self._move_down(stepping, n_tokens, evict_one, planned, rooms, evict_where):
            return True
        # Another lane's rows, landed in the gaps between entries, can split every free run the
        # step's lane needs even once the entries are gone: move those lanes down first, the
        # smallest first (a few cells to copy), then the step's lanes again.
        others = sorted((s for s in rooms if s not in stepping and cells.seq_len(s)), key=cells.seq_len)
        for seq in others:
            self.clear_pads()
            self._relocate(seq, max(rooms[seq], 0), evict_one)
        return bool(others) and self._move_down(stepping, n_tokens, evict_one, planned, rooms, evict_where)

    def _move_down(
        self,
        seqs: list[int],
        n_tokens: int,
        evict_one: Callable[[], bool],
        planned: list[Planned],
        rooms: Mapping[int, int],
        evict_where: EvictWhere | None,
    ) -> bool:
        """Move `seqs` down the pool one at a time until the step fits; False if it does not."""
        for seq in seqs:
            self.clear_pads()
            if not self._relocate(seq, n_tokens, evict_one):
                return False
            if self._place(planned, n_tokens, rooms, evict_where):
                return True
        return False

    def _place(
        self, planned: list[Planned], n_tokens: int, rooms: Mapping[int, int], evict_where: EvictWhere | None
    ) -> bool:
        cells = self.pool.cells
        first = planned[0]
        runs = [(cells.last_cell(p.lane.seq_id), p.p1 - p.p0) for p in planned]
        if len(planned) == 1 and first.row < 0 and first.p1 - first.p0 >= ALIGN:
            # Whole blocks (batching.py): the lowest aligned run past the lane's last cell, which
            # pads kept from earlier steps must not hide; where the lane's room fits, outside the
            # other lanes' rooms, when there is such a run.
            self.clear_pads()
            target = self._chunk_target(first, n_tokens, rooms, evict_where)
            return target is not None and self._pad_until(lambda: pad_needed(cells, target, n_tokens))
        if self._place_in_rooms(runs, n_tokens):
            return True
        return self._pad_until(lambda: order_pad(cells, runs, n_tokens))

    def _chunk_target(
        self, chunk: Planned, n_tokens: int, rooms: Mapping[int, int], evict_where: EvictWhere | None
    ) -> int | None:
        """Where a chunk of whole blocks lands: with the lane's room after it and outside the other
        lanes' rooms, else outside theirs only, else the lowest aligned run past the lane's cells.

        A lane that starts (no cells yet) past the KV view would widen every
        step's view for as long as it runs; when an entry no lane uses holds
        cells that would place it within the view, that entry is demoted
        instead (one export, and a restore if it is hit again).
        """
        cells = self.pool.cells
        seq = chunk.lane.seq_id
        last = cells.last_cell(seq)
        length = max(n_tokens, rooms.get(seq, 0))
        others = rooms_mask(cells.n_cells, [(cells.last_cell(s), room) for s, room in rooms.items() if s != seq])
        target = aligned_target(cells, last, chunk.p0, length, (cells.holders != 0) | others)
        if last < 0 and evict_where is not None and (target is None or target + length > cells.view):
            target = self._make_way(chunk.p0, length, others, rooms, evict_where)
        if target is None:
            target = aligned_target(cells, last, chunk.p0, n_tokens, (cells.holders != 0) | others)
        if target is None:
            target = aligned_target(cells, last, chunk.p0, n_tokens)
        return target

    def _make_way(
        self, first_pos: int, length: int, others: np.ndarray, lanes: Iterable[int], evict_where: EvictWhere
    ) -> int | None:
        """Demote entries no lane uses, one at a time, while one of them holds cells that would place
        a starting lane's `length` cells within the KV view; where the lane lands then."""
        cells = self.pool.cells
        view = cells.view
        held_by_lanes = np.zeros(cells.n_cells, dtype=bool)
        for lane_seq in lanes:
            held_by_lanes[cells.cells_of(lane_seq)] = True

        def holds_it_lower(entry_seq: int) -> bool:
            # The entry's cells no lane holds: freed once it goes, with any entry sharing them
            # (a whole prompt and the same prompt with its reply), which the next round takes.
            own = cells.cells_of(entry_seq)
            unshared = own[~held_by_lanes[own]]
            if not len(unshared):
                return False
            taken = (cells.holders != 0) | others
            taken[unshared] = False
            fit = aligned_target(cells, -1, first_pos, length, taken)
            # Within the view, or past it by less than a block (prompts differ by a few tokens).
            return fit is not None and fit + length <= view + ALIGN

        while True:
            target = aligned_target(cells, -1, first_pos, length, (cells.holders != 0) | others)
            if (target is not None and target + length <= view) or not evict_where(holds_it_lower):
                return target

    def _place_in_rooms(self, runs: list[tuple[int, int]], n_tokens: int) -> bool:
        """Each run right past its lane's last cell, the free cells between them covered by pads."""
        cells = self.pool.cells
        targets = room_targets(cells, runs, self.pad_seq)
        plan = None if targets is None else cover_plan(cells, self.pad_seq, targets, n_tokens)
        if targets is None or plan is None:
            return False
        total, punch = plan
        if total and not self._import_pads(total):
            return False
        for p0, p1 in punch:
            self.pool.remove(self.pad_seq, p0, p1)
        slot = cells.find_slot(n_tokens)
        if slot is None or slot[: len(targets)] != targets:
            return False
        self.stats.room_steps += 1
        return True

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
        return self._import_pads(self.pool.cells.seq_len(self.pad_seq) + count)

    def _import_pads(self, total: int) -> bool:
        """Pads on the first `total` free cells the allocator reaches once the old pads are cleared."""
        count = total - self.pool.cells.seq_len(self.pad_seq)
        payload = zeroed(self.layout, total, seq_id=self.pad_seq)
        if not self.pool.restore(self.pad_seq, payload, total):
            return False
        self.stats.pad_tokens += max(count, 0)
        return True
