"""Where prefill chunks end.

Cold and warm runs must compute the same floats. A hit resumes prefill at a
grid length, so if every chunk ends on a multiple of the record grid, the warm
run's chunks end where the cold run's do from that point on. Measured on
llama.cpp's CPU kernels (EXACTNESS.md): suffixes prefilled in grid-aligned
chunks give bit-identical logits; a suffix in one unaligned chunk does not.
"""

from __future__ import annotations


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
