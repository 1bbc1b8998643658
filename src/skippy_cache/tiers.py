"""The cache's tiers, and the one decision of a lookup: what a new lane reuses, from where, and why not more.

Tiers, fastest first:
- resident: entries whose cells sit in the llama.cpp pool (`ResidentPrefixCache`);
  reusing one is a `seq_cp`, nothing is copied;
- state tiers: exact sequence states outside the pool, today the host tier in
  RAM (`HostTier`); reusing one is a restore. A tier is anything that keeps
  `HostEntry` values by page id behind the `StateTier` interface, so a disk or
  a remote tier slots in here without touching the engine.

Fast mode files the tokens of every entry in the token radix index
(`PrefixIndex`), so a hit may be any leading part of any entry. Deterministic
mode has no index: it looks up the seed's grid lengths, resident only, because
a lane's own cells must start a fresh run aligned with the 64-token grid.

`plan` is pure: it reads the books and touches nothing (no recency, no
counters), so the same call answers "what would this request reuse?" without
running it. The runtime then applies the hit and counts it once.

Invariants, checked by `check_invariants`:
- with an index, a page is indexed iff it is resident or in a state tier;
- first-token logits are kept only for resident pages (a state tier keeps its
  own copy in the entry);
- each tier's own invariants.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from skippy_cache.host import HostEntry, HostTier, HostTierStats
from skippy_cache.identity import PageId, PrefixIdentity
from skippy_cache.radix import PrefixIndex
from skippy_cache.resident import ResidentCacheStats, ResidentPrefixCache


class Source(str, enum.Enum):
    """Where a lane's reused state comes from."""

    NONE = "none"
    RESIDENT = "resident"
    RAM = "ram"


class Why(str, enum.Enum):
    """Why a hit covers what it covers and no more."""

    #: The whole prompt, with its first-token logits: nothing is left to decode.
    EXACT_REPEAT = "exact_repeat"
    #: Every token before the last, which always gets a decode of its own.
    ALL_BUT_LAST = "all_but_last"
    #: A stored prompt shares only the first `length` tokens.
    DIVERGED = "diverged"
    #: Deterministic mode reuses grid lengths only.
    GRID = "grid"
    #: Nothing cached shares `min_tokens` leading tokens with the prompt.
    NEVER_SEEN = "never_seen"
    BELOW_MIN_TOKENS = "below_min_tokens"
    #: A state tier holds it, but the pool had no free cells to restore it into.
    NO_ROOM = "no_room"
    #: The request asked not to look up.
    LOOKUP_OFF = "lookup_off"
    CACHE_DISABLED = "cache_disabled"


@dataclass(frozen=True, slots=True)
class Hit:
    """What a new lane starts from: the first `length` positions of `page_id`'s entry in `source`."""

    source: Source
    page_id: PageId | None
    length: int
    why: Why
    #: An exact repeat's first-token logits (the lane samples from them; no decode).
    logits: np.ndarray | None = None

    @classmethod
    def miss(cls, why: Why) -> Hit:
        return cls(Source.NONE, None, 0, why)

    @property
    def whole(self) -> bool:
        return self.why is Why.EXACT_REPEAT


@dataclass(frozen=True, slots=True)
class Query:
    """What a lookup needs to know about one prompt.

    `tokens` are the positions a hit may cover: the prompt without its last
    token, which is always decoded on its own step.
    """

    space: Hashable
    tokens: Sequence[int]
    #: The whole-prompt identity (fast mode), None when the prompt is too short to record.
    whole: PrefixIdentity | None = None
    #: Deterministic mode: the grid lengths to look up, longest first; None in fast mode.
    grid: tuple[PrefixIdentity, ...] | None = None
    #: Set when the request may not look up at all, with the reason.
    refused: Why | None = None


class StateTier(Protocol):
    """A tier of exact sequence states outside the pool, keyed by page id."""

    def __contains__(self, page_id: object) -> bool: ...

    def peek(self, page_id: PageId) -> HostEntry | None: ...

    def get(self, page_id: PageId) -> HostEntry | None: ...

    def put(self, page_id: PageId, entry: HostEntry) -> list[PageId]: ...

    def discard(self, page_id: PageId) -> bool: ...

    def pages(self) -> list[PageId]: ...

    def clear(self) -> int: ...

    def stats(self) -> HostTierStats: ...

    def check_invariants(self) -> None: ...


@dataclass(slots=True)
class CacheCounters:
    """The cache's one counter set: each request's lookup counted once. Owned by the runtime's `PrefixCache`."""

    lookups: int = 0
    #: Lookups that reused at least one token, and the tokens they reused.
    hits: int = 0
    hit_tokens: int = 0
    #: Of those, restored from the host tier (RAM) rather than copied from a resident entry.
    host_hits: int = 0
    host_hit_tokens: int = 0
    #: Restores llama.cpp refused (served as misses; the state is dropped).
    restore_failures: int = 0
    records: int = 0
    #: Records refused because every entry was held (serving went on uncached).
    record_skips: int = 0
    #: Entries evicted to fit a record's budget, to free cells for a decode, or for sitting idle.
    budget_evictions: int = 0
    proactive_evictions: int = 0
    idle_evictions: int = 0
    #: Evicted entries whose state was copied to the host tier.
    demotions: int = 0
    #: New lanes that shared the cells of a prefix another running lane was
    #: prefilling, and the tokens that saved them beyond their own hit.
    joins: int = 0
    join_tokens: int = 0


@dataclass(frozen=True, slots=True)
class CacheStats:
    resident: ResidentCacheStats
    #: None without a host tier.
    host: HostTierStats | None
    counters: CacheCounters


class CacheTiers:
    """The resident books, the state tiers, the index and the logits of whole-prompt entries."""

    def __init__(
        self, resident: ResidentPrefixCache, host: HostTier | None = None, index: PrefixIndex | None = None
    ) -> None:
        self.resident = resident
        self.host = host
        #: Fast mode only: the tokens of every entry in any tier.
        self.index = index
        #: First-token logits of resident whole-prompt entries.
        self.logits: dict[PageId, np.ndarray] = {}

    @property
    def state_tiers(self) -> tuple[tuple[Source, StateTier], ...]:
        """Every tier outside the pool, fastest first, with the source a hit on it reports."""
        return ((Source.RAM, self.host),) if self.host is not None else ()

    @property
    def min_tokens(self) -> int:
        return self.resident.config.min_tokens

    def plan(self, query: Query) -> Hit:
        """The longest cached state for the query's prompt, from the fastest tier holding it.

        At equal length a resident entry wins (a `seq_cp`, not a restore).
        """
        if query.refused is not None:
            return Hit.miss(query.refused)
        if query.grid is not None:
            for prefix in query.grid:
                if prefix.page_id in self.resident:
                    return Hit(Source.RESIDENT, prefix.page_id, prefix.token_count, Why.GRID)
            return Hit.miss(Why.NEVER_SEEN)
        if query.whole is not None:
            hit = self._whole(query.whole)
            if hit is not None:
                return hit
        if self.index is None:
            return Hit.miss(Why.NEVER_SEEN)
        # Any leading part of an entry is exact state for those tokens (attention is causal).
        match = self.index.longest(query.space, query.tokens, prefer=self.resident, min_length=self.min_tokens)
        if match is None:
            return Hit.miss(Why.NEVER_SEEN)
        why = Why.ALL_BUT_LAST if match.length >= len(query.tokens) else Why.DIVERGED
        return Hit(self.source_of(match.page_id), match.page_id, match.length, why)

    def _whole(self, prompt: PrefixIdentity) -> Hit | None:
        page = prompt.page_id
        if page in self.resident:
            logits = self.logits.get(page)
            assert logits is not None, f"resident whole-prompt entry {page} lost its logits"
            return Hit(Source.RESIDENT, page, prompt.token_count, Why.EXACT_REPEAT, logits)
        for source, tier in self.state_tiers:
            entry = tier.peek(page)
            if entry is not None:
                assert entry.logits is not None, f"whole-prompt entry {page} in {source.value} has no logits"
                logits = np.frombuffer(entry.logits, dtype=np.float32).copy()
                return Hit(source, page, prompt.token_count, Why.EXACT_REPEAT, logits)
        return None

    def source_of(self, page_id: PageId) -> Source:
        if page_id in self.resident:
            return Source.RESIDENT
        for source, tier in self.state_tiers:
            if page_id in tier:
                return source
        return Source.NONE

    def file(self, page_id: PageId, space: Hashable, tokens: Sequence[int]) -> None:
        """Index an entry's tokens (fast mode), once."""
        if self.index is not None and page_id not in self.index:
            self.index.insert(space, tokens, page_id)

    def forget_if_gone(self, page_id: PageId) -> None:
        """A page that left a tier stays indexed only while another tier still holds it."""
        if page_id not in self.resident:
            self.logits.pop(page_id, None)
            if self.index is not None and self.source_of(page_id) is Source.NONE:
                self.index.remove(page_id)

    def check_invariants(self) -> None:
        """Raise AssertionError if the tiers contradict each other (tests and debug)."""
        self.resident.check_invariants()
        for _, tier in self.state_tiers:
            tier.check_invariants()
        stray = [page for page in self.logits if page not in self.resident]
        assert not stray, f"logits kept for pages that are not resident: {stray}"
        if self.index is not None:
            self.index.check_invariants()
            held = {e.page_id for e in self.resident.entries()}
            for _, tier in self.state_tiers:
                held.update(tier.pages())
            indexed = {page for page in held if page in self.index}
            assert indexed == held, f"pages held but not indexed: {sorted(held - indexed)}"
            assert len(self.index) == len(held), (
                f"{len(self.index)} pages indexed, {len(held)} held: an evicted page stayed in the index"
            )
