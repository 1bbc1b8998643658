"""Deterministic mode's hit rule against a brute-force model of which kernel computed each row."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from skippy_cache.exact import exact_length, tiled_end
from skippy_cache.placement import ALIGN


def kernels(prefill_end: int, n_rows: int) -> str:
    """Each row's kernel in a cold deterministic run: T (tiled) below the tiled end, R (row by row) after."""
    end = tiled_end(prefill_end)
    return "T" * min(end, n_rows) + "R" * max(n_rows - end, 0)


def brute_force(length: int, entry_prefill_end: int, prompt_prefill_end: int) -> int:
    """The longest resume point <= length where every reused row's kernel matches the prompt's cold run's,
    and the prompt's next chunk starts as it did cold (a tiled chunk starts on a block boundary)."""
    entry = kernels(entry_prefill_end, length)
    prompt = kernels(prompt_prefill_end, length)
    for n in range(length, -1, -1):
        if entry[:n] == prompt[:n] and (n >= tiled_end(prompt_prefill_end) or n % ALIGN == 0):
            return n
    raise AssertionError("0 always qualifies")


def test_tiled_end_is_the_last_block_boundary():
    assert [tiled_end(n) for n in (0, 63, 64, 65, 599, 640)] == [0, 0, 64, 64, 576, 640]


def test_same_tiled_end_reuses_past_it():
    # A tenant's 600-token system prompt then different questions: both prompts tile 576 rows.
    assert exact_length(600, entry_tiled_end=576, prompt_tiled_end=576) == 600


def test_different_tiled_ends_stop_at_the_lower_block_boundary():
    assert exact_length(600, entry_tiled_end=640, prompt_tiled_end=576) == 576
    assert exact_length(600, entry_tiled_end=576, prompt_tiled_end=640) == 576
    assert exact_length(100, entry_tiled_end=640, prompt_tiled_end=576) == 64


@given(
    st.integers(min_value=1, max_value=400),
    st.integers(min_value=0, max_value=400),
    st.integers(min_value=0, max_value=400),
)
def test_exact_length_is_the_longest_resume_whose_rows_match(entry_end: int, prompt_end: int, shared: int):
    # The shared tokens are covered by both: no more than either prompt's prefilled positions,
    # though an entry with a reply holds positions past its prompt (computed row by row).
    length = min(shared, prompt_end)
    assert exact_length(length, tiled_end(entry_end), tiled_end(prompt_end)) == brute_force(
        length, entry_end, prompt_end
    )
