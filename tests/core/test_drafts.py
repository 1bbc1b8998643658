"""Prompt lookup's guesses (drafts.py) against a plain scan of the whole sequence."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from skippy_cache.drafts import MAX_NGRAM, MIN_NGRAM, Drafter


def scanned_guess(tokens: list[int]) -> int | None:
    """The token after the latest earlier occurrence of the last n tokens, longest n first."""
    for n in range(min(MAX_NGRAM, len(tokens) - 1), MIN_NGRAM - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n]
    return None


@given(st.lists(st.integers(0, 5), max_size=60))
def test_the_guess_is_what_followed_the_latest_occurrence_of_the_longest_run(tokens: list[int]) -> None:
    drafter = Drafter()
    for i, token in enumerate(tokens):
        drafter.push(token)
        assert drafter.guess() == scanned_guess(tokens[: i + 1]), tokens[: i + 1]
    assert Drafter(tokens).guess() == scanned_guess(tokens)


def test_a_repeated_phrase_is_guessed_and_a_single_token_match_is_not() -> None:
    assert Drafter([7, 8, 9, 1, 7, 8]).guess() == 9  # "7 8" came before, followed by 9
    assert Drafter([7, 8, 9, 7, 8, 4, 7, 8]).guess() == 4  # its latest occurrence wins
    assert Drafter([1, 2, 3, 4, 5, 3, 9, 2, 3]).guess() == 4  # "2 3" matches; "9 2 3" does not
    assert Drafter([7, 8, 9, 7]).guess() is None  # "9 7" never came before; "7" alone does not count
    assert Drafter().guess() is None
