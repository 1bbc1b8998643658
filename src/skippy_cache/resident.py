"""The resident prefix cache: which KV prefixes stay in the llama.cpp context.

Books only; the runtime acts on llama.cpp. A record is reserve -> save ->
commit: `allocate_for_record` picks a sequence id and evicts what the budgets
require (calling `drop_evicted` so the runtime frees the native cells), the
runtime copies the lane's cells into that sequence, and `commit_record` books
the entry.

Invariants, checked by `check_invariants` and the property tests:
- every entry holds a distinct sequence id in `[reserved_seq_count, seq_id_limit)`;
- entries (committed plus pending) <= `max_entries`;
- booked bytes <= `max_bytes` and held cells <= `max_resident_tokens`
  whenever those caps are set (> 0): with the pool's cell mirror, the distinct
  cells the entries hold (a pending entry counted in full); without one, the
  sum of their token counts;
- a pending entry (allocated, not yet committed) is never evicted;
- an evicted entry stays booked until `drop_evicted` has returned, so its id
  is never handed out while its native cells may still be held.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NewType

from skippy_cache.cells import CellMap
from skippy_cache.config import LLAMA_MAX_SEQ, ResidentCacheConfig
from skippy_cache.identity import PageId

SeqId = NewType("SeqId", int)

#: `RecordAllocation.seq_id` when nothing will be saved (uncacheable).
NO_SEQ = SeqId(-1)

DropEvicted = Callable[["ResidentEviction"], None]


class ResidentCacheError(Exception):
    """Misuse of the cache, or a record that cannot be placed at all."""


@dataclass(slots=True)
class _Entry:
    """Owned by `ResidentPrefixCache`; nothing else mutates it."""

    seq_id: SeqId
    token_count: int
    estimated_bytes: int
    last_used: int
    #: The work clock (tokens decoded by the pool) when the entry was last used.
    used_at_work: int = 0


@dataclass(frozen=True, slots=True)
class ResidentLookup:
    page_id: PageId
    seq_id: SeqId
    token_count: int


@dataclass(frozen=True, slots=True)
class ResidentEviction:
    page_id: PageId
    seq_id: SeqId
    token_count: int
    estimated_bytes: int


@dataclass(frozen=True, slots=True)
class RecordAllocation:
    """Where to save a record. `should_save` false: nothing to copy, nothing to commit."""

    seq_id: SeqId
    evictions: tuple[ResidentEviction, ...]
    should_save: bool
    #: Why nothing is saved: "exists" or "uncacheable"; None when `should_save`.
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class ResidentCacheStats:
    entries: int
    #: The entries' token counts summed: a token several entries share counts once per entry.
    resident_tokens: int
    #: Distinct cells the entries hold (what `max_resident_tokens` caps); `resident_tokens`
    #: without the pool's cell mirror.
    resident_cells: int
    estimated_bytes: int
    max_entries: int
    max_bytes: int
    max_resident_tokens: int
    pending: int
    records: int
    evictions: int
    uncacheable: int
    #: Entries a request asked to keep (`pin`), their tokens, and the cap on those tokens.
    pinned: int = 0
    pinned_tokens: int = 0
    max_pinned_tokens: int = 0


class ResidentPrefixCache:
    """Resident entries' books: sequence ids, budgets, recency, idleness, pins.

    Pinned entries are never chosen by LRU or idleness while an unpinned entry
    can go; their cells stay under `max_pinned_tokens`. Each pin has an owner
    (a tenant), whose pins stay under `max_owner_pinned_tokens` too: pinning
    past either cap releases the pinner's own oldest pins, never another
    owner's, and a pin that still does not fit is not taken. When only pinned
    entries are left, a record's budget or a decode's cells still take them:
    a pin never fails a request.

    With the pool's cell mirror (`cells`), `max_resident_tokens` caps the
    distinct cells the entries hold, and `max_pinned_tokens` those the pinned
    ones hold; without it, their token counts summed. The pool shares cells
    between sequences (`seq_cp` adds a sequence to cells, it copies none): a
    prompt's entries at several lengths, its reply's entry, and an entry
    recorded from a lane that reused another all hold cells of one prefix.
    Summing their token counts counted those cells once per entry, which
    filled the budget several times over and evicted entries that would have
    been hit. Eviction for cells then prefers an entry whose going frees some:
    one that is a prefix of another frees nothing.
    """

    def __init__(
        self, config: ResidentCacheConfig, *, max_pinned_tokens: int = 0, cells: CellMap | None = None
    ) -> None:
        if config.reserved_seq_count < 0 or config.reserved_seq_count >= LLAMA_MAX_SEQ:
            raise ResidentCacheError(f"reserved_seq_count {config.reserved_seq_count} leaves no cache ids")
        self.config = config
        #: Ids are handed out below this; the runtime's context has this many sequences.
        self.seq_id_limit = min(config.reserved_seq_count + config.max_entries, LLAMA_MAX_SEQ)
        self._entries: dict[PageId, _Entry] = {}
        #: Reserved by `allocate_for_record`, not yet committed: (seq_id, tokens, bytes).
        self._pending: dict[PageId, tuple[SeqId, int, int]] = {}
        self._free_ids: list[SeqId] = []
        self._next_id = config.reserved_seq_count
        self._clock = 0
        #: Tokens the pool has decoded: what an idle entry's cells have cost.
        self._work = 0
        self._tokens = 0
        self._bytes = 0
        self._records = 0
        self._evictions = 0
        self._uncacheable = 0
        self.max_pinned_tokens = max_pinned_tokens
        #: The cap on one owner's pins (0: only `max_pinned_tokens`).
        self.max_owner_pinned_tokens = 0
        #: Pinned entries and who pinned them, oldest pin first.
        self._pins: OrderedDict[PageId, str | None] = OrderedDict()
        self._pinned_tokens = 0
        self._cells = cells

    # -- reads ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, page_id: object) -> bool:
        return page_id in self._entries

    def peek(self, page_id: PageId) -> ResidentLookup | None:
        """The entry, without touching recency or the idle clock."""
        entry = self._entries.get(page_id)
        if entry is None:
            return None
        return ResidentLookup(page_id, entry.seq_id, entry.token_count)

    def touch(self, page_id: PageId) -> ResidentLookup | None:
        """The entry, marked as used: it becomes the most recently used and its idle count restarts.

        Counts nothing: the runtime keeps the one hit counter.
        """
        self._tick()
        entry = self._entries.get(page_id)
        if entry is None:
            return None
        entry.last_used = self._clock
        entry.used_at_work = self._work
        return ResidentLookup(page_id, entry.seq_id, entry.token_count)

    def stats(self) -> ResidentCacheStats:
        return ResidentCacheStats(
            entries=len(self._entries),
            resident_tokens=self._tokens,
            resident_cells=self._held(),
            estimated_bytes=self._bytes,
            max_entries=self.config.max_entries,
            max_bytes=self.config.max_bytes,
            max_resident_tokens=self.config.max_resident_tokens,
            pending=len(self._pending),
            records=self._records,
            evictions=self._evictions,
            uncacheable=self._uncacheable,
            pinned=len(self._pins),
            pinned_tokens=self._pinned_tokens,
            max_pinned_tokens=self.max_pinned_tokens,
        )

    def entries(self) -> list[ResidentLookup]:
        """All committed entries, least recently used first."""
        ordered = sorted(self._entries.items(), key=lambda item: item[1].last_used)
        return [ResidentLookup(page, e.seq_id, e.token_count) for page, e in ordered]

    # -- records -------------------------------------------------------------

    def allocate_for_record(
        self,
        page_id: PageId,
        token_count: int,
        estimated_bytes: int,
        drop_evicted: DropEvicted,
        *,
        source: SeqId | None = None,
    ) -> RecordAllocation:
        """Reserve a sequence id for a record, evicting LRU entries to fit the budgets.

        `source` is the sequence whose first `token_count` cells the record
        will share (the lane it is copied from): with the cell mirror, what
        those cells share with entries counts once. Without it the record's
        tokens count in full.

        Raises `ResidentCacheError` below `min_tokens`, when the pending records
        leave no room for this one, or when sequence ids run out. If
        `drop_evicted` raises, that entry stays booked (its native state may
        still be there) and the exception propagates.
        """
        self._tick()
        cfg = self.config
        if token_count < cfg.min_tokens:
            raise ResidentCacheError(f"record of {token_count} tokens is below min_tokens {cfg.min_tokens}")
        if token_count < 0 or estimated_bytes < 0:
            raise ResidentCacheError(f"negative record size ({token_count} tokens, {estimated_bytes} bytes)")
        existing = self._entries.get(page_id)
        if existing is not None:
            existing.last_used = self._clock
            existing.used_at_work = self._work
            return RecordAllocation(existing.seq_id, (), should_save=False, reason="exists")
        if page_id in self._pending:
            raise ResidentCacheError(f"{page_id!r} is already being recorded")
        if self._exceeds(1, token_count, estimated_bytes):
            # Alone over a budget: evicting everything would not make it fit.
            self._uncacheable += 1
            return RecordAllocation(NO_SEQ, (), should_save=False, reason="uncacheable")

        # What no eviction can free: the pending records, plus this one.
        floor_tokens = token_count + sum(p[1] for p in self._pending.values())
        floor_bytes = estimated_bytes + sum(p[2] for p in self._pending.values())
        if self._exceeds(len(self._pending) + 1, floor_tokens, floor_bytes):
            # Checked before evicting anything: evicting entries and then failing
            # would empty the cache for nothing.
            raise ResidentCacheError(
                "no releasable entries: the pending entries alone leave no room "
                f"({len(self._entries)} entries, {self._tokens} tokens, {self._bytes} bytes)"
            )
        evictions: list[ResidentEviction] = []
        record = (source, token_count)
        while True:
            entries = len(self._entries) + len(self._pending) + 1
            over_entries_or_bytes = self._exceeds(entries, 0, self._bytes + estimated_bytes)
            held = self._held(record)
            if not over_entries_or_bytes and not self._exceeds(0, held, 0):
                break
            # Over the cell cap alone, an entry whose cells the others (or the record) hold frees none.
            frees = None if over_entries_or_bytes else (lambda page: self._held(record, without=page) < held)
            victim = self._victim(frees)
            assert victim is not None, "the pending-entries check above should have refused this record"
            evictions.append(self._evict(victim, drop_evicted))
        seq_id = self._take_seq_id()
        self._pending[page_id] = (seq_id, token_count, estimated_bytes)
        self._tokens += token_count
        self._bytes += estimated_bytes
        return RecordAllocation(seq_id, tuple(evictions), should_save=True)

    def commit_record(self, page_id: PageId, seq_id: SeqId, token_count: int, estimated_bytes: int) -> None:
        """Book an entry the runtime has saved into `seq_id`."""
        self._tick()
        pending = self._pending.get(page_id)
        if pending != (seq_id, token_count, estimated_bytes):
            raise ResidentCacheError(
                f"commit of {page_id!r} as {(seq_id, token_count, estimated_bytes)} does not match "
                f"its allocation {pending}"
            )
        del self._pending[page_id]
        self._entries[page_id] = _Entry(seq_id, token_count, estimated_bytes, self._clock, self._work)
        self._records += 1

    # -- pins ----------------------------------------------------------------

    def pin(self, page_id: PageId, owner: str | None = None) -> list[PageId]:
        """Keep the entry resident for `owner`; returns `owner`'s pins released (oldest first) to
        stay under the caps.

        An entry alone over a cap, or not resident, is not pinned (nothing is released); nor is
        one that would not fit with all of `owner`'s other pins released (they are kept).
        """
        entry = self._entries.get(page_id)
        owner_cap = self.max_owner_pinned_tokens or self.max_pinned_tokens
        if entry is None or entry.token_count > min(self.max_pinned_tokens, owner_cap):
            return []
        if page_id in self._pins:
            self._pins.move_to_end(page_id)
            return []
        own = [p for p, o in self._pins.items() if o == owner]
        if self._pinned_cells(page_id, without=own) > self.max_pinned_tokens:
            return []  # other owners' pins fill the budget: theirs are not released for this one
        released = []
        while (self._pinned_cells(page_id) > self.max_pinned_tokens
               or self._pinned_cells(page_id, only=[p for p in own if p not in released]) > owner_cap):
            if len(released) == len(own):
                return released  # the mirror counts shared cells once: nothing more of its own to give
            oldest = own[len(released)]
            self.unpin(oldest)
            released.append(oldest)
        self._pins[page_id] = owner
        self._pinned_tokens += entry.token_count
        return released

    def unpin(self, page_id: PageId) -> bool:
        """The entry is an ordinary one again (LRU); False if it was not pinned."""
        if page_id not in self._pins:
            return False
        del self._pins[page_id]
        self._pinned_tokens -= self._entries[page_id].token_count
        return True

    def unpin_all(self) -> int:
        pinned = list(self._pins)
        for page_id in pinned:
            self.unpin(page_id)
        return len(pinned)

    def pinned(self, page_id: PageId) -> bool:
        return page_id in self._pins

    def pin_owner(self, page_id: PageId) -> str | None:
        """Who pinned the entry (None: no tenant, or not pinned)."""
        return self._pins.get(page_id)

    # -- eviction ------------------------------------------------------------

    def evict_one_lru_entry(self, drop_evicted: DropEvicted, *, pinned_too: bool = False) -> ResidentEviction | None:
        """Evict the least recently used entry (to make cells for a decode), if any; a pinned one
        only with `pinned_too` and when no unpinned entry is left. With the cell mirror, the least
        recently used of those whose going frees a cell of the pool comes first."""
        self._tick()
        victim = self._victim(self._frees_pool_cells, pinned_too=pinned_too)
        if victim is None:
            return None
        return self._evict(victim, drop_evicted)

    def evict_lru_where(self, wanted: Callable[[SeqId], bool], drop_evicted: DropEvicted) -> ResidentEviction | None:
        """Evict the least recently used unpinned entry whose sequence `wanted` picks, if any (with
        the cell mirror, one whose going frees a cell of the pool first)."""
        self._tick()
        victim = self._victim(self._frees_pool_cells, wanted=wanted, pinned_too=False)
        return None if victim is None else self._evict(victim, drop_evicted)

    def advance_work(self, tokens: int) -> None:
        """The pool decoded `tokens` more tokens (each paid for every resident cell in its KV view)."""
        if tokens < 0:
            raise ResidentCacheError(f"work cannot go backwards ({tokens} tokens)")
        self._work += tokens

    def evict_idle(self, idle_tokens: int, drop_evicted: DropEvicted) -> list[ResidentEviction]:
        """Evict every entry unused while the pool decoded more than `idle_tokens` tokens.

        The rule is ski rental: an idle entry pays rent (its cells widen every
        decode) until the rent would exceed what bringing it back costs, then
        it goes. Rent and the cost of return both grow with the entry's cells,
        so one token count serves entries of every size. Oldest use first.

        With the cell mirror, an idle entry whose every cell a staying sequence
        holds too (a lane, or an entry in use that extends it: a chat's earlier
        turn under its latest) pays no rent and stays: its going would free no
        cell, narrow no view, and cost an export. It goes with the last holder.
        """
        if idle_tokens < 0:
            raise ResidentCacheError(f"idle_tokens must be >= 0, got {idle_tokens}")
        self._tick()
        idle = [
            (entry.used_at_work, entry.last_used, page_id)
            for page_id, entry in self._entries.items()
            if self._work - entry.used_at_work > idle_tokens and page_id not in self._pins
        ]
        if self._cells is not None and idle:
            going = {self._entries[page_id].seq_id for _, _, page_id in idle}
            staying = [seq for seq in self._cells.sequences() if seq not in going]
            covered = self._cells.covered(going, staying)
            idle = [item for item in idle if self._entries[item[2]].seq_id not in covered]
        return [self._evict(page_id, drop_evicted) for _, _, page_id in sorted(idle)]

    def clear(self, drop_evicted: DropEvicted) -> list[ResidentEviction]:
        """Evict every committed entry, pinned ones too, least recently used first (pending ones stay)."""
        evicted = []
        while (victim := self._victim(None)) is not None:
            evicted.append(self._evict(victim, drop_evicted))
        return evicted

    # -- internals -----------------------------------------------------------

    def _tick(self) -> None:
        self._clock += 1

    def _exceeds(self, entries: int, tokens: int, nbytes: int) -> bool:
        """Would the cache break a budget holding this many entries, tokens and bytes?"""
        cfg = self.config
        return (
            entries > cfg.max_entries
            or (cfg.max_bytes > 0 and nbytes > cfg.max_bytes)
            or (cfg.max_resident_tokens > 0 and tokens > cfg.max_resident_tokens)
        )

    def _victim(
        self,
        frees: Callable[[PageId], bool] | None,
        *,
        pinned_too: bool = True,
        wanted: Callable[[SeqId], bool] | None = None,
    ) -> PageId | None:
        """The entry to evict: unpinned ones least recently used first, then (`pinned_too`) pinned ones,
        of those whose sequence `wanted` picks; the first that `frees` something, else the first."""
        def order(pinned: bool) -> list[PageId]:
            pool = self._pins if pinned else [p for p in self._entries if p not in self._pins]
            if wanted is not None:
                pool = [p for p in pool if wanted(self._entries[p].seq_id)]
            return sorted(pool, key=lambda page_id: self._entries[page_id].last_used)

        candidates = order(False) + (order(True) if pinned_too else [])
        if frees is not None:
            freeing = next((p for p in candidates if frees(p)), None)
            if freeing is not None:
                return freeing
        return candidates[0] if candidates else None

    def _frees_pool_cells(self, page_id: PageId) -> bool:
        """Would evicting the entry free a cell of the pool? Always, without the cell mirror."""
        return self._cells is None or self._cells.cells_freed_by_removing({self._entries[page_id].seq_id}) > 0

    def _pinned_cells(self, also: PageId | None = None, *, only: list[PageId] | None = None,
                      without: list[PageId] = ()) -> int:
        """The cells the pins (`only` those, less `without`) hold, with `also` pinned too: shared
        ones once with the cell mirror, the pinned entries' tokens summed without it."""
        pins = [p for p in (self._pins if only is None else only) if p not in without]
        if also is not None:
            pins.append(also)
        if self._cells is None:
            return sum(self._entries[p].token_count for p in pins)
        return self._cells.cells_held([self._entries[p].seq_id for p in pins])

    def _held(self, record: tuple[SeqId | None, int] = (None, 0), *, without: PageId | None = None) -> int:
        """The cells the token cap counts: the entries' (but `without`'s), pending ones' tokens in full
        (their cells are not copied yet), and a `record` = (source sequence, tokens) about to be
        placed, its source's cells shared with entries counted once."""
        source, tokens = record
        if self._cells is None:
            return self._tokens + tokens - (self._entries[without].token_count if without is not None else 0)
        pending = sum(p[1] for p in self._pending.values())
        seqs = [e.seq_id for page, e in self._entries.items() if page != without]
        if source is None:
            return self._cells.cells_held(seqs) + pending + tokens
        return self._cells.cells_held(seqs, prefix=(source, tokens)) + pending

    def _evict(self, page_id: PageId, drop_evicted: DropEvicted) -> ResidentEviction:
        entry = self._entries[page_id]
        eviction = ResidentEviction(page_id, entry.seq_id, entry.token_count, entry.estimated_bytes)
        # Native drop first: if it fails the cells may still be held, and the
        # books must keep saying so rather than hand the id out again.
        drop_evicted(eviction)
        self.unpin(page_id)
        del self._entries[page_id]
        self._tokens -= entry.token_count
        self._bytes -= entry.estimated_bytes
        self._free_ids.append(entry.seq_id)
        self._evictions += 1
        return eviction

    def _take_seq_id(self) -> SeqId:
        if self._free_ids:
            return self._free_ids.pop()
        if self._next_id >= self.seq_id_limit:
            raise ResidentCacheError(
                f"sequence ids exhausted: all of {self.config.reserved_seq_count}..{self.seq_id_limit - 1} in use"
            )
        seq_id = SeqId(self._next_id)
        self._next_id += 1
        return seq_id

    def check_invariants(self) -> None:
        """Raise AssertionError if the books contradict themselves (tests and debug)."""
        cfg = self.config
        ids = [e.seq_id for e in self._entries.values()] + [p[0] for p in self._pending.values()]
        assert len(ids) == len(set(ids)), f"sequence id booked twice: {sorted(ids)}"
        assert not set(ids) & set(self._free_ids), "a booked sequence id is also on the free list"
        for seq_id in ids:
            assert cfg.reserved_seq_count <= seq_id < self.seq_id_limit, f"seq id {seq_id} out of range"
        tokens = sum(e.token_count for e in self._entries.values()) + sum(p[1] for p in self._pending.values())
        nbytes = sum(e.estimated_bytes for e in self._entries.values()) + sum(p[2] for p in self._pending.values())
        assert tokens == self._tokens, f"token books {self._tokens} != entries' {tokens}"
        assert nbytes == self._bytes, f"byte books {self._bytes} != entries' {nbytes}"
        assert len(ids) <= cfg.max_entries, f"{len(ids)} entries over max_entries {cfg.max_entries}"
        if cfg.max_bytes > 0:
            assert nbytes <= cfg.max_bytes, f"{nbytes} bytes over max_bytes {cfg.max_bytes}"
        if cfg.max_resident_tokens > 0:
            held = self._held()
            assert held <= cfg.max_resident_tokens, f"{held} cells over cap {cfg.max_resident_tokens}"
        assert set(self._pins) <= set(self._entries), "a pin on an entry that is not resident"
        pinned = sum(self._entries[p].token_count for p in self._pins)
        assert pinned == self._pinned_tokens, f"pinned token books {self._pinned_tokens} != entries' {pinned}"
        held = self._pinned_cells()
        assert held <= self.max_pinned_tokens, f"{held} pinned cells over {self.max_pinned_tokens}"
        if self.max_owner_pinned_tokens:
            for owner in set(self._pins.values()):
                held = self._pinned_cells(only=[p for p, o in self._pins.items() if o == owner])
                assert held <= self.max_owner_pinned_tokens, f"{owner!r}'s {held} pinned cells over its cap"
