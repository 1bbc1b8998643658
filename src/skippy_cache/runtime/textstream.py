"""Token bytes to streamed text: UTF-8 safe across token boundaries, stop strings held back.

A token may end in the middle of a multi-byte character, and a stop string may
span tokens. Text is released only once it can no longer become part of a stop
string, so a streamed client never sees text a non-streamed response would cut.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    #: The stop string that ended generation, if one did.
    stopped_on: str | None = None


class TextStream:
    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._pending = ""
        self.text = ""
        self.stopped_on: str | None = None

    def push(self, piece: bytes) -> TextDelta:
        """Feed one token's bytes; returns the text that is now safe to emit."""
        if self.stopped_on is not None:
            return TextDelta("", self.stopped_on)
        self._pending += self._decoder.decode(piece)
        return self._release()

    def finish(self) -> TextDelta:
        """Flush at the end of generation (incomplete bytes become U+FFFD)."""
        if self.stopped_on is not None:
            return TextDelta("", self.stopped_on)
        self._pending += self._decoder.decode(b"", final=True)
        out, self._pending = self._pending, ""
        self.text += out
        return TextDelta(out)

    def _release(self) -> TextDelta:
        if not self._stop:
            out, self._pending = self._pending, ""
            self.text += out
            return TextDelta(out)
        # Released text never holds the start of a stop string, so searching
        # the pending text alone finds every match.
        first: tuple[int, str] | None = None
        for stop in self._stop:
            at = self._pending.find(stop)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, stop)
        if first is not None:
            out = self._pending[: first[0]]
            self._pending = ""
            self.text += out
            self.stopped_on = first[1]
            return TextDelta(out, first[1])
        hold = _longest_stop_prefix_suffix(self._pending, self._stop)
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        self.text += out
        return TextDelta(out)


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
