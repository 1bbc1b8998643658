"""A guess at a lane's next token, from its own text: what a lone decode's spare row computes.

A decode step of one row carries a second row anyway (batching.py: the pad row
keeps every decode row on the row-by-row kernel, so its floats do not depend on
what else runs). That row may as well be the lane's own next position, fed
with a guessed token: when the token sampled from the first row equals the
guess, the second row's logits are the next token's, computed by the same
kernel, over the same cells in the same order, as the next step would have
computed them (EXACTNESS.md), and the step yields two tokens. When it does not,
the guessed row's cell is dropped and nothing else changes.

The guess is prompt lookup (as llama.cpp's `--lookup` and vLLM's n-gram
proposer): the token that followed the latest earlier occurrence of the last
three tokens, else of the last two. Models repeat their prompt's names, code
and their own phrases, and a match of two or three tokens is right about half
and most of the time; a single token's match is right about one time in five,
too seldom to pay: a guessed row attends over the lane's cells where a pad row
attends over a few, so it costs more than the pad (docs/scheduling.md has the
figures). Without a match the step keeps its pad row.
"""

from __future__ import annotations

from collections.abc import Iterable

#: The longest and shortest runs of tokens looked up (the first that matches, longest first, gives
#: the guess).
MAX_NGRAM = 3
MIN_NGRAM = 2


class Drafter:
    """The last tokens of one sequence, and what followed each short run of its tokens last time."""

    __slots__ = ("_tail", "_follows")

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        #: The last MAX_NGRAM tokens.
        self._tail: list[int] = []
        #: (run of MIN_NGRAM..MAX_NGRAM tokens) -> the token that followed its latest occurrence.
        self._follows: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def push(self, token: int) -> None:
        """The sequence goes on with `token`."""
        tail = self._tail
        for n in range(MIN_NGRAM, min(len(tail), MAX_NGRAM) + 1):
            self._follows[tuple(tail[-n:])] = token
        tail.append(token)
        if len(tail) > MAX_NGRAM:
            del tail[0]

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.push(token)

    def guess(self) -> int | None:
        """The token that followed the last `MIN_NGRAM` to `MAX_NGRAM` tokens' latest earlier
        occurrence, the longest that occurred; None when none did."""
        tail = self._tail
        for n in range(min(len(tail), MAX_NGRAM), MIN_NGRAM - 1, -1):
            follower = self._follows.get(tuple(tail[-n:]))
            if follower is not None:
                return follower
        return None
