"""The KV cell pool: the resident cache's books, the cell ledger and llama.cpp, kept in step.

Every native sequence operation goes through here so the three never disagree:
the core decides (`ResidentPrefixCache`), llama.cpp acts (`NativeContext`), and
the ledger mirrors which cells are held so the engine can evict before a
decode instead of letting it fail for want of a slot.

With a host tier, an entry leaving the pool is demoted rather than lost: its
exact state is copied out (`llama_state_seq_get_data`) before its cells are
freed, and a later hit restores it onto the lane (`llama_state_seq_set_data`).
Entries leave when a budget or a decode needs their cells, and when they sit
unused while the pool decodes `idle_tokens` tokens (see
`ResidentPrefixCache.evict_idle`): a pool that holds only what is in use keeps
every decode's KV view narrow.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from skippy_cache.cells import CellLedger
from skippy_cache.host import HostEntry, HostTier
from skippy_cache.identity import PageId, PrefixIdentity
from skippy_cache.placement import CellMap
from skippy_cache.radix import PrefixIndex
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
    #: Entries evicted for sitting idle (see `KvPool.shed_idle`).
    idle_evictions: int = 0
    #: Host tier: states copied out on eviction, hits restored from it, and
    #: restores llama.cpp refused (served as misses).
    demotions: int = 0
    host_hits: int = 0
    host_hit_tokens: int = 0
    restore_failures: int = 0
    #: Deterministic mode: pad tokens decoded to steer placement, and steps
    #: that could not be placed on the alignment grid (not bit-exact).
    pad_tokens: int = 0
    unaligned_steps: int = 0


class KvPool:
    def __init__(
        self,
        ctx: NativeContext,
        cache: ResidentPrefixCache,
        bytes_per_token: int,
        *,
        mirror_cells: bool = False,
        host: HostTier | None = None,
        idle_tokens: int = 0,
        index: PrefixIndex | None = None,
    ) -> None:
        self.ctx = ctx
        self.cache = cache
        self.host = host
        #: Fast mode: the tokens of every entry in either tier, for token-granular hits.
        self.index = index
        #: With a host tier: entries unused for this many decoded tokens are demoted (0: never).
        self.idle_tokens = idle_tokens
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
        self.cache.advance_work(sum(p1 - p0 for _, p0, p1 in runs))

    def shed_idle(self) -> int:
        """Demote entries idle past `idle_tokens` to the host tier; how many left the pool."""
        if self.host is None or self.idle_tokens <= 0:
            return 0
        evicted = len(self.cache.evict_idle(self.idle_tokens, self._demote))
        self.counters.idle_evictions += evicted
        return evicted

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
        """Put the first cached candidate (callers order them longest first) onto an empty lane."""
        self.counters.lookups += 1
        return self._attach_first(lane_seq, candidates)

    def attach_prompt(
        self, lane_seq: int, whole: PrefixIdentity | None, space: Hashable, prefix: Sequence[int]
    ) -> tuple[int, bool]:
        """Fast mode: put the prompt's cached state onto an empty lane; (tokens covered, whole prompt?).

        First the whole-prompt entry (an exact repeat: the caller samples from
        its stored logits). Else the longest indexed prefix of `prefix`: any
        leading part of an entry is exact state for those tokens, so the hit is
        as long as the shared prefix, not a grid length below it. At equal
        length a resident entry wins (a `seq_cp`, not a restore).
        """
        assert self.index is not None, "attach_prompt() needs the prefix index (fast mode)"
        self.counters.lookups += 1
        if whole is not None and self._attach_first(lane_seq, [whole]) is not None:
            return whole.token_count, True
        match = self.index.longest(space, prefix, prefer=self.cache, min_length=self.cache.config.min_tokens)
        if match is None or self._put_on_lane(lane_seq, match.page_id, match.length) is None:
            return 0, False
        return match.length, False

    def _attach_first(self, lane_seq: int, candidates: list[PrefixIdentity]) -> PrefixIdentity | None:
        for prefix in candidates:
            tier = self._put_on_lane(lane_seq, prefix.page_id, prefix.token_count)
            if tier is None:
                continue
            if tier == "host":
                # The whole entry came back: record it resident again, sharing
                # the lane's cells, so the next repeat is a `seq_cp`.
                self.record(lane_seq, prefix, self.prompt_logits(prefix))
            return prefix
        return None

    def _put_on_lane(self, lane_seq: int, page_id: PageId, n: int) -> str | None:
        """The entry's first `n` positions onto an empty lane; which tier it came from, None if neither.

        A resident entry is borrowed for the copy so no eviction can run between
        the lookup and the `seq_cp`; cells are shared, nothing is copied. A
        host entry is restored whole, then trimmed to `n`.
        """
        hit = self.cache.acquire(page_id)
        if hit is not None:
            try:
                self._seq_cp(hit.seq_id, lane_seq, n)
            finally:
                self.cache.release(page_id)
            tier = "resident"
        elif self._restore(lane_seq, page_id, keep=n):
            tier = "host"
        else:
            return None
        self.counters.hits += 1
        self.counters.hit_tokens += n
        return tier

    def _restore(self, lane_seq: int, page_id: PageId, keep: int) -> bool:
        """Restore a host entry onto an empty lane, keeping its first `keep` positions."""
        if self.host is None:
            return False
        entry = self.host.get(page_id)
        if entry is None:
            return False
        n = entry.token_count
        if not self.make_room(n):
            return False
        if not self.ctx.state_seq_set(lane_seq, entry.payload) or self.ctx.seq_pos_max(lane_seq) != n - 1:
            # Refused (no slot) or not the state the books promised: serve a
            # miss, and do not offer this payload again.
            self.ctx.seq_rm(lane_seq, -1, -1)
            self.host.discard(page_id)
            self._unindex_if_gone(page_id)
            self.counters.restore_failures += 1
            return False
        self.ledger.on_decode(lane_seq, 0, n)
        if keep < n:
            self.ctx.seq_rm(lane_seq, keep, -1)
            self.ledger.on_seq_rm(lane_seq, keep, -1)
        self.counters.host_hits += 1
        self.counters.host_hit_tokens += min(keep, n)
        return True

    def prompt_logits(self, prompt: PrefixIdentity) -> np.ndarray | None:
        """The first-token logits kept with a whole-prompt entry, resident or in the host tier."""
        logits = self._logits.get(prompt.page_id)
        if logits is None and self.host is not None:
            entry = self.host.peek(prompt.page_id)
            if entry is not None and entry.logits is not None:
                logits = np.frombuffer(entry.logits, dtype=np.float32).copy()
        return logits

    def record(
        self,
        lane_seq: int,
        prefix: PrefixIdentity,
        logits: np.ndarray | None = None,
        *,
        indexed: tuple[Hashable, Sequence[int]] | None = None,
    ) -> bool:
        """Record the lane's first `prefix.token_count` cells as an entry (a whole prompt with its logits).

        `indexed` = (space, tokens) also files the entry in the prefix index.
        False when nothing was saved: below `min_tokens`, already resident,
        uncacheable, or every entry borrowed (serving goes on uncached).
        """
        n = prefix.token_count
        if n <= 0 or n < self.cache.config.min_tokens:
            return False
        nbytes = n * self.bytes_per_token + (logits.nbytes if logits is not None else 0)
        try:
            allocation = self.cache.allocate_for_record(prefix.page_id, n, nbytes, self._demote)
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
        if indexed is not None and self.index is not None and prefix.page_id not in self.index:
            space, tokens = indexed
            self.index.insert(space, tokens[:n], prefix.page_id)
        self.counters.records += 1
        return True

    def make_room(self, cells: int) -> bool:
        """Evict (demote) LRU entries until `cells` are free; False if the cache alone cannot make them."""
        while self.ledger.free_cells < cells:
            if self.cache.evict_one_lru_entry(self._demote) is None:
                return False
            self.counters.proactive_evictions += 1
        return True

    def evict_all(self) -> int:
        """Drop every resident entry and forget the host tier (an operator's "clear")."""
        if self.host is not None:
            pages = self.host.pages()
            self.host.clear()
            for page_id in pages:
                self._unindex_if_gone(page_id)
        return len(self.cache.clear(self._drop))

    def drop_resident(self) -> int:
        """Free every resident entry's cells (demoting them): the last resort before failing a decode."""
        return len(self.cache.clear(self._demote))

    def _demote(self, eviction: ResidentEviction) -> None:
        """Copy an evicted entry's state to the host tier (if there is one), then drop its cells."""
        if self.host is not None and not self.host.touch(eviction.page_id):
            logits = self._logits.get(eviction.page_id)
            payload = self.ctx.state_seq_get(eviction.seq_id)
            entry = HostEntry(eviction.token_count, payload, logits.tobytes() if logits is not None else None)
            for pushed_out in self.host.put(eviction.page_id, entry):
                self._unindex_if_gone(pushed_out)
            if eviction.page_id in self.host:
                self.counters.demotions += 1
        self._drop(eviction)

    def _drop(self, eviction: ResidentEviction) -> None:
        self._seq_rm(eviction.seq_id)
        self._logits.pop(eviction.page_id, None)
        if self.index is not None and (self.host is None or eviction.page_id not in self.host):
            self.index.remove(eviction.page_id)

    def _unindex_if_gone(self, page_id: PageId) -> None:
        """A page that left the host tier stays indexed only while it is still resident."""
        if self.index is not None and page_id not in self.cache:
            self.index.remove(page_id)

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
