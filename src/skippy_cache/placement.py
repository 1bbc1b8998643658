"""Deterministic mode's placement policy: where a step's cells should land, and how to get them there.

Why it matters: on llama.cpp's CPU flash-attention kernel the logits of a
prompt row (the tiled kernel) are bit-identical only when each token's cell
index agrees with its position modulo 64 and a sequence's cells stay in
position order (EXACTNESS.md;
measured: a 64- or 128-cell shift of the whole prompt changes nothing, a shift
of 1..32 cells changes the logits by ~0.7). llama.cpp's allocator is
first-fit from a moving head, so where a warm run's suffix lands depends on the
pool's history. Deterministic mode therefore reads the allocator mirror
(`CellMap`, cells.py) and, before each step, fills the free cells that stand
between the head and where the step's cells must land with a pad sequence
(imported, not decoded: runtime/steering.py).
"""

from __future__ import annotations

import numpy as np

from skippy_cache.cells import CellMap

#: Cell alignment the flash-attention kernel's results depend on.
ALIGN = 64


def aligned_target(cells: CellMap, after: int, first_pos: int, length: int) -> int | None:
    """Lowest cell > `after`, congruent to `first_pos` mod ALIGN, that starts `length` free cells.

    None when no such run is left before the end of the pool.
    """
    holders = cells.holders
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


def order_pad(cells: CellMap, above: int, n_rows: int, n_tokens: int) -> int | None:
    """Free cells to pad so that the first `n_rows` of a batch of `n_tokens` land past cell `above`.

    0: they already do. None: no pad gets there (fewer such free cells than
    rows in the allocator's search order).
    """
    slot = cells.find_slot(n_tokens)
    if slot is not None and min(slot[:n_rows]) > above:
        return 0
    start = cells.search_start(n_tokens)
    free = np.flatnonzero(cells.holders == 0)
    order = np.concatenate((free[free >= start], free[free < start]))
    # The slot after m pads is order[m : m + n_tokens]: the first m whose n_rows cells are all past `above`.
    if len(order) < n_tokens:
        return None
    good = np.concatenate(([0], np.cumsum(order > above)))
    windows = np.flatnonzero(good[n_rows:] - good[:-n_rows] == n_rows)
    windows = windows[windows + n_tokens <= len(order)]
    return int(windows[0]) if len(windows) else None
