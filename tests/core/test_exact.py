"""Deterministic mode's kernels and hit rule, against a brute-force model of how each row is computed."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from skippy_cache.exact import Kernels, exact_length, kernels, rows_key
from skippy_cache.identity import IdentityKey
from skippy_cache.placement import ALIGN


def rows(prefill_end: int, replies: list[tuple[int, int]], n_rows: int) -> str:
    """Each row's kernel in a cold run, from the rule's words: R (row by row) from the prompt's last
    block boundary on, and from the block where an earlier reply's prompt ended to the first block
    boundary past the reply; T (tiled) elsewhere."""
    out = []
    for pos in range(n_rows):
        by_row = pos >= prefill_end - prefill_end % ALIGN
        for start, end in replies:
            if 0 < start <= end <= prefill_end:
                by_row |= (start - 1) - (start - 1) % ALIGN <= pos < -(-end // ALIGN) * ALIGN
        out.append("R" if by_row else "T")
    return "".join(out)


def brute_force(length: int, entry: tuple[int, list], prompt: tuple[int, list]) -> int:
    """The longest resume point <= length where every reused row's kernel matches the prompt's cold
    run's, and the prompt's next row is row by row or starts a block (a tiled chunk starts on one)."""
    e = rows(*entry, length + 1)
    p = rows(*prompt, length + 1)
    for n in range(length, -1, -1):
        if e[:n] == p[:n] and (p[n] == "R" or n % ALIGN == 0):
            return n
    raise AssertionError("0 always qualifies")


def test_a_prompt_alone_tiles_its_whole_blocks():
    assert kernels(0) == Kernels((0,))
    assert kernels(599) == Kernels((576,))
    assert kernels(640) == Kernels((640,))


def test_a_resent_reply_is_computed_row_by_row_from_its_prompt_s_last_block():
    # Turn 1's prompt had 620 tokens and a 30-token reply; turn 2 prefills 800 positions.
    assert kernels(800, [(620, 650)]) == Kernels((576, 704, 768))
    # A reply that ends inside the last block joins the open span.
    assert kernels(700, [(620, 650)]) == Kernels((576,))
    # Two replies whose spans touch make one span.
    assert kernels(900, [(100, 120), (120, 200)]) == Kernels((64, 256, 896))


def test_same_tiled_end_reuses_past_it():
    # A tenant's 600-token system prompt then different questions: both prompts tile 576 rows.
    assert exact_length(600, kernels(619), kernels(629)) == 600


def test_different_tiled_ends_stop_at_the_lower_block_boundary():
    assert exact_length(600, kernels(700), kernels(629)) == 576
    assert exact_length(600, kernels(629), kernels(700)) == 576
    assert exact_length(100, kernels(700), kernels(629)) == 64


def test_the_next_turn_reuses_the_reply():
    # The entry: turn 1's 620-token prompt and its 30-token reply. Turn 2 resends both.
    assert exact_length(650, kernels(619), kernels(800, [(620, 650)])) == 650
    # Without the reply's span the reply's rows would be tiled in turn 2's cold run.
    assert exact_length(650, kernels(619), kernels(800)) == 576


replies = st.lists(st.tuples(st.integers(1, 300), st.integers(0, 60)).map(lambda t: (t[0], t[0] + t[1])), max_size=3)


@given(st.integers(0, 300), replies, st.integers(0, 300), replies, st.integers(0, 300))
def test_exact_length_is_the_longest_resume_whose_rows_match(
    entry_end: int, entry_replies: list, prompt_end: int, prompt_replies: list, shared: int
):
    # The shared tokens are no more than the prompt's prefilled positions; an entry with a
    # reply holds positions past its own prompt (computed row by row).
    length = min(shared, prompt_end)
    got = exact_length(length, kernels(entry_end, entry_replies), kernels(prompt_end, prompt_replies))
    assert got == brute_force(length, (entry_end, entry_replies), (prompt_end, prompt_replies))


@given(st.integers(0, 300), replies)
def test_kernels_match_the_rule_s_words(prefill_end: int, prompt_replies: list):
    k = kernels(prefill_end, prompt_replies)
    assert list(k.bounds) == sorted(set(k.bounds)) and all(b % ALIGN == 0 for b in k.bounds)
    assert "".join("R" if k.row_by_row(p) else "T" for p in range(400)) == rows(prefill_end, prompt_replies, 400)


@given(st.integers(0, 300), replies, st.integers(0, 300), replies, st.integers(1, 5))
def test_equal_bounds_before_a_chunk_end_mean_its_rows_were_computed_alike(
    a_end: int, a_replies: list, b_end: int, b_replies: list, blocks: int
):
    # The store names a chunk by `before(end)`: two prompts share a chunk's name exactly
    # when every row up to its end has one kernel in both.
    end = blocks * ALIGN
    a, b = kernels(a_end, a_replies), kernels(b_end, b_replies)
    alike = rows(a_end, a_replies, end) == rows(b_end, b_replies, end)
    assert (a.before(end) == b.before(end)) == alike


def test_rows_key_never_names_state_as_fast_mode_does():
    space = IdentityKey(model_id="m", model_digest="d", stage_id="s", stage_index=0, layer_start=0,
                        layer_end=30, runtime_abi="r", weight_layout="CPU", type_k="f16", type_v="f16", flash_attn=True,
                        kv_unified=True, ctx_size=8192)
    assert rows_key(space, ()) != space
    assert rows_key(space, (64,)) != rows_key(space, (128,)) != rows_key(space, ())
