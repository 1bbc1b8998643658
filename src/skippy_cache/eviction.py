"""Which chunk a tier lets go first: the books of a budgeted tier, in eviction order.

A tier (RAM or disk) keeps `key -> size` here and asks `evict()` for a victim
whenever a new chunk does not fit. Two orders:

- `LRU`: the least recently used chunk first, as every peer does.
- `LRFU` (the default): recency and frequency over the prefix tree.
  - A chunk is only worth its tokens while every chunk before it in its prompt
    is held too (a lookup stops at the first miss), so only *leaves* (chunks
    no held chunk continues) are evicted; LRU evicts a prompt's first chunks
    first, leaving the rest held and useless.
  - Among leaves, the lowest `last use + B x T (if used twice or more) - T (if
    a tail)` goes first. `T` is the tier's own time scale: a running average of
    how long evicted chunks had sat unused. So a chunk that came back once
    (most never do) stays `B` turnovers longer, and a tail (the rows that end a
    prompt, found only by an exact repeat of it) one turnover less, whatever
    the traffic rate. With nothing evicted yet, `T` is 0 and the order is LRU.
  - The bonus `B` is the one that would have served most lately. Shadow books
    (keys and sizes only, no values) replay the same uses at the same
    capacity with each of `BONUSES`; at each turnover (as many evictions as
    chunks held) the books take the bonus of the shadow that served the most
    bytes, its past turnovers weighing less and less. How long a returning
    chunk must be kept depends on the traffic and the tier's size: on the same
    trace a small tier is served best by a long bonus and a large one by none.
  - Leaves wait in one heap per class (used twice or not, a tail or not) by
    last use, and the class's offset is added when a victim is picked, so a new
    `T` or `B` re-orders every leaf at once; a bonus fixed into each leaf's rank
    when it was used would keep the old order for a whole turnover after a change.
  - A chunk evicted and then produced again keeps the uses it had: the books
    remember the keys of their last evictions (`GHOSTS` times as many as they
    hold), so a prefix that comes back after a long gap counts as used again.
  - Uses at one instant count once (a restore reads a chunk, then the entry
    that reused it writes it again).

Why these rules and what they buy, replayed on public traces: docs/sizing.md.

Invariants, checked by `check_invariants` and the property tests:
- booked bytes equal the sum of the sizes held;
- (LRFU) a chunk's parent, when set, is held and counts it among its children;
  a chunk is a candidate for eviction exactly when it has no children, so the
  parent links never form a cycle and `evict` always finds a victim;
- (LRFU) a leaf is ranked in the heap of its class; a shadow holds no more
  bytes than the most the books have held.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

#: Weight of the newest eviction in `T`, the running average of evicted chunks' idle time.
_T_WEIGHT = 0.01
#: LRFU remembers the uses of this many evicted keys per key it holds.
GHOSTS = 4
#: The reuse bonuses, in turnovers, that LRFU's shadow books try (module docstring).
BONUSES = (0.0, 1.0, 2.0, 3.0)
#: At each turnover a shadow's score keeps this share of its last score, plus the bytes it served since.
_SCORE_MEMORY = 0.9


class Policy(str, enum.Enum):
    LRU = "lru"
    LRFU = "lrfu"


class Books(Protocol):
    """A tier's `key -> size`, in the order its policy evicts them."""

    #: LRFU: the turnovers a chunk used twice stays longer, as lately chosen; None for LRU.
    bonus: float | None

    @property
    def bytes(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...

    def size(self, key: str) -> int: ...

    def keys(self) -> list[str]: ...

    def add(self, key: str, size: int, *, parent: str | None = None, tail: bool = False) -> None:
        """Book a new chunk as just used. `parent`: the chunk before it in its prompt; `tail`: it ends
        a prompt off the block grid. Hints a policy may ignore; a key already held is only `touch`ed."""
        ...

    def touch(self, key: str) -> None:
        """A use of a held chunk (a read, or another prompt producing it again)."""
        ...

    def remove(self, key: str) -> int:
        """Forget a chunk (not an eviction: it was discarded or failed); its size, 0 if not held."""
        ...

    def evict(self) -> tuple[str, int]:
        """Take the policy's victim off the books: its key and size. Raises KeyError when empty."""
        ...

    def check_invariants(self) -> None: ...


def make_books(policy: Policy | str, clock: Callable[[], float] = time.monotonic) -> Books:
    """Empty books for `policy`; `clock` gives the time in seconds (a replay passes its trace's)."""
    policy = Policy(policy)
    return LruBooks() if policy is Policy.LRU else LrfuBooks(clock)


class LruBooks:
    """Least recently used first."""

    bonus = None

    def __init__(self) -> None:
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0

    @property
    def bytes(self) -> int:
        return self._bytes

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def size(self, key: str) -> int:
        return self._sizes[key]

    def keys(self) -> list[str]:
        return list(self._sizes)

    def add(self, key: str, size: int, *, parent: str | None = None, tail: bool = False) -> None:
        if key in self._sizes:
            self.touch(key)
            return
        self._sizes[key] = size
        self._bytes += size

    def touch(self, key: str) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def remove(self, key: str) -> int:
        size = self._sizes.pop(key, 0)
        self._bytes -= size
        return size

    def evict(self) -> tuple[str, int]:
        key, size = self._sizes.popitem(last=False)
        self._bytes -= size
        return key, size

    def check_invariants(self) -> None:
        total = sum(self._sizes.values())
        assert total == self._bytes, f"booked bytes {self._bytes} != sizes held {total}"


@dataclass(slots=True)
class _Chunk:
    size: int
    tail: bool
    parent: str | None
    last: float
    uses: int = 1
    children: set[str] = field(default_factory=set)
    #: The heap entry that stands for this chunk (stale entries are skipped); 0 while it has children.
    stamp: int = 0


class _Lrfu:
    """LRFU's books with a fixed reuse bonus (in turnovers): leaves only, in one heap per class (used
    twice or not, a tail or not) ordered by last use; the class's offset is added when a victim is
    picked, so a new turnover or bonus re-ranks every leaf at once."""

    def __init__(self, clock: Callable[[], float], bonus: float) -> None:
        self._clock = clock
        self.bonus = bonus
        self._chunks: dict[str, _Chunk] = {}
        #: (used twice, tail) -> heap of (last use, stamp, key) of that class's leaves.
        self._heaps: dict[tuple[bool, bool], list[tuple[float, int, str]]] = {
            (used, tail): [] for used in (False, True) for tail in (False, True)
        }
        self._stamps = itertools.count(1)
        self._bytes = 0
        #: Seconds evicted chunks had sat unused, on average (recent evictions weigh most).
        self.time_scale = 0.0
        #: Evicted keys and the uses they had, oldest eviction first.
        self._ghosts: OrderedDict[str, int] = OrderedDict()

    @property
    def bytes(self) -> int:
        return self._bytes

    def __contains__(self, key: object) -> bool:
        return key in self._chunks

    def __len__(self) -> int:
        return len(self._chunks)

    def size(self, key: str) -> int:
        return self._chunks[key].size

    def keys(self) -> list[str]:
        return list(self._chunks)

    def add(self, key: str, size: int, *, parent: str | None = None, tail: bool = False) -> None:
        if key in self._chunks:
            self.touch(key)
            return
        # A parent not held (or the chunk itself) links nothing: the chunk starts a tree of its own.
        above = self._chunks.get(parent) if parent is not None and parent != key else None
        uses = self._ghosts.pop(key, 0) + 1
        self._chunks[key] = _Chunk(size, tail, parent if above is not None else None, self._clock(), uses)
        self._bytes += size
        if above is not None:
            above.children.add(key)
            above.stamp = 0  # no longer a leaf
        self._rank(key)

    def touch(self, key: str) -> None:
        chunk = self._chunks.get(key)
        if chunk is None:
            return
        now = self._clock()
        if now > chunk.last:
            chunk.uses += 1  # uses at one instant (a restore's read, then the same entry's write) count once
        chunk.last = now
        if not chunk.children:
            self._rank(key)

    def remove(self, key: str) -> int:
        chunk = self._chunks.pop(key, None)
        if chunk is None:
            return 0
        self._bytes -= chunk.size
        for child in chunk.children:
            self._chunks[child].parent = None  # the rest of the prompt is still held: its own tree now
        if chunk.parent is not None:
            above = self._chunks[chunk.parent]
            above.children.discard(key)
            if not above.children:
                self._rank(chunk.parent)
        return chunk.size

    def evict(self) -> tuple[str, int]:
        t = self.time_scale
        best: tuple[float, tuple[bool, bool]] | None = None
        for kind, heap in self._heaps.items():
            while heap and not self._live(heap[0]):
                heapq.heappop(heap)  # stale: re-ranked since, gained a child, or removed
            if heap:
                used, tail = kind
                priority = heap[0][0] + (self.bonus * t if used else 0.0) - (t if tail else 0.0)
                if best is None or priority < best[0]:
                    best = (priority, kind)
        if best is None:
            raise KeyError("evict from empty books")
        _, _, key = heapq.heappop(self._heaps[best[1]])
        chunk = self._chunks[key]
        idle = max(self._clock() - chunk.last, 0.0)
        self.time_scale += _T_WEIGHT * (idle - self.time_scale)
        size = self.remove(key)
        self._ghosts[key] = chunk.uses
        while len(self._ghosts) > GHOSTS * max(len(self._chunks), 1):
            self._ghosts.popitem(last=False)
        return key, size

    def _rank(self, key: str) -> None:
        chunk = self._chunks[key]
        chunk.stamp = next(self._stamps)
        kind = (chunk.uses > 1, chunk.tail)
        heap = self._heaps[kind]
        heapq.heappush(heap, (chunk.last, chunk.stamp, key))
        if len(heap) > 2 * len(self._chunks) + 64:
            # Stale entries outnumber live ones: rebuild from the live ones.
            heap[:] = [entry for entry in heap if self._live(entry)]
            heapq.heapify(heap)

    def _live(self, entry: tuple[float, int, str]) -> bool:
        chunk = self._chunks.get(entry[2])
        return chunk is not None and chunk.stamp == entry[1]

    def check_invariants(self) -> None:
        total = sum(c.size for c in self._chunks.values())
        assert total == self._bytes, f"booked bytes {self._bytes} != sizes held {total}"
        live = {
            entry[2]: kind for kind, heap in self._heaps.items() for entry in heap if self._live(entry)
        }
        for key, chunk in self._chunks.items():
            if chunk.parent is not None:
                assert key in self._chunks[chunk.parent].children, f"{key}'s parent does not list it"
            for child in chunk.children:
                assert self._chunks[child].parent == key, f"{key} lists {child}, whose parent is another"
            assert (key in live) == (not chunk.children), f"{key}: a leaf is not ranked, or a parent is"
            if key in live:
                assert live[key] == (chunk.uses > 1, chunk.tail), f"{key} is ranked in another class"


class _Shadow(_Lrfu):
    """Books of keys and sizes only, run on the same uses as the real books with another bonus, that
    count the bytes they would have served."""

    def __init__(self, clock: Callable[[], float], bonus: float) -> None:
        super().__init__(clock, bonus)
        #: key -> the chunk before it in its prompt, as first given (held or not).
        self._origin: dict[str, str | None] = {}
        self.served = 0

    def see(self, key: str, size: int, parent: str | None, tail: bool, capacity: int) -> None:
        """A use of `key` in the real books; these books hold at most `capacity` bytes."""
        chunk = self._chunks.get(key)
        if chunk is not None:
            origin = self._origin[key]
            # Served only if a lookup would reach it (the chunk before it held too), once per instant:
            # a restore reads a chunk and its entry writes it again, one use.
            if self._clock() > chunk.last and (origin is None or origin in self._chunks):
                self.served += chunk.size
            self.touch(key)
            return
        while self._bytes + size > capacity and self._chunks:
            del self._origin[self.evict()[0]]
        self.add(key, size, parent=parent, tail=tail)
        self._origin[key] = parent


class LrfuBooks(_Lrfu):
    """Leaves of the prefix tree only, lowest `last use + bonus x T (used twice) - T (a tail)` first, uses
    remembered past eviction, the bonus the one its shadow books found to serve most (module docstring)."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, *, bonuses: tuple[float, ...] = BONUSES
    ) -> None:
        """`bonuses`: those the shadow books try; one alone is the bonus, fixed, and runs no shadows."""
        if not bonuses:
            raise ValueError("LRFU needs a bonus to try")
        super().__init__(clock, bonus=1.0 if len(bonuses) > 1 else bonuses[0])
        self._shadows = [_Shadow(clock, bonus) for bonus in bonuses] if len(bonuses) > 1 else []
        self._scores = [0.0] * len(self._shadows)
        #: The most bytes these books have held: the shadows' capacity (a tier evicts only when full).
        self._capacity = 0
        self._evictions = 0  # since the shadows were last scored

    def add(self, key: str, size: int, *, parent: str | None = None, tail: bool = False) -> None:
        if key in self._chunks:
            self.touch(key)
            return
        super().add(key, size, parent=parent, tail=tail)
        self._capacity = max(self._capacity, self._bytes)
        for shadow in self._shadows:
            shadow.see(key, size, parent, tail, self._capacity)

    def touch(self, key: str) -> None:
        chunk = self._chunks.get(key)
        if chunk is None:
            return
        for shadow in self._shadows:
            shadow.see(key, chunk.size, chunk.parent, chunk.tail, self._capacity)
        super().touch(key)

    def evict(self) -> tuple[str, int]:
        victim = super().evict()
        self._evictions += 1
        if self._shadows and self._evictions >= len(self._chunks):
            # One turnover of what the books hold: take the bonus of the shadow that served most lately.
            self._evictions = 0
            self._scores = [
                _SCORE_MEMORY * score + shadow.served
                for score, shadow in zip(self._scores, self._shadows, strict=True)
            ]
            for shadow in self._shadows:
                shadow.served = 0
            best = max(
                range(len(self._shadows)),
                key=lambda i: (self._scores[i], self._shadows[i].bonus == self.bonus),
            )
            self.bonus = self._shadows[best].bonus
        return victim

    def check_invariants(self) -> None:
        super().check_invariants()
        for shadow in self._shadows:
            shadow.check_invariants()
            assert shadow.bytes <= self._capacity, f"a shadow holds {shadow.bytes} bytes, over {self._capacity}"
