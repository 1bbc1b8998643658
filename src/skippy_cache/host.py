"""The host tier: exact sequence state demoted from the KV pool to RAM.

Every cell resident in llama.cpp's unified pool widens the KV view of every
decode (the CPU flash-attention kernel walks the whole view, masked or not),
so an entry nobody is using costs every other request time. Demoting it here
frees its cells; restoring it (`llama_state_seq_set_data`) costs a copy, a
small fraction of recomputing it (the README gives the figures).

Books only: the payload is whatever bytes the runtime got from
`llama_state_seq_get_data`, keyed by the same page id the resident entry had,
so a host hit is exact for the same reasons a resident hit is.

Invariants, checked by `check_invariants` and the property tests:
- booked bytes equal the sum of the entries' sizes and never exceed `max_bytes`;
- entries are ordered least recently used first; eviction takes the first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from skippy_cache.identity import PageId


@dataclass(frozen=True, slots=True)
class HostEntry:
    token_count: int
    #: Sequence state as `llama_state_seq_get_data` wrote it.
    payload: bytes | bytearray
    #: A whole-prompt entry's first-token logits (float32 bytes); None for prefix entries.
    logits: bytes | None = None

    @property
    def nbytes(self) -> int:
        return len(self.payload) + (len(self.logits) if self.logits is not None else 0)


@dataclass(frozen=True, slots=True)
class HostTierStats:
    entries: int
    bytes: int
    max_bytes: int
    puts: int
    evictions: int
    #: Payloads larger than the whole tier, never stored.
    rejected: int


class HostTier:
    """An LRU of exact sequence states under a byte budget."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"a host tier needs a positive byte budget, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[PageId, HostEntry] = OrderedDict()
        self._bytes = 0
        self._puts = 0
        self._evictions = 0
        self._rejected = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, page_id: object) -> bool:
        return page_id in self._entries

    def pages(self) -> list[PageId]:
        """Every page held, least recently used first."""
        return list(self._entries)

    def get(self, page_id: PageId) -> HostEntry | None:
        """The entry, now the most recently used (a use: the caller restores it)."""
        entry = self._entries.get(page_id)
        if entry is not None:
            self._entries.move_to_end(page_id)
        return entry

    def peek(self, page_id: PageId) -> HostEntry | None:
        """The entry, without touching recency."""
        return self._entries.get(page_id)

    def touch(self, page_id: PageId) -> bool:
        """Make an entry the most recently used (a second demotion of the same state); False if absent."""
        if page_id not in self._entries:
            return False
        self._entries.move_to_end(page_id)
        return True

    def put(self, page_id: PageId, entry: HostEntry) -> list[PageId]:
        """Store an entry, evicting least recently used ones to fit; returns the evicted page ids.

        An entry alone over the budget is not stored (and evicts nothing).
        """
        size = entry.nbytes
        if size > self.max_bytes:
            self._rejected += 1
            return []
        self.discard(page_id)
        evicted = []
        while self._bytes + size > self.max_bytes:
            victim, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
            self._evictions += 1
            evicted.append(victim)
        self._entries[page_id] = entry
        self._bytes += size
        self._puts += 1
        return evicted

    def discard(self, page_id: PageId) -> bool:
        """Forget an entry (a restore of it failed, or the cache is cleared); False if absent."""
        entry = self._entries.pop(page_id, None)
        if entry is None:
            return False
        self._bytes -= entry.nbytes
        return True

    def clear(self) -> int:
        n = len(self._entries)
        self._entries.clear()
        self._bytes = 0
        return n

    def stats(self) -> HostTierStats:
        return HostTierStats(
            entries=len(self._entries),
            bytes=self._bytes,
            max_bytes=self.max_bytes,
            puts=self._puts,
            evictions=self._evictions,
            rejected=self._rejected,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if the books contradict themselves (tests and debug)."""
        total = sum(e.nbytes for e in self._entries.values())
        assert total == self._bytes, f"byte books {self._bytes} != entries' {total}"
        assert self._bytes <= self.max_bytes, f"{self._bytes} bytes over the budget {self.max_bytes}"
