"""The resident books on a real cell mirror: entries that share cells count them once.

In the pool `seq_cp` shares cells instead of copying them, so a prompt's entries
at several lengths, or an entry recorded from a lane that reused another, hold
one prefix's cells. The token cap counts distinct cells; evicting prefers an
entry whose going frees some.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from skippy_cache.cells import CellMap
from skippy_cache.config import ResidentCacheConfig
from skippy_cache.identity import PageId
from skippy_cache.resident import ResidentEviction, ResidentPrefixCache, SeqId

LANE, OTHER_LANE = SeqId(0), SeqId(1)


class Pool:
    """A cell mirror, the books on it, and the runtime's side of a record and an eviction."""

    def __init__(self, *, cap: int, n_cells: int = 4096, max_entries: int = 16) -> None:
        self.cells = CellMap(n_cells)
        self.cache = ResidentPrefixCache(
            ResidentCacheConfig(max_entries=max_entries, max_bytes=0, min_tokens=1, reserved_seq_count=2,
                                max_resident_tokens=cap),
            cells=self.cells,
        )

    def prefill(self, lane: SeqId, tokens: int) -> None:
        """The lane computes `tokens` more positions in fresh cells."""
        start = self.cells.pos_max(lane) + 1
        self.cells.decode([(lane, start, start + tokens)])

    def request(self, lane: SeqId, page: str, tokens: int) -> None:
        """A request on `lane` prefills `tokens` fresh cells, records them all as `page`, and ends."""
        self.prefill(lane, tokens)
        self.record(lane, page, tokens)
        self.cells.seq_rm(lane)

    def hit(self, lane: SeqId, page: str, tokens: int) -> None:
        """The lane reuses an entry's first `tokens` cells (a resident hit)."""
        entry = self.cache.touch(PageId(page))
        assert entry is not None
        self.cells.seq_cp(entry.seq_id, lane, 0, tokens)

    def record(self, lane: SeqId, page: str, tokens: int) -> list[str]:
        """Record the lane's first `tokens` cells as `page`; the pages evicted for it."""
        allocation = self.cache.allocate_for_record(PageId(page), tokens, 0, self.drop, source=lane)
        if allocation.should_save:
            self.cells.seq_cp(lane, allocation.seq_id, 0, tokens)
            self.cache.commit_record(PageId(page), allocation.seq_id, tokens, 0)
        self.check()
        return [e.page_id for e in allocation.evictions]

    def drop(self, eviction: ResidentEviction) -> None:
        self.cells.seq_rm(eviction.seq_id)

    def entry_cells(self) -> int:
        return self.cells.cells_held({e.seq_id for e in self.cache.entries()})

    def check(self) -> None:
        self.cache.check_invariants()
        self.cells.check_invariants()
        stats = self.cache.stats()
        assert stats.resident_cells == self.entry_cells()
        assert stats.resident_tokens == sum(e.token_count for e in self.cache.entries())


def test_entries_of_one_prompt_count_its_cells_once() -> None:
    pool = Pool(cap=1000)
    pool.prefill(LANE, 600)
    assert pool.record(LANE, "first 500", 500) == []
    assert pool.record(LANE, "whole 600", 600) == []
    # Summed, 1,100 tokens would be over the cap of 1,000 and the first entry evicted.
    stats = pool.cache.stats()
    assert (stats.resident_tokens, stats.resident_cells, stats.entries) == (1100, 600, 2)


def test_an_entry_recorded_from_a_lane_that_reused_another_counts_only_its_new_cells() -> None:
    pool = Pool(cap=1000)
    pool.request(LANE, "system", 700)
    for turn in range(3):
        pool.hit(OTHER_LANE, "system", 700)
        pool.prefill(OTHER_LANE, 50)
        assert pool.record(OTHER_LANE, f"turn {turn}", 750) == []
        pool.cells.seq_rm(OTHER_LANE)
    stats = pool.cache.stats()
    assert (stats.resident_tokens, stats.resident_cells) == (700 + 3 * 750, 700 + 3 * 50)


def test_a_record_evicts_an_entry_that_frees_cells_before_an_older_prefix_that_frees_none() -> None:
    pool = Pool(cap=1000)
    pool.prefill(LANE, 600)
    pool.record(LANE, "prefix 500", 500)
    pool.record(LANE, "whole 600", 600)
    pool.cells.seq_rm(LANE)
    pool.request(OTHER_LANE, "other", 300)
    pool.prefill(LANE, 150)
    # 900 cells held; 150 more need 50 freed. "prefix 500" is the least recently used, but
    # "whole 600" holds its cells: evicting it frees nothing. "whole 600" frees its last 100.
    assert pool.record(LANE, "new", 150) == ["whole 600"]
    assert [e.page_id for e in pool.cache.entries()] == ["prefix 500", "other", "new"]
    assert pool.entry_cells() == 950


def test_evicting_for_the_pool_skips_an_entry_whose_cells_a_lane_shares() -> None:
    pool = Pool(cap=0)
    pool.request(LANE, "shared", 400)
    pool.request(OTHER_LANE, "apart", 200)
    pool.hit(LANE, "shared", 400)  # "shared" is now the most recently used, and a lane holds its cells
    pool.cache.touch(PageId("apart"))
    free = pool.cells.free_cells
    eviction = pool.cache.evict_one_lru_entry(pool.drop)
    assert eviction is not None and eviction.page_id == "apart"
    assert pool.cells.free_cells == free + 200


def test_without_a_freeing_entry_eviction_is_least_recently_used() -> None:
    pool = Pool(cap=0)
    pool.prefill(LANE, 400)
    pool.record(LANE, "a", 300)
    pool.record(LANE, "b", 400)
    # The lane holds every entry's cells: none frees a cell, so the oldest goes.
    eviction = pool.cache.evict_one_lru_entry(pool.drop)
    assert eviction is not None and eviction.page_id == "a"


def test_a_record_alone_over_the_cap_is_uncacheable_whatever_it_shares() -> None:
    pool = Pool(cap=500)
    pool.prefill(LANE, 600)
    allocation = pool.cache.allocate_for_record(PageId("big"), 600, 0, pool.drop, source=LANE)
    assert not allocation.should_save and allocation.reason == "uncacheable"


def test_pins_sharing_a_system_prompt_count_it_once() -> None:
    pool = Pool(cap=0)
    pool.cache.max_pinned_tokens = 2048
    pool.request(LANE, "system", 1500)
    for user in ("alice", "bob"):
        pool.hit(LANE, "system", 1500)
        pool.prefill(LANE, 100)
        pool.record(LANE, user, 1600)
        pool.cells.seq_rm(LANE)
    assert pool.cache.pin(PageId("alice")) == []
    # 3,200 tokens summed, over the 2,048 a pin may hold; 1,700 cells.
    assert pool.cache.pin(PageId("bob")) == []
    assert pool.cache.pinned(PageId("alice")) and pool.cache.pinned(PageId("bob"))
    pool.check()
    pool.prefill(OTHER_LANE, 600)
    pool.record(OTHER_LANE, "carol", 600)
    # 2,300 cells with all three, 2,200 without alice (bob still holds the system prompt): both go.
    assert pool.cache.pin(PageId("carol")) == ["alice", "bob"]
    pool.check()


def test_an_idle_entry_whose_cells_an_entry_in_use_holds_stays_until_that_one_goes_idle() -> None:
    pool = Pool(cap=0)
    pool.request(LANE, "turn 1", 500)
    pool.hit(LANE, "turn 1", 500)
    pool.prefill(LANE, 100)
    pool.record(LANE, "turn 2", 600)
    pool.cells.seq_rm(LANE)
    pool.request(OTHER_LANE, "apart", 200)
    pool.cache.advance_work(300)
    pool.cache.touch(PageId("turn 2"))
    # Both "turn 1" and "apart" are idle; "turn 2", in use, holds every cell of "turn 1".
    assert [e.page_id for e in pool.cache.evict_idle(256, pool.drop)] == ["apart"]
    pool.cache.advance_work(300)
    assert [e.page_id for e in pool.cache.evict_idle(256, pool.drop)] == ["turn 1", "turn 2"]
    assert pool.cells.used_cells == 0
    pool.check()


def test_an_idle_entry_a_running_lane_shares_stays() -> None:
    pool = Pool(cap=0)
    pool.prefill(LANE, 300)
    pool.record(LANE, "prompt", 300)
    pool.cache.advance_work(300)
    assert pool.cache.evict_idle(256, pool.drop) == []
    pool.cells.seq_rm(LANE)
    assert [e.page_id for e in pool.cache.evict_idle(256, pool.drop)] == ["prompt"]


class SharedCellsMachine(RuleBasedStateMachine):
    """Lanes prefill, reuse entries and record prefixes; the books never pass the cap in cells, and
    never evict while the cells held with the record would fit."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = Pool(cap=1200, n_cells=2048, max_entries=6)
        self.names = 0

    @rule(lane=st.sampled_from([LANE, OTHER_LANE]), tokens=st.integers(1, 200))
    def prefill(self, lane: SeqId, tokens: int) -> None:
        if self.pool.cells.free_cells < tokens or self.pool.cells.pos_max(lane) + 1 + tokens > 700:
            return
        self.pool.prefill(lane, tokens)

    @rule(lane=st.sampled_from([LANE, OTHER_LANE]), data=st.data())
    def hit(self, lane: SeqId, data: st.DataObject) -> None:
        entries = self.pool.cache.entries()
        if not entries or self.pool.cells.pos_max(lane) >= 0:
            return
        entry = data.draw(st.sampled_from(entries))
        self.pool.hit(lane, entry.page_id, data.draw(st.integers(1, entry.token_count)))

    @rule(lane=st.sampled_from([LANE, OTHER_LANE]), data=st.data())
    def record(self, lane: SeqId, data: st.DataObject) -> None:
        held = self.pool.cells.pos_max(lane) + 1
        if held < 1:
            return
        tokens = data.draw(st.integers(1, held))
        self.names += 1
        before = {e.page_id: e.seq_id for e in self.pool.cache.entries()}
        cells_before = self.pool.cells.copy()
        evicted = self.pool.record(lane, f"p{self.names}", tokens)
        if evicted:
            # Nothing was evicted that the record did not need: without the last victim's going,
            # the entries left and the record would have been over the cap or the entry count.
            kept = [seq for page, seq in before.items() if page not in evicted[:-1]]
            assert (cells_before.cells_held(kept, prefix=(lane, tokens)) > 1200
                    or len(kept) + 1 > self.pool.cache.config.max_entries)

    @rule(lane=st.sampled_from([LANE, OTHER_LANE]))
    def end(self, lane: SeqId) -> None:
        self.pool.cells.seq_rm(lane)

    @precondition(lambda self: len(self.pool.cache) > 0)
    @rule()
    def evict_for_the_pool(self) -> None:
        free = self.pool.cells.free_cells
        freeing = [e.page_id for e in self.pool.cache.entries()
                   if self.pool.cells.cells_freed_by_removing({e.seq_id}) > 0]
        eviction = self.pool.cache.evict_one_lru_entry(self.pool.drop)
        assert eviction is not None
        if freeing:
            assert eviction.page_id == freeing[0] and self.pool.cells.free_cells > free

    @invariant()
    def books_hold(self) -> None:
        self.pool.check()
        assert self.pool.entry_cells() <= 1200


SharedCellsMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestSharedCells = SharedCellsMachine.TestCase
