"""The KV cell pool: the resident cache's books, the cell ledger and llama.cpp, kept in step.

Every native sequence operation goes through here so the three never disagree:
the core decides (`ResidentPrefixCache`), llama.cpp acts (`NativeContext`), and
the ledger mirrors which cells are held so the engine can evict before a
decode instead of letting it fail for want of a slot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from skippy_cache.cells import CellLedger
from skippy_cache.identity import PrefixIdentity
from skippy_cache.resident import ResidentCacheError, ResidentEviction, ResidentPrefixCache
from skippy_cache.runtime.native import NativeContext


@dataclass(frozen=True, slots=True)
class PrefixHit:
    token_count: int
    page_id: str


@dataclass(slots=True)
class PoolCounters:
    """Owned by `KvPool`."""

    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    records: int = 0
    record_skips: int = 0
    proactive_evictions: int = 0
    budget_evictions: int = 0


class KvPool:
    def __init__(self, ctx: NativeContext, cache: ResidentPrefixCache, bytes_per_token: int) -> None:
        self.ctx = ctx
        self.cache = cache
        self.ledger = CellLedger(ctx.n_ctx)
        self.bytes_per_token = bytes_per_token
        self.counters = PoolCounters()

    # -- lanes ---------------------------------------------------------------

    def decoded(self, seq_id: int, p0: int, p1: int) -> None:
        """Book cells a successful `llama_decode` wrote for `seq_id`."""
        self.ledger.on_decode(seq_id, p0, p1)

    def free_lane(self, seq_id: int) -> None:
        self.ctx.seq_rm(seq_id, -1, -1)
        self.ledger.on_seq_rm(seq_id)

    # -- cache path ----------------------------------------------------------

    def attach_longest(self, lane_seq: int, identities: Mapping[int, PrefixIdentity], lengths: list[int]) -> PrefixHit | None:
        """Copy the longest resident prefix among `lengths` onto an empty lane.

        The entry is borrowed for the copy so no eviction can run between the
        lookup and the `seq_cp`; cells are shared, nothing is copied.
        """
        self.counters.lookups += 1
        for n in lengths:
            page = identities[n].page_id
            hit = self.cache.acquire(page)
            if hit is None:
                continue
            try:
                self.ctx.seq_cp(hit.seq_id, lane_seq, 0, n)
                self.ledger.on_seq_cp(hit.seq_id, lane_seq, 0, n)
            finally:
                self.cache.release(page)
            self.counters.hits += 1
            self.counters.hit_tokens += n
            return PrefixHit(n, page)
        return None

    def record(self, lane_seq: int, identities: Mapping[int, PrefixIdentity], lengths: list[int]) -> int:
        """Record the lane's first n cells as entries for each n; returns how many were saved."""
        saved = 0
        for n in lengths:
            if n < self.cache.config.min_tokens or n <= 0:
                continue
            page = identities[n].page_id
            nbytes = n * self.bytes_per_token
            try:
                allocation = self.cache.allocate_for_record(page, n, nbytes, self._drop)
            except ResidentCacheError:
                # Every entry borrowed or ids exhausted: serving goes on uncached.
                self.counters.record_skips += 1
                continue
            self.counters.budget_evictions += len(allocation.evictions)
            if not allocation.should_save:
                continue
            seq = allocation.seq_id
            self.ctx.seq_cp(lane_seq, seq, 0, n)
            self.ledger.on_seq_cp(lane_seq, seq, 0, n)
            self.cache.commit_record(page, seq, n, nbytes)
            self.counters.records += 1
            saved += 1
        return saved

    def make_room(self, cells: int) -> bool:
        """Evict LRU entries until `cells` are free; False if the cache alone cannot make them."""
        while self.ledger.free_cells < cells:
            if self.cache.evict_one_lru_entry(self._drop) is None:
                return False
            self.counters.proactive_evictions += 1
        return True

    def evict_all(self) -> int:
        return len(self.cache.clear(self._drop))

    def _drop(self, eviction: ResidentEviction) -> None:
        self.ctx.seq_rm(eviction.seq_id, -1, -1)
        self.ledger.on_seq_rm(eviction.seq_id)
