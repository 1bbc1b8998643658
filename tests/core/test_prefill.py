"""Prefill chunks: where they end and how many rows a step holds."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from skippy_cache.prefill import MAX_STEP_ROWS, MIN_STEP_ROWS, next_chunk_end, step_rows


def test_a_narrow_view_gets_the_largest_step_the_batch_holds() -> None:
    assert step_rows(0, 512) == MAX_STEP_ROWS
    assert step_rows(2048, 512) == MAX_STEP_ROWS
    assert step_rows(0, 192) == 192


def test_a_wide_view_gets_smaller_steps() -> None:
    assert step_rows(4096, 512) == 256
    assert step_rows(5000, 512) == 192
    assert step_rows(6144, 512) == MIN_STEP_ROWS
    assert step_rows(8192, 512) == MIN_STEP_ROWS


@given(st.integers(0, 1 << 20), st.sampled_from([64, 128, 256, 512, 1024, 2048]))
def test_steps_stay_tiled_on_the_grid_and_within_the_batch(view: int, capacity: int) -> None:
    rows = step_rows(view, capacity)
    assert rows % 64 == 0
    assert min(MIN_STEP_ROWS, capacity) <= rows <= capacity


@given(st.integers(0, 8192), st.integers(0, 8192))
def test_a_wider_view_never_gets_a_larger_step(a: int, b: int) -> None:
    narrow, wide = sorted((a, b))
    assert step_rows(wide, 512) <= step_rows(narrow, 512)


def test_chunks_end_on_the_grid_unless_they_end_the_prompt() -> None:
    assert next_chunk_end(0, 1000, 256, 64, must_progress=True) == 256
    assert next_chunk_end(960, 1000, 256, 64, must_progress=True) == 1000
    assert next_chunk_end(10, 1000, 40, 64, must_progress=False) == 10
    assert next_chunk_end(10, 1000, 40, 64, must_progress=True) == 50
