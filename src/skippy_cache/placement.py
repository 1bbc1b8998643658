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

from collections.abc import Sequence

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
