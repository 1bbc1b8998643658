"""What the plan cannot know about a miss: a prefix that was cached and left, or the same tokens under another namespace.

`CacheTiers.plan` sees only what is held now, so a prompt it cannot reuse is
`never_seen` or `diverged` to it. Two bounded books tell the user more:

- ghosts: identities of prefixes that left the pool, with when (hashes,
  never tokens). A prompt whose prefix is a ghost, longer than what the plan
  found, missed because that prefix was evicted: a bigger cache would have
  served it (the recoverable misses);
- namespaces: the namespace-free identities of recorded prefixes, each with
  digests of the tenant and the namespace it was recorded in. A prompt whose
  tokens were recorded under another `cache_salt` missed because namespaces
  never share; the other namespace is never named. Whether that namespace is
  the same tenant's is kept too: another tenant's prompt must never be told
  to a user, not even as a miss reason (tiers.Why.TENANT).

Both books hold prefix identities at the same lengths (`lengths`: every
multiple of the grid, and the whole prefix), so a prompt's identities at
those lengths find any prefix it shares with a recorded one, to the grid.

Invariants: each book holds at most `capacity` identities, oldest dropped
first; a prefix recorded again is no longer a ghost.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from skippy_cache.identity import PageId

#: How long ago a prefix was evicted, as responses report it.
AGE_BUCKETS: tuple[tuple[float, str], ...] = ((60.0, "<1 min"), (300.0, "<5 min"), (3600.0, "<1 h"))
OLDER = "older"


def age_bucket(seconds: float) -> str:
    for limit, label in AGE_BUCKETS:
        if seconds < limit:
            return label
    return OLDER


def lengths(token_count: int, grid: int) -> list[int]:
    """The lengths a prefix of `token_count` tokens is booked at: multiples of `grid`, and its whole length."""
    out = list(range(grid, token_count + 1, grid))
    if token_count > 0 and (not out or out[-1] != token_count):
        out.append(token_count)
    return out


@dataclass(frozen=True, slots=True)
class Evicted:
    """The longest prefix of a prompt that was cached and left: its length and when it left."""

    length: int
    at: float


class MissBook:
    def __init__(self, capacity: int = 65536) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._ghosts: OrderedDict[PageId, float] = OrderedDict()
        #: Namespace-free identity -> (tenant digest, namespace digest) it was last recorded under.
        self._namespaces: OrderedDict[PageId, tuple[str, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ghosts) + len(self._namespaces)

    # -- books ---------------------------------------------------------------------------

    def left(self, ids: Iterable[PageId], now: float) -> None:
        """Prefixes that left the pool at `now` (their identities at the booked lengths)."""
        for page_id in ids:
            self._ghosts[page_id] = now
            self._ghosts.move_to_end(page_id)
        _trim(self._ghosts, self.capacity)

    def held(self, ids: Iterable[PageId]) -> None:
        """Prefixes cached again: no longer ghosts."""
        for page_id in ids:
            self._ghosts.pop(page_id, None)

    def recorded(self, unsalted: Iterable[PageId], scope: tuple[str, str]) -> None:
        """Prefixes recorded in a scope (tenant digest, namespace digest), by their namespace-free
        identities."""
        for page_id in unsalted:
            self._namespaces[page_id] = scope
            self._namespaces.move_to_end(page_id)
        _trim(self._namespaces, self.capacity)

    # -- questions -------------------------------------------------------------------------

    def evicted(self, ids: Mapping[int, PageId], longer_than: int) -> Evicted | None:
        """The longest of a prompt's prefixes (`ids`: length -> identity) that is a ghost, if longer than
        `longer_than` (what the plan found held)."""
        for length in sorted(ids, reverse=True):
            if length <= longer_than:
                return None
            at = self._ghosts.get(ids[length])
            if at is not None:
                return Evicted(length, at)
        return None

    def other_namespace(self, unsalted: Mapping[int, PageId], scope: tuple[str, str],
                        longer_than: int) -> tuple[int, bool]:
        """The longest of a prompt's prefixes recorded under another namespace than `scope`'s, if
        longer than `longer_than` (0 if none), and whether that namespace is the same tenant's."""
        for length in sorted(unsalted, reverse=True):
            if length <= longer_than:
                return 0, True
            seen = self._namespaces.get(unsalted[length])
            if seen is not None and seen != scope:
                return length, seen[0] == scope[0]
        return 0, True

    def check_invariants(self) -> None:
        assert len(self._ghosts) <= self.capacity, f"{len(self._ghosts)} ghosts over {self.capacity}"
        assert len(self._namespaces) <= self.capacity, f"{len(self._namespaces)} namespaces over {self.capacity}"


def _trim(book: OrderedDict, capacity: int) -> None:
    while len(book) > capacity:
        book.popitem(last=False)
