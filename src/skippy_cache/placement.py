"""Deterministic mode's placement policy: where a step's cells should land, and how to get them there.

Why it matters: on llama.cpp's CPU flash-attention kernel the logits of a
prompt row (the tiled kernel) are bit-identical only when each token's cell
index agrees with its position modulo 64 and a sequence's cells stay in
position order (EXACTNESS.md;
measured: a 64- or 128-cell shift of the whole prompt changes nothing, a shift
of 1..32 cells changes the logits; docs/exactness.md has the figures). llama.cpp's allocator is
first-fit from a moving head, so where a warm run's suffix lands depends on the
pool's history. Deterministic mode therefore reads the allocator mirror
(`CellMap`, cells.py) and, before each step, fills the free cells that stand
between the head and where the step's cells must land with a pad sequence
(imported, not decoded: runtime/steering.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from skippy_cache.cells import CellMap

#: Cell alignment the flash-attention kernel's results depend on.
ALIGN = 64


def aligned_target(
    cells: CellMap, after: int, first_pos: int, length: int, taken: np.ndarray | None = None
) -> int | None:
    """Lowest cell > `after`, congruent to `first_pos` mod ALIGN, that starts `length` free cells
    (cells not `taken`, when given: by default those a sequence holds).

    None when no such run is left before the end of the pool.
    """
    holders = cells.holders if taken is None else taken
    start = after + 1
    start += (first_pos - start) % ALIGN
    while start + length <= cells.n_cells:
        blockers = np.flatnonzero(holders[start : start + length])
        if len(blockers) == 0:
            return start
        # Every start up to the last blocker would still cover it: skip past it.
        start += int(blockers[-1]) + 1
        start += (first_pos - start) % ALIGN
    return None


def pad_needed(cells: CellMap, target: int, n_tokens: int) -> int:
    """Free cells the allocator would use before `target` for a batch of `n_tokens` (0: it lands there)."""
    slot = cells.find_slot(n_tokens)
    if slot is not None and slot == list(range(target, target + n_tokens)):
        return 0
    free = cells.holders == 0
    start = cells.search_start(n_tokens)
    if not 0 <= target < cells.n_cells:
        return int(np.count_nonzero(free))
    if start <= target:
        return int(np.count_nonzero(free[start:target]))
    return int(np.count_nonzero(free[start:]) + np.count_nonzero(free[:target]))


def order_pad(cells: CellMap, runs: Sequence[tuple[int, int]], n_tokens: int) -> int | None:
    """Free cells to pad so that each run of a batch of `n_tokens` lands past its sequence's last cell,
    in position order.

    `runs` are the batch's first rows in order, as (the sequence's last cell,
    rows). The allocator gives the batch the free cells in its search order,
    which rises from its head and wraps to cell 0 once: a run lands past its
    sequence's cells in order when its first cell is past that last cell and
    the run does not straddle the wrap. Each run needs only its own sequence's
    last cell behind it, so lanes low in the pool stay low. 0: they already
    land so; None: no pad gets there.
    """
    start = cells.search_start(n_tokens)
    free = np.flatnonzero(cells.holders == 0)
    order = np.concatenate((free[free >= start], free[free < start]))
    wrap = int(np.count_nonzero(free >= start))
    if len(order) < n_tokens:
        return None
    # The slot after m pads is order[m : m + n_tokens].
    m = np.arange(len(order) - n_tokens + 1)
    fits = np.ones(len(m), dtype=bool)
    offset = 0
    for last, rows in runs:
        first = m + offset
        fits &= order[first] > last
        fits &= ~((first < wrap) & (wrap < first + rows))
        offset += rows
    good = np.flatnonzero(fits)
    return int(good[0]) if len(good) else None


def rooms_mask(n_cells: int, rooms: Iterable[tuple[int, int]]) -> np.ndarray:
    """The cells running lanes will grow into: for each (last cell, room), the `room` cells past it."""
    mask = np.zeros(n_cells, dtype=bool)
    for last, room in rooms:
        if last >= 0 and room > 0:
            mask[last + 1 : last + 1 + room] = True
    return mask


def room_targets(cells: CellMap, runs: Sequence[tuple[int, int]], pad_seq: int) -> list[int] | None:
    """The cells right past each run's sequence's last cell, in batch order: where a step's rows go
    when each lane grows into its own room.

    `runs` are as for `order_pad`. None when a run's cells are held by any
    sequence but the pads', or the runs' cells do not rise in batch order (the
    allocator hands a batch its cells in its search order).
    """
    holders = cells.holders
    pads = np.zeros(cells.n_cells, dtype=bool)
    pads[cells.cells_of(pad_seq)] = True
    targets: list[int] = []
    for last, rows in runs:
        if last < 0 or last + 1 + rows > cells.n_cells or (targets and last + 1 <= targets[-1]):
            return None
        run = np.arange(last + 1, last + 1 + rows)
        if np.any((holders[run] != 0) & ~(pads[run] & (holders[run] == 1))):
            return None
        targets += run.tolist()
    return targets


def cover_plan(cells: CellMap, pad_seq: int, targets: list[int], n_tokens: int) -> tuple[int, list[tuple[int, int]]] | None:
    """How to make the allocator give a batch of `n_tokens` the `targets` (ascending) first.

    Pads cover every free cell the allocator would reach before the last
    target, and the targets are then punched out of the pads: (pad cells to
    import anew, 0 to keep the pads as they are; the pad positions to remove,
    as [p0, p1) ranges). The pads stay between steps, so a lane's next row is
    usually a pad already and a step costs one removal, not an import. None
    when no plan lands them (the allocator's search would wrap first).
    """
    for reimport in (False, True):
        sim = cells.copy()
        total = 0
        if reimport:
            sim.seq_rm(pad_seq)
            cover = _cover_length(sim, targets[-1])
            if cover is None or sim.restore(pad_seq, cover) is None:
                continue
            total = cover
        at = {cell: pos for pos, cell in sim.seq_cells(pad_seq).items()}
        punch = sorted(at[cell] for cell in targets if cell in at)
        for pos in punch:
            sim.seq_rm(pad_seq, pos, pos + 1)
        slot = sim.find_slot(n_tokens)
        if slot is not None and slot[: len(targets)] == targets:
            return total, _ranges(punch)
    return None


def _cover_length(cells: CellMap, last: int) -> int | None:
    """Cells an import takes to reach every free cell up to `last` in the allocator's search order."""
    free = np.flatnonzero(cells.holders == 0)
    total = int(np.count_nonzero(free <= last))
    for _ in range(3):
        start = cells.search_start(total)
        if start > last:
            return None  # the search would climb to the pool's end and wrap before reaching `last`
        reach = int(np.count_nonzero((free >= start) & (free <= last)))
        if reach == total:
            return total
        total = reach
    return None


def _ranges(positions: list[int]) -> list[tuple[int, int]]:
    """Ascending positions as [p0, p1) runs."""
    out: list[tuple[int, int]] = []
    for pos in positions:
        if out and out[-1][1] == pos:
            out[-1] = (out[-1][0], pos + 1)
        else:
            out.append((pos, pos + 1))
    return out
