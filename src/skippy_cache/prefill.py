"""Where prefill chunks end.

Cold and warm runs must compute the same floats. A hit resumes prefill at a
grid length, so if every chunk ends on a multiple of the record grid, the warm
run's chunks end where the cold run's do from that point on. Measured on
llama.cpp's CPU kernels (EXACTNESS.md): suffixes prefilled in grid-aligned
chunks give bit-identical logits; a suffix in one unaligned chunk does not.

How large a chunk is also decides its cost per token: see `step_rows`.
"""

from __future__ import annotations

#: Rows x KV cells of a step's attention mask up to which the largest step is the cheapest per row.
MASK_CELLS = 512 * 2048
#: The smallest step `step_rows` gives: two 64-row blocks (a step of 64 rows or more stays tiled).
MIN_STEP_ROWS = 128
#: The largest: a 2,000-token prompt prefilled no faster in 512-row steps than in 256-row ones, and
#: a larger step holds every request that arrives meanwhile for longer (a whole step, at worst).
MAX_STEP_ROWS = 256


def step_rows(view: int, capacity: int) -> int:
    """The most prompt rows one step should hold when the pool's KV view is `view` cells wide.

    llama.cpp's CPU flash attention reads the step's mask (rows x view cells,
    the view running from cell 0 to the highest used cell, masked cells
    included) for every head of every layer. Once that mask falls out of the
    CPU's caches a large step costs more per row than a few small ones: on a
    wide view (a pool full of cached entries) a prompt prefills faster in
    128-row steps than in 512-row ones, and on a narrow view 256-row steps are
    as fast as any. The result is a multiple of 64, so chunks keep to the
    block grid.
    """
    rows = min(MASK_CELLS // max(view, 1), MAX_STEP_ROWS)
    rows -= rows % 64
    return max(min(rows, capacity), min(MIN_STEP_ROWS, capacity))


def next_chunk_end(n_past: int, prefill_end: int, budget: int, grid: int, *, must_progress: bool) -> int:
    """End (exclusive) of the next prefill chunk starting at `n_past`; `n_past` means none this step.

    The chunk holds at most `budget` tokens and ends on a multiple of `grid`
    unless it reaches `prefill_end`. When no aligned end fits in the budget the
    lane waits for a step with more room, unless `must_progress` (it is the
    only prefill this step could serve): then it takes what fits, because a
    grid wider than the batch could otherwise never advance.
    """
    if n_past >= prefill_end or budget <= 0:
        return n_past
    end = min(prefill_end, n_past + budget)
    if end == prefill_end:
        return end
    aligned = end - end % max(grid, 1)
    if aligned > n_past:
        return aligned
    return end if must_progress else n_past
