"""The cache's tiers, and the one decision of a lookup: what a new lane reuses, from where, and why not more.

Tiers, fastest first:
- resident: entries whose cells sit in the llama.cpp pool (`ResidentPrefixCache`);
  reusing one is a `seq_cp`, nothing is copied;
- the state store: exact sequence states outside the pool, cut into chunks of
  token rows and kept in RAM and on disk (the runtime's `StateStore`, behind the
  `StateTier` interface); reusing one is a restore of the chunks it needs.

The tokens of every entry are filed in the token radix index (`PrefixIndex`),
so a hit may be any leading part of any entry held by this process. The store
is also probed by name: chunk i of a prompt is named by the prefix identity at
its end, so chunks written before a restart (or by another process) are found
from the prompt alone. Deterministic mode reuses of an entry only the rows its
prompt's cold run would compute with the same kernel (exact.py): each entry is
filed with the kernels of the prompt that computed it, and a chunk's name also
says which kernel computed each of its rows and every row before them.

`plan` is pure: it reads the books and touches nothing (no recency, no
counters), so the same call answers "what would this request reuse?" without
running it. The runtime then applies the hit and counts it once.

Invariants, checked by `check_invariants`:
- a page is indexed iff it is resident or in the store;
- a page has kernels iff it is indexed and was filed with them;
- first-token logits are kept here only for resident pages (the store keeps
  its own copy);
- each tier's own invariants.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from skippy_cache.chunkstore import ChunkStoreStats
from skippy_cache.exact import Kernels, exact_length
from skippy_cache.identity import PageId, PrefixIdentity
from skippy_cache.radix import PrefixIndex
from skippy_cache.resident import ResidentCacheStats, ResidentPrefixCache


class Source(str, enum.Enum):
    """Where a lane's reused state comes from."""

    NONE = "none"
    RESIDENT = "resident"
    RAM = "ram"
    DISK = "disk"
    #: Chunks another replica wrote to the shared tier (fetched into RAM before the restore).
    REMOTE = "remote"


class Why(str, enum.Enum):
    """Why a hit covers what it covers and no more."""

    #: The whole prompt, with its first-token logits: nothing is left to decode.
    EXACT_REPEAT = "exact_repeat"
    #: Every token before the last, which always gets a decode of its own.
    ALL_BUT_LAST = "all_but_last"
    #: A stored prompt shares only the first `length` tokens.
    DIVERGED = "diverged"
    #: Deterministic mode: the entry's next rows were computed by another kernel than this
    #: prompt's cold run would use (exact.py), or the prompt could not resume there as it did cold.
    GRID = "grid"
    #: A recurrent or hybrid model: a longer prefix is cached inside an entry, but its state
    #: exists only where an entry ends (a checkpoint), and none ends there (family.py).
    CHECKPOINT = "checkpoint"
    #: A sliding-window model: the entry that holds a longer prefix no longer holds the window
    #: before its end, and no entry ends there (family.py).
    WINDOW = "window"
    #: Nothing cached shares `min_tokens` leading tokens with the prompt.
    NEVER_SEEN = "never_seen"
    BELOW_MIN_TOKENS = "below_min_tokens"
    #: The store holds it, but the pool had no free cells to restore it into.
    NO_ROOM = "no_room"
    #: The store holds it, but restoring from its tier is measured slower than prefilling.
    RESTORE_SLOWER = "restore_slower"
    #: A longer prefix of the prompt was cached, and left (misses.py): a bigger cache would have served it.
    EVICTED = "evicted"
    #: The same tokens were recorded under another namespace (`cache_salt`), which never shares.
    NAMESPACE = "namespace"
    #: The same tokens were recorded by another tenant. Counted under this name for the operator;
    #: the request itself is told `never_seen` (`told`): a miss reason must not tell one tenant
    #: what another sent.
    TENANT = "tenant"
    #: The request asked not to look up.
    LOOKUP_OFF = "lookup_off"
    CACHE_DISABLED = "cache_disabled"


def told(reason: str | None) -> str | None:
    """A miss reason as the request that missed is told it."""
    return Why.NEVER_SEEN.value if reason == Why.TENANT.value else reason


@dataclass(frozen=True, slots=True)
class Hit:
    """What a new lane starts from: the first `length` positions of `page_id`'s entry in `source`."""

    source: Source
    page_id: PageId | None
    length: int
    why: Why
    #: An exact repeat's first-token logits (the lane samples from them; no decode).
    #: None on an exact repeat found in the store by name: they are read with its chunks.
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
    #: Deterministic mode: the kernels of the prompt's cold run (exact.py); None in fast mode.
    kernels: Kernels | None = None
    #: With a store: the identities at every multiple of its chunk size, shortest first.
    chunks: tuple[PrefixIdentity, ...] = ()
    #: With a store: the identities at the ends of the earlier replies the prompt resends, off the
    #: chunk grid: an entry that ended a reply keeps its last rows as a partial chunk named so.
    tails: tuple[PrefixIdentity, ...] = ()
    #: Set when the request may not look up at all, with the reason.
    refused: Why | None = None
    #: A hit must end where an entry ends (recurrent state, family.py); a shorter hit than the
    #: longest shared prefix says why with `short_why`.
    whole_entries: bool = False
    short_why: Why = Why.CHECKPOINT


class StateTier(Protocol):
    """Exact sequence states outside the pool, as the plan sees them.

    Pages are entries this process put there (indexed by their tokens); a
    probe finds chunks by name, whoever wrote them.
    """

    def __contains__(self, page_id: object) -> bool: ...

    def available(self, page_id: PageId) -> tuple[int, Source]:
        """How many leading tokens of the page can be restored now, and from the slowest tier involved."""
        ...

    def whole_logits(self, page_id: PageId) -> np.ndarray | None:
        """A whole-prompt page's first-token logits, if the page is held in full."""
        ...

    def probe(
        self, chunks: Sequence[PrefixIdentity], whole: PrefixIdentity | None, tails: Sequence[PrefixIdentity] = ()
    ) -> tuple[int, Source, bool]:
        """Tokens covered by consecutive chunks named by `chunks` from the start, their slowest tier,
        and whether the whole prompt `whole` (with its logits) is held too. Failing the whole prompt,
        the longest partial chunk of `tails` whose rows start where the run ends takes it to its end."""
        ...

    def pages(self) -> list[PageId]: ...

    def discard(self, page_id: PageId) -> bool: ...

    def check_invariants(self) -> None: ...


@dataclass(slots=True)
class CacheCounters:
    """The cache's one counter set: each request's lookup counted once. Owned by the runtime's `PrefixCache`."""

    lookups: int = 0
    #: Lookups that reused at least one token, and the tokens they reused.
    hits: int = 0
    hit_tokens: int = 0
    #: Of those, restored from the store rather than copied from a resident entry; the
    #: tokens and milliseconds they took; those that read at least one chunk from disk.
    restores: int = 0
    restore_tokens: int = 0
    #: Of those tokens, the ones a restore shared with a resident entry's cells instead of importing.
    restore_shared_tokens: int = 0
    restore_ms: float = 0.0
    disk_restores: int = 0
    #: Restores that used chunks fetched from the shared tier.
    remote_restores: int = 0
    #: Restores that failed (a chunk gone or quarantined, a state llama.cpp refused): served as misses.
    restore_failures: int = 0
    #: Restores skipped because their tier is measured slower than prefill.
    restores_skipped: int = 0
    records: int = 0
    #: Records refused because every entry was held (serving went on uncached).
    record_skips: int = 0
    #: Entries evicted to fit a record's budget, to free cells for a decode, or for sitting idle.
    budget_evictions: int = 0
    proactive_evictions: int = 0
    idle_evictions: int = 0
    #: Entries whose state went to the store (evicted ones, and records too large for the pool,
    #: taken from their lane), and those the store's writer was too far behind to take (dropped
    #: rather than block the engine).
    demotions: int = 0
    store_drops: int = 0
    #: New lanes that shared the cells of a prefix another running lane was
    #: prefilling, and the tokens that saved them beyond their own hit.
    joins: int = 0
    join_tokens: int = 0
    #: Requests that reused less than all but their last token, by why not more
    #: (`Why` values), and the prompt tokens they prefilled for it.
    misses: dict[str, int] = field(default_factory=dict)
    missed_tokens: dict[str, int] = field(default_factory=dict)

    def copy(self) -> CacheCounters:
        """A snapshot that later counting does not change."""
        return replace(self, misses=dict(self.misses), missed_tokens=dict(self.missed_tokens))


@dataclass(frozen=True, slots=True)
class StoreStats:
    #: Entries this process put into the store (indexed by their tokens).
    pages: int
    #: Of those, exported but not yet cut into chunks by the writer.
    pending: int
    chunk_tokens: int
    chunks: ChunkStoreStats
    #: The buffer restores are joined into, kept from one restore to the next.
    restore_buffer_bytes: int = 0


@dataclass(frozen=True, slots=True)
class CacheStats:
    resident: ResidentCacheStats
    #: None without a store.
    store: StoreStats | None
    counters: CacheCounters


class CacheTiers:
    """The resident books, the state store, the index and the logits of resident whole-prompt entries."""

    def __init__(self, resident: ResidentPrefixCache, store: StateTier | None = None) -> None:
        self.resident = resident
        self.store = store
        #: The tokens of every entry in any tier.
        self.index = PrefixIndex()
        #: First-token logits of resident whole-prompt entries.
        self.logits: dict[PageId, np.ndarray] = {}
        #: Deterministic mode: the kernels of the prompt that computed each indexed entry (exact.py).
        self.kernels: dict[PageId, Kernels] = {}

    @property
    def min_tokens(self) -> int:
        return self.resident.config.min_tokens

    def plan(self, query: Query) -> Hit:
        """The longest cached state for the query's prompt, from the fastest tier holding it.

        At equal length a resident entry wins (a `seq_cp`, not a restore), then
        a page of the store's (any length), then chunks found by name.
        """
        if query.refused is not None:
            return Hit.miss(query.refused)
        if query.whole is not None and (query.kernels is None
                                        or self.kernels.get(query.whole.page_id, query.kernels) == query.kernels):
            # In deterministic mode the same tokens sent with other replies marked were computed
            # with other kernels: not an exact repeat, though a prefix of it may serve. (A page found
            # by name is filed nowhere here: its name says which kernels computed it.)
            hit = self._whole(query, query.whole)
            if hit is not None:
                return hit
        if query.kernels is not None:
            return self._exact(query, query.kernels)
        if query.whole_entries:
            return self._whole_entries(query)
        best = Hit.miss(Why.NEVER_SEEN)
        # Any leading part of an entry is exact state for those tokens (attention is causal).
        match = self.index.longest(query.space, query.tokens, prefer=self.resident, min_length=self.min_tokens)
        if match is not None:
            length, source = self._held(match.page_id, match.length)
            if length >= self.min_tokens:
                best = Hit(source, match.page_id, length, reuse_why(length, len(query.tokens)))
        found = self._named(query)
        if found.length > best.length and found.length >= self.min_tokens:
            best = found
        return best

    def _exact(self, query: Query, kernels: Kernels) -> Hit:
        """Deterministic mode: the entry whose leading rows serve the prompt exactly for the most
        tokens (exact.py); among equals a resident one, then the shortest (it frees the fewest cells).
        Chunks found by name serve when they reach further: their names say which kernel computed
        every row (`rows_key`), so a run of them is exact as it stands.
        """
        best: tuple[int, bool, int, PageId, Source] | None = None
        shared = 0
        for match in self.index.matches(query.space, query.tokens, min_length=self.min_tokens):
            length, source = self._held(match.page_id, match.length)
            shared = max(shared, length)
            exact = exact_length(length, self.kernels[match.page_id], kernels)
            if query.whole_entries and (exact != length or length != self.index.token_count(match.page_id)):
                continue  # a recurrent state serves only at its entry's end, and only exactly there
            length = exact
            size = self.index.token_count(match.page_id) or 0
            key = (-length, source is not Source.RESIDENT, size, match.page_id, source)
            best = key if best is None else min(best, key)
        found = self._named(query)
        if found.length >= max(self.min_tokens, 1) and (best is None or found.length > -best[0]):
            return found
        short = query.short_why if query.whole_entries else Why.GRID
        if best is None or -best[0] < max(self.min_tokens, 1):
            return Hit.miss(Why.NEVER_SEEN if shared == 0 else short)
        length = -best[0]
        why = reuse_why(length, len(query.tokens)) if length == shared else short
        return Hit(best[4], best[3], length, why)

    def _whole_entries(self, query: Query) -> Hit:
        """The longest entry whose every token starts the prompt (its state is that of its own end,
        nothing shorter); among equals a resident one. Shorter than the longest shared prefix: says
        why (`query.short_why`)."""
        best: tuple[int, bool, PageId] | None = None
        shared = 0
        for match in self.index.matches(query.space, query.tokens, min_length=self.min_tokens):
            shared = max(shared, match.length)
            if match.length != self.index.token_count(match.page_id):
                continue
            length, source = self._held(match.page_id, match.length)
            if length != match.length:
                continue
            key = (length, source is Source.RESIDENT, match.page_id)
            best = key if best is None or key[:2] > best[:2] else best
        # A whole state found by name (written before a restart, or by another replica) ends
        # where its entry did: the store names no shorter part of it.
        found = self._named(query)
        if found.length >= max(self.min_tokens, 1) and (best is None or found.length > best[0]):
            return found
        if best is None:
            return Hit.miss(query.short_why if shared else Why.NEVER_SEEN)
        length, _, page_id = best
        why = reuse_why(length, len(query.tokens)) if length >= shared else query.short_why
        return Hit(self.source_of(page_id), page_id, length, why)

    def resident_base(self, query: Query) -> tuple[PageId, int] | None:
        """The resident entry that serves the query's prompt exactly for the most leading tokens, and
        how many (None: none does). A restore that reaches further shares its cells up to there
        and imports only the rest: a copy of them would share no cell with it and widen the pool."""
        match = self.index.longest_among(query.space, query.tokens, self.resident)
        if match is None:
            return None
        length = match.length
        if query.kernels is not None:
            length = exact_length(length, self.kernels[match.page_id], query.kernels)
        return match.page_id, length

    def _held(self, page_id: PageId, length: int) -> tuple[int, Source]:
        """How many of an indexed page's first `length` tokens a tier holds, and which tier."""
        if page_id in self.resident:
            return length, Source.RESIDENT
        assert self.store is not None, f"page {page_id} indexed but held nowhere"
        available, source = self.store.available(page_id)
        return min(length, available), source

    def _named(self, query: Query) -> Hit:
        """The run of the prompt's chunks the store holds by name (written before a restart, or by
        another replica)."""
        if self.store is None or not (query.chunks or query.tails):
            return Hit.miss(Why.NEVER_SEEN)
        length, source, _ = self.store.probe(query.chunks, None, query.tails)
        return Hit(source, None, length, reuse_why(length, len(query.tokens)))

    def _whole(self, query: Query, prompt: PrefixIdentity) -> Hit | None:
        page, n = prompt.page_id, prompt.token_count
        if page in self.resident:
            logits = self.logits.get(page)
            assert logits is not None, f"resident whole-prompt entry {page} lost its logits"
            return Hit(Source.RESIDENT, page, n, Why.EXACT_REPEAT, logits)
        if self.store is None:
            return None
        if page in self.store:
            available, source = self.store.available(page)
            logits = self.store.whole_logits(page)
            if available >= n and logits is not None:
                return Hit(source, page, n, Why.EXACT_REPEAT, logits)
        _, source, whole = self.store.probe(query.chunks, prompt)
        if whole:
            return Hit(source, page, n, Why.EXACT_REPEAT)
        return None

    def source_of(self, page_id: PageId) -> Source:
        if page_id in self.resident:
            return Source.RESIDENT
        if self.store is not None and page_id in self.store:
            return self.store.available(page_id)[1]
        return Source.NONE

    def held(self, page_id: PageId) -> bool:
        return page_id in self.resident or (self.store is not None and page_id in self.store)

    def file(self, page_id: PageId, space: Hashable, tokens: Sequence[int], kernels: Kernels | None = None) -> None:
        """Index an entry's tokens once, with the kernels of the prompt that computed it (deterministic mode)."""
        if page_id not in self.index:
            self.index.insert(space, tokens, page_id)
            if kernels is not None:
                self.kernels[page_id] = kernels

    def forget_if_gone(self, page_id: PageId) -> None:
        """A page that left a tier stays indexed only while another tier still holds it."""
        if page_id not in self.resident:
            self.logits.pop(page_id, None)
            if not self.held(page_id):
                self.index.remove(page_id)
                self.kernels.pop(page_id, None)

    def check_invariants(self) -> None:
        """Raise AssertionError if the tiers contradict each other (tests and debug)."""
        self.resident.check_invariants()
        if self.store is not None:
            self.store.check_invariants()
        stray = [page for page in self.logits if page not in self.resident]
        assert not stray, f"logits kept for pages that are not resident: {stray}"
        self.index.check_invariants()
        held = {e.page_id for e in self.resident.entries()}
        if self.store is not None:
            held.update(self.store.pages())
        indexed = {page for page in held if page in self.index}
        assert indexed == held, f"pages held but not indexed: {sorted(held - indexed)}"
        assert len(self.index) == len(held), (
            f"{len(self.index)} pages indexed, {len(held)} held: an evicted page stayed in the index"
        )
        unindexed = [page for page in self.kernels if page not in self.index]
        assert not unindexed, f"kernels kept for pages that are not indexed: {unindexed}"


def reuse_why(length: int, reusable: int) -> Why:
    """Why a hit of `length` tokens covers no more, when `reusable` tokens (all but the last) could be."""
    return Why.ALL_BUT_LAST if length >= reusable else Why.DIVERGED
