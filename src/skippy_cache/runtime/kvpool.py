"""The KV cell pool: the resident cache's books, the cell ledger and llama.cpp, kept in step.

Every native sequence operation goes through here so the three never disagree:
the core decides (`ResidentPrefixCache`), llama.cpp acts (`NativeContext`), and
the ledger mirrors which cells are held so the engine can evict before a
decode instead of letting it fail for want of a slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from skippy_cache.cells import CellLedger
from skippy_cache.identity import PageId, PrefixIdentity
from skippy_cache.placement import CellMap
from skippy_cache.resident import ResidentCacheError, ResidentEviction, ResidentPrefixCache
from skippy_cache.runtime.native import Batch, NativeContext


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
    #: Deterministic mode: pad tokens decoded to steer placement, and steps
    #: that could not be placed on the alignment grid (not bit-exact).
    pad_tokens: int = 0
    unaligned_steps: int = 0


class KvPool:
    def __init__(
        self, ctx: NativeContext, cache: ResidentPrefixCache, bytes_per_token: int, *, mirror_cells: bool = False
    ) -> None:
        self.ctx = ctx
        self.cache = cache
        self.ledger = CellLedger(ctx.n_ctx)
        #: Physical placement mirror, kept only where placement is steered (deterministic mode).
        self.cells: CellMap | None = CellMap(ctx.n_ctx) if mirror_cells else None
        #: Deterministic mode: the cell of position 0 for each lane (position p sits at base + p).
        self._bases: dict[int, int] = {}
        #: First-token logits of whole-prompt entries, dropped with their entry.
        self._logits: dict[PageId, np.ndarray] = {}
        self.bytes_per_token = bytes_per_token
        self.counters = PoolCounters()

    # -- lanes ---------------------------------------------------------------

    def decoded(self, runs: list[tuple[int, int, int]]) -> None:
        """Book the (seq, p0, p1) runs of a successful `llama_decode`, in batch order."""
        for seq_id, p0, p1 in runs:
            self.ledger.on_decode(seq_id, p0, p1)
        if self.cells is not None:
            self.cells.decode(runs)

    def free_lane(self, seq_id: int) -> None:
        self._seq_rm(seq_id)
        self._bases.pop(seq_id, None)

    def steer(self, seq_id: int, p0: int, n_tokens: int, remaining: int, pad_seq: int, pad_batch: Batch) -> bool:
        """Deterministic mode: make the lane's next `n_tokens` land on cells aligned with their positions.

        The lane's own cells form one run whose first cell is congruent to its
        first position mod 64 and lies after the cells it copied from the cache.
        Free cells the allocator would reach first are filled with pad tokens.
        False when no aligned run exists even with the cache empty: the step
        still runs, but is not bit-exact (counted in `unaligned_steps`).
        """
        cells = self.cells
        assert cells is not None, "steer() needs the placement mirror (deterministic mode)"
        base = self._bases.get(seq_id)
        if base is None:
            while (target := cells.aligned_target(cells.last_cell(seq_id), p0, remaining)) is None:
                if self.cache.evict_one_lru_entry(self._drop) is None:
                    self.counters.unaligned_steps += 1
                    return False
                self.counters.proactive_evictions += 1
            base = self._bases[seq_id] = target - p0
        for _ in range(4):
            pad = cells.pad_needed(base + p0, n_tokens)
            if pad == 0:
                return True
            if not self._decode_pad(pad_seq, pad, pad_batch):
                break
        self.counters.unaligned_steps += 1
        return False

    def _decode_pad(self, pad_seq: int, count: int, batch: Batch) -> bool:
        pos = self.ledger.pos_max(pad_seq) + 1
        while count > 0:
            n = min(count, batch.capacity)
            batch.clear()
            batch.add(pad_seq, [0] * n, pos, False)
            if self.ctx.decode(batch) != 0:
                return False
            self.decoded([(pad_seq, pos, pos + n)])
            self.counters.pad_tokens += n
            pos += n
            count -= n
        return True

    # -- cache path ----------------------------------------------------------

    def attach(self, lane_seq: int, candidates: list[PrefixIdentity]) -> PrefixIdentity | None:
        """Copy the first resident candidate (callers order them longest first) onto an empty lane.

        The entry is borrowed for the copy so no eviction can run between the
        lookup and the `seq_cp`; cells are shared, nothing is copied.
        """
        self.counters.lookups += 1
        for prefix in candidates:
            hit = self.cache.acquire(prefix.page_id)
            if hit is None:
                continue
            try:
                self._seq_cp(hit.seq_id, lane_seq, prefix.token_count)
            finally:
                self.cache.release(prefix.page_id)
            self.counters.hits += 1
            self.counters.hit_tokens += prefix.token_count
            return prefix
        return None

    def prompt_logits(self, prompt: PrefixIdentity) -> np.ndarray | None:
        """The first-token logits kept with a whole-prompt entry, if it is resident."""
        return self._logits.get(prompt.page_id)

    def record(self, lane_seq: int, prefix: PrefixIdentity, logits: np.ndarray | None = None) -> bool:
        """Record the lane's first `prefix.token_count` cells as an entry (a whole prompt with its logits).

        False when nothing was saved: below `min_tokens`, already resident,
        uncacheable, or every entry borrowed (serving goes on uncached).
        """
        n = prefix.token_count
        if n <= 0 or n < self.cache.config.min_tokens:
            return False
        nbytes = n * self.bytes_per_token + (logits.nbytes if logits is not None else 0)
        try:
            allocation = self.cache.allocate_for_record(prefix.page_id, n, nbytes, self._drop)
        except ResidentCacheError:
            self.counters.record_skips += 1
            return False
        self.counters.budget_evictions += len(allocation.evictions)
        if not allocation.should_save:
            return False
        self._seq_cp(lane_seq, allocation.seq_id, n)
        if logits is not None:
            self._logits[prefix.page_id] = logits
        self.cache.commit_record(prefix.page_id, allocation.seq_id, n, nbytes)
        self.counters.records += 1
        return True

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
        self._seq_rm(eviction.seq_id)
        self._logits.pop(eviction.page_id, None)

    def _seq_cp(self, src: int, dst: int, n: int) -> None:
        self.ctx.seq_cp(src, dst, 0, n)
        self.ledger.on_seq_cp(src, dst, 0, n)
        if self.cells is not None:
            self.cells.seq_cp(src, dst, 0, n)

    def _seq_rm(self, seq_id: int) -> None:
        self.ctx.seq_rm(seq_id, -1, -1)
        self.ledger.on_seq_rm(seq_id)
        if self.cells is not None:
            self.cells.seq_rm(seq_id)
