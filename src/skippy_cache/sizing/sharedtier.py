"""The shared tier in a replay: a Redis or Valkey server's memory and eviction, as the replicas drive it.

The replicas' side is the serving path's own: each use sets the keys' expiry
times from `sharedorder.deadlines`, with the tier's turnover estimated by
`sharedorder.Turnover` from the server's counters, polled as often as a live
replica polls them. The server's side is modeled: under `volatile-ttl` it
evicts the key whose expiry time comes first, under `allkeys-lru` the least
recently used one. A real server samples a few keys per eviction
(`maxmemory-samples`) and picks the best of them, so it only approximates
either order; the model evicts exactly.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable, Sequence

from skippy_cache.eviction import LruBooks
from skippy_cache.sharedorder import Turnover, deadlines

#: Seconds a key lives unless used again (`RemoteConfig.ttl_s`).
TTL_S = 24 * 3600.0


class ServerPolicy(str, enum.Enum):
    #: The nearest expiry time first: the replicas' LRFU order (sharedorder.py).
    VOLATILE_TTL = "volatile-ttl"
    #: The least recently used key first.
    ALLKEYS_LRU = "allkeys-lru"


class SharedTier:
    """One server's keys (chunk key -> bytes) within `max_bytes`, evicted by `policy`."""

    def __init__(
        self, max_bytes: int, policy: ServerPolicy, clock: Callable[[], float], ttl: float = TTL_S
    ) -> None:
        self.max_bytes = max_bytes
        self.policy = policy
        self.clock = clock
        self.ttl = ttl
        self.turnover = Turnover()
        self.evicted = 0
        #: key -> size, in LRU order (allkeys-lru evicts by it).
        self._books = LruBooks()
        #: key -> its expiry time, and a heap of them, stale pairs skipped (volatile-ttl).
        self._deadline: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []

    def __contains__(self, key: object) -> bool:
        return key in self._books

    def __len__(self) -> int:
        return len(self._books)

    @property
    def bytes(self) -> int:
        return self._books.bytes

    def size(self, key: str) -> int:
        return self._books.size(key)

    def fetch(self, key: str) -> bool:
        """A replica reads a key (`GETEX ... PXAT`, a second use): whether the server held it."""
        if key not in self._books:
            return False
        now = self._poll()
        (deadline,) = deadlines(now, 1, reused=1, tail_repeat_only=False, turnover=self.turnover.value,
                                ttl=self.ttl)
        self._renew(key, deadline)
        return True

    def use(self, keys: Sequence[str], sizes: Sequence[int], *, reused: int, tail_repeat_only: bool) -> int:
        """A replica shares a prompt's keys (its chunks, then its tail), of which it reused the first
        `reused`: each held one renewed (`PEXPIREAT`), each other one written (`SET ... PXAT`).
        The bytes newly stored."""
        now = self._poll()
        due = deadlines(now, len(keys), reused=reused, tail_repeat_only=tail_repeat_only,
                        turnover=self.turnover.value, ttl=self.ttl)
        written = 0
        for key, size, deadline in zip(keys, sizes, due, strict=True):
            if key in self._books:
                self._renew(key, deadline)
            elif self._make_room(size):
                self._books.add(key, size)
                self._renew(key, deadline)
                written += size
        return written

    def _poll(self) -> float:
        now = self.clock()
        if self.turnover.due(now):
            self.turnover.observe(now, self.evicted, len(self._books))
        return now

    def _renew(self, key: str, deadline: float) -> None:
        self._books.touch(key)
        if self.policy is ServerPolicy.VOLATILE_TTL:
            self._deadline[key] = deadline
            heapq.heappush(self._heap, (deadline, key))
            if len(self._heap) > 4 * len(self._deadline) + 1024:
                # Stale pairs outnumber the live ones: rebuild rather than let the heap grow with every use.
                self._heap = [(d, k) for k, d in self._deadline.items()]
                heapq.heapify(self._heap)

    def _make_room(self, size: int) -> bool:
        """Evict until `size` more bytes fit; False (the write is refused) when they never would."""
        if size > self.max_bytes:
            return False
        while self.bytes + size > self.max_bytes:
            self._evict_one()
        return True

    def _evict_one(self) -> None:
        if self.policy is ServerPolicy.ALLKEYS_LRU:
            self._books.evict()
        else:
            while True:
                deadline, key = heapq.heappop(self._heap)
                if self._deadline.get(key) == deadline:
                    break
            del self._deadline[key]
            self._books.remove(key)
        self.evicted += 1
