"""ResidentPrefixCache: peek/touch semantics, budgets, exact eviction order, and a model check."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from skippy_cache.config import LLAMA_MAX_SEQ, CacheConfig, ContextConfig, ResidentCacheConfig
from skippy_cache.identity import PageId
from skippy_cache.resident import (
    NO_SEQ,
    RecordAllocation,
    ResidentCacheError,
    ResidentCacheStats,
    ResidentEviction,
    ResidentLookup,
    ResidentPrefixCache,
    SeqId,
)


def P(name: str) -> PageId:
    return PageId(name)


def make_cache(
    *,
    max_entries: int = 16,
    max_bytes: int = 0,
    min_tokens: int = 64,
    reserved_seq_count: int = 8,
    max_resident_tokens: int = 0,
) -> ResidentPrefixCache:
    return ResidentPrefixCache(
        ResidentCacheConfig(
            max_entries=max_entries,
            max_bytes=max_bytes,
            min_tokens=min_tokens,
            reserved_seq_count=reserved_seq_count,
            max_resident_tokens=max_resident_tokens,
        )
    )


class Dropper:
    """A drop callback that records what it was asked to drop and checks the books still hold it."""

    def __init__(self, cache: ResidentPrefixCache, fail_on: str | None = None) -> None:
        self.cache = cache
        self.fail_on = fail_on
        self.dropped: list[str] = []

    def __call__(self, eviction: ResidentEviction) -> None:
        # The native drop runs while the entry is still booked.
        assert eviction.page_id in self.cache
        peeked = self.cache.peek(eviction.page_id)
        assert peeked is not None and peeked.seq_id == eviction.seq_id
        if eviction.page_id == self.fail_on:
            raise OSError(f"native drop of {eviction.page_id} failed")
        self.dropped.append(eviction.page_id)


def record(
    cache: ResidentPrefixCache, page: str, tokens: int, nbytes: int = 0, drop: Callable | None = None
) -> RecordAllocation:
    allocation = cache.allocate_for_record(P(page), tokens, nbytes, drop or Dropper(cache))
    if allocation.should_save:
        cache.commit_record(P(page), allocation.seq_id, tokens, nbytes)
    cache.check_invariants()
    return allocation


def evicted(allocation: RecordAllocation) -> list[str]:
    return [e.page_id for e in allocation.evictions]


def pages(cache: ResidentPrefixCache) -> list[str]:
    """Committed pages, least recently used first."""
    return [e.page_id for e in cache.entries()]


# -- required scenarios --------------------------------------------------------------------


def test_token_budget_evicts_lru_before_entry_cap() -> None:
    cache = ResidentPrefixCache(
        ResidentCacheConfig(
            max_entries=16, max_bytes=0, min_tokens=64, reserved_seq_count=8, max_resident_tokens=4096
        )
    )
    first = record(cache, "a", 1500)
    second = record(cache, "b", 1500)
    third = record(cache, "c", 1500)
    assert (first.seq_id, second.seq_id) == (8, 9)
    assert evicted(first) == evicted(second) == []
    assert third.evictions == (ResidentEviction(P("a"), SeqId(8), 1500, 0),)
    # a's freed id is reused by c.
    assert third.seq_id == 8
    assert pages(cache) == ["b", "c"]
    stats = cache.stats()
    assert (stats.entries, stats.resident_tokens, stats.evictions, stats.records) == (2, 3000, 1, 3)


def test_small_context_smoke_case() -> None:
    config = ResidentCacheConfig.from_context(ContextConfig(ctx_size=768), CacheConfig(min_tokens=256))
    assert config.max_resident_tokens == 0
    assert config.min_tokens == 256
    cache = ResidentPrefixCache(config)
    allocation = record(cache, "smoke", 533)
    assert allocation.should_save is True
    assert allocation.reason is None
    assert allocation.seq_id == config.reserved_seq_count == 8
    assert cache.peek(P("smoke")) == ResidentLookup(P("smoke"), SeqId(8), 533)


def test_zero_token_budget_never_evicts_on_tokens() -> None:
    cache = make_cache(max_entries=64, max_resident_tokens=0)
    for i in range(12):
        allocation = record(cache, f"p{i}", 10_000)
        assert allocation.should_save
        assert allocation.evictions == ()
        assert allocation.seq_id == 8 + i
    stats = cache.stats()
    assert (stats.entries, stats.resident_tokens, stats.evictions) == (12, 120_000, 0)


# -- peek / touch --------------------------------------------------------------------------


def test_touch_and_peek_return_the_entry_and_count_nothing() -> None:
    cache = make_cache()
    record(cache, "a", 100)
    before = cache.stats()
    assert cache.touch(P("a")) == ResidentLookup(P("a"), SeqId(8), 100)
    assert cache.touch(P("zzz")) is None
    assert cache.peek(P("a")) == ResidentLookup(P("a"), SeqId(8), 100)
    assert cache.peek(P("zzz")) is None
    assert P("zzz") not in cache
    # Hits are the runtime's to count; the cache's books do not move on a read.
    assert cache.stats() == before
    cache.check_invariants()


# -- record allocation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("caps", "tokens", "nbytes"),
    [
        ({"max_bytes": 1000}, 100, 1001),
        ({"max_resident_tokens": 4096}, 4097, 0),
        ({"max_bytes": 1000, "max_resident_tokens": 4096}, 5000, 5000),
    ],
    ids=["bytes", "tokens", "both"],
)
def test_uncacheable_oversize_record(caps: dict, tokens: int, nbytes: int) -> None:
    cache = make_cache(max_entries=3, **caps)
    record(cache, "a", 100, 10)
    record(cache, "b", 100, 10)
    record(cache, "c", 100, 10)  # full: a normal record would evict a
    before = cache.stats()
    drop = Dropper(cache)
    allocation = cache.allocate_for_record(P("huge"), tokens, nbytes, drop)
    assert allocation == RecordAllocation(NO_SEQ, (), should_save=False, reason="uncacheable")
    assert allocation.seq_id == -1
    assert drop.dropped == []
    assert cache.stats() == dataclasses.replace(before, uncacheable=before.uncacheable + 1)
    assert pages(cache) == ["a", "b", "c"]
    assert P("huge") not in cache
    cache.check_invariants()


def test_record_exactly_at_the_caps_is_cacheable() -> None:
    cache = make_cache(max_bytes=1000, max_resident_tokens=4096)
    allocation = record(cache, "a", 4096, 1000)
    assert allocation.should_save and allocation.seq_id == 8
    stats = cache.stats()
    assert (stats.resident_tokens, stats.estimated_bytes) == (4096, 1000)


def test_record_below_min_tokens_is_an_error() -> None:
    cache = make_cache(min_tokens=64)
    with pytest.raises(ResidentCacheError, match="below min_tokens"):
        cache.allocate_for_record(P("a"), 63, 0, Dropper(cache))
    assert cache.stats() == make_cache(min_tokens=64).stats()
    assert record(cache, "a", 64).seq_id == 8


def test_negative_bytes_is_an_error() -> None:
    cache = make_cache(min_tokens=0)
    with pytest.raises(ResidentCacheError, match="negative"):
        cache.allocate_for_record(P("a"), 10, -1, Dropper(cache))


def test_existing_page_returns_its_seq_id_without_saving() -> None:
    cache = make_cache(max_entries=2)
    record(cache, "a", 100)
    record(cache, "b", 100)
    again = cache.allocate_for_record(P("a"), 100, 0, Dropper(cache))
    assert again == RecordAllocation(SeqId(8), (), should_save=False, reason="exists")
    assert cache.stats().records == 2
    # It was touched: b is now the least recently used.
    assert pages(cache) == ["b", "a"]
    assert evicted(record(cache, "c", 100)) == ["b"]


def test_entry_cap_eviction_is_lru_and_touch_refreshes() -> None:
    cache = make_cache(max_entries=3)
    for page in "abc":
        record(cache, page, 100)
    assert cache.touch(P("a")) is not None  # a becomes the most recent
    assert cache.peek(P("b")) is not None  # peek leaves b the least recent
    d = record(cache, "d", 100)
    assert evicted(d) == ["b"]
    assert d.seq_id == 9  # b's id
    assert pages(cache) == ["c", "a", "d"]
    assert evicted(record(cache, "e", 100)) == ["c"]
    assert cache.touch(P("a")) is not None
    assert evicted(record(cache, "f", 100)) == ["d"]
    assert pages(cache) == ["e", "a", "f"]


def test_byte_budget_eviction() -> None:
    cache = make_cache(max_entries=16, max_bytes=1000)
    record(cache, "a", 100, 400)
    record(cache, "b", 100, 400)
    assert evicted(record(cache, "c", 100, 300)) == ["a"]  # 1100 > 1000: a goes, 700 left
    assert evicted(record(cache, "d", 100, 300)) == []  # exactly 1000
    assert evicted(record(cache, "e", 100, 1)) == ["b"]
    assert cache.stats().estimated_bytes == 601
    # One record may need several evictions, oldest first.
    assert evicted(record(cache, "f", 100, 1000)) == ["c", "d", "e"]
    assert pages(cache) == ["f"]
    assert cache.stats().estimated_bytes == 1000


def test_no_releasable_entries_when_all_pending() -> None:
    cache = make_cache(max_entries=2)
    cache.allocate_for_record(P("a"), 100, 0, Dropper(cache))
    cache.allocate_for_record(P("b"), 100, 0, Dropper(cache))
    before = cache.stats()
    with pytest.raises(ResidentCacheError, match="no releasable entries"):
        cache.allocate_for_record(P("c"), 100, 0, Dropper(cache))
    assert cache.stats() == before
    assert P("c") not in cache
    cache.check_invariants()


def test_pending_page_cannot_be_allocated_twice() -> None:
    cache = make_cache()
    cache.allocate_for_record(P("a"), 100, 0, Dropper(cache))
    with pytest.raises(ResidentCacheError, match="already being recorded"):
        cache.allocate_for_record(P("a"), 100, 0, Dropper(cache))
    # Pending is not an entry yet.
    assert cache.touch(P("a")) is None
    assert cache.peek(P("a")) is None


def test_failing_drop_leaves_cache_unchanged() -> None:
    cache = make_cache(max_entries=2)
    record(cache, "a", 100, 7)
    record(cache, "b", 100, 7)
    before_stats = cache.stats()
    before_entries = cache.entries()
    drop = Dropper(cache, fail_on="a")
    with pytest.raises(OSError, match="native drop of a failed"):
        cache.allocate_for_record(P("c"), 100, 7, drop)
    assert cache.stats() == before_stats
    assert cache.entries() == before_entries
    assert P("c") not in cache
    cache.check_invariants()
    assert cache.touch(P("a")) == ResidentLookup(P("a"), SeqId(8), 100)
    # The same failure from proactive eviction.
    cache.touch(P("b"))
    with pytest.raises(OSError):
        cache.evict_one_lru_entry(Dropper(cache, fail_on="a"))
    with pytest.raises(OSError):
        cache.clear(Dropper(cache, fail_on="a"))
    assert cache.entries() == [ResidentLookup(P("a"), SeqId(8), 100), ResidentLookup(P("b"), SeqId(9), 100)]
    assert cache.stats().evictions == 0
    # Once the drop works, a's id is freed and reused.
    assert record(cache, "c", 100, 7).seq_id == 8


def test_drop_runs_before_the_entry_is_forgotten() -> None:
    cache = make_cache(max_entries=1)
    record(cache, "a", 100, 5)
    seen: list[tuple[bool, ResidentLookup | None, int, int]] = []

    def drop(eviction: ResidentEviction) -> None:
        stats = cache.stats()
        booked = eviction.page_id in cache
        seen.append((booked, cache.peek(eviction.page_id), stats.entries, stats.resident_tokens))

    allocation = cache.allocate_for_record(P("b"), 200, 5, drop)
    assert seen == [(True, ResidentLookup(P("a"), SeqId(8), 100), 1, 100)]
    assert allocation.evictions == (ResidentEviction(P("a"), SeqId(8), 100, 5),)
    assert P("a") not in cache


def test_freed_seq_ids_are_reused_first() -> None:
    cache = make_cache(max_entries=4, reserved_seq_count=8)
    assert [record(cache, p, 100).seq_id for p in "abcd"] == [8, 9, 10, 11]
    assert cache.seq_id_limit == 12
    cache.touch(P("a"))
    cache.touch(P("c"))
    drop = Dropper(cache)
    assert cache.evict_one_lru_entry(drop) == ResidentEviction(P("b"), SeqId(9), 100, 0)
    assert cache.evict_one_lru_entry(drop) == ResidentEviction(P("d"), SeqId(11), 100, 0)
    # The most recently freed id comes back first, before any fresh one.
    assert record(cache, "e", 100).seq_id == 11
    assert record(cache, "f", 100).seq_id == 9
    assert sorted(e.seq_id for e in cache.entries()) == [8, 9, 10, 11]
    assert evicted(record(cache, "g", 100)) == ["a"]
    assert cache.peek(P("g")).seq_id == 8  # type: ignore[union-attr]


@pytest.mark.parametrize("reserved", [0, 2, 8, 200, 255])
def test_seq_ids_stay_in_range_under_churn(reserved: int) -> None:
    config = ResidentCacheConfig(
        max_entries=min(5, LLAMA_MAX_SEQ - reserved),
        max_bytes=0,
        min_tokens=1,
        reserved_seq_count=reserved,
        max_resident_tokens=0,
    )
    cache = ResidentPrefixCache(config)
    assert cache.seq_id_limit == reserved + config.max_entries
    for i in range(40):
        allocation = record(cache, f"p{i}", 10)
        assert reserved <= allocation.seq_id < min(cache.seq_id_limit, LLAMA_MAX_SEQ)
        if i % 3 == 0:
            cache.touch(P(f"p{i}"))
    assert len(cache) == config.max_entries


def test_seq_ids_exhausted_when_entries_outnumber_ids() -> None:
    # Built by hand past what from_context allows: 300 entries, 6 free ids.
    cache = ResidentPrefixCache(
        ResidentCacheConfig(
            max_entries=300, max_bytes=0, min_tokens=1, reserved_seq_count=250, max_resident_tokens=0
        )
    )
    assert cache.seq_id_limit == LLAMA_MAX_SEQ
    assert [record(cache, f"p{i}", 10).seq_id for i in range(6)] == [250, 251, 252, 253, 254, 255]
    before = cache.stats()
    with pytest.raises(ResidentCacheError, match="exhausted"):
        cache.allocate_for_record(P("p6"), 10, 0, Dropper(cache))
    assert cache.stats() == before
    cache.check_invariants()


@pytest.mark.parametrize("reserved", [-1, LLAMA_MAX_SEQ, LLAMA_MAX_SEQ + 1])
def test_reserved_ids_must_leave_room(reserved: int) -> None:
    with pytest.raises(ResidentCacheError, match="leaves no cache ids"):
        make_cache(reserved_seq_count=reserved)


def test_evict_one_lru_entry() -> None:
    cache = make_cache()
    assert cache.evict_one_lru_entry(Dropper(cache)) is None
    record(cache, "a", 100, 1)
    record(cache, "b", 200, 2)
    record(cache, "c", 300, 3)
    cache.touch(P("a"))
    cache.touch(P("b"))
    drop = Dropper(cache)
    assert cache.evict_one_lru_entry(drop) == ResidentEviction(P("c"), SeqId(10), 300, 3)
    assert cache.evict_one_lru_entry(drop) == ResidentEviction(P("a"), SeqId(8), 100, 1)
    stats = cache.stats()
    assert (stats.entries, stats.resident_tokens, stats.estimated_bytes, stats.evictions) == (1, 200, 2, 2)
    assert cache.evict_one_lru_entry(drop) == ResidentEviction(P("b"), SeqId(9), 200, 2)
    assert cache.evict_one_lru_entry(drop) is None
    assert drop.dropped == ["c", "a", "b"]
    cache.check_invariants()


def test_evict_lru_where_takes_the_least_recently_used_entry_it_picks() -> None:
    cache = ResidentPrefixCache(make_cache().config, max_pinned_tokens=100)
    for page, tokens in (("a", 100), ("b", 200), ("c", 300)):
        record(cache, page, tokens)
    cache.pin(P("a"))
    assert cache.pinned(P("a"))
    drop = Dropper(cache)
    # a is pinned and c is not picked: b goes, whatever its rank.
    assert cache.evict_lru_where(lambda seq: seq != 10, drop) == ResidentEviction(P("b"), SeqId(9), 200, 0)
    assert cache.evict_lru_where(lambda seq: seq != 10, drop) is None
    assert cache.evict_lru_where(lambda seq: True, drop) == ResidentEviction(P("c"), SeqId(10), 300, 0)
    assert drop.dropped == ["b", "c"] and pages(cache) == ["a"]
    cache.check_invariants()


@pytest.mark.parametrize(
    ("page", "seq_id", "tokens", "nbytes"),
    [("a", 9, 100, 10), ("a", 8, 101, 10), ("a", 8, 100, 11), ("other", 8, 100, 10)],
    ids=["seq", "tokens", "bytes", "page"],
)
def test_commit_record_mismatch_raises(page: str, seq_id: int, tokens: int, nbytes: int) -> None:
    cache = make_cache()
    allocation = cache.allocate_for_record(P("a"), 100, 10, Dropper(cache))
    assert allocation.seq_id == 8
    before = cache.stats()
    with pytest.raises(ResidentCacheError, match="does not match"):
        cache.commit_record(P(page), SeqId(seq_id), tokens, nbytes)
    assert cache.stats() == before
    cache.commit_record(P("a"), SeqId(8), 100, 10)
    assert cache.peek(P("a")) == ResidentLookup(P("a"), SeqId(8), 100)
    with pytest.raises(ResidentCacheError, match="does not match"):
        cache.commit_record(P("a"), SeqId(8), 100, 10)  # twice


def test_clear_evicts_every_entry_in_lru_order_and_leaves_pending() -> None:
    cache = make_cache()
    for page in "abcd":
        record(cache, page, 100)
    cache.touch(P("b"))
    cache.touch(P("a"))
    pending = cache.allocate_for_record(P("e"), 64, 5, Dropper(cache))
    drop = Dropper(cache)
    assert [e.page_id for e in cache.clear(drop)] == ["c", "d", "b", "a"]
    assert drop.dropped == ["c", "d", "b", "a"]
    assert pages(cache) == []
    stats = cache.stats()
    assert (stats.entries, stats.pending, stats.resident_tokens, stats.estimated_bytes) == (0, 1, 64, 5)
    cache.check_invariants()
    # The pending record is still the runtime's to commit, under the id it was given.
    cache.commit_record(P("e"), pending.seq_id, 64, 5)
    assert cache.peek(P("e")) == ResidentLookup(P("e"), pending.seq_id, 64)


def test_stats_snapshot() -> None:
    cache = make_cache(max_entries=5, max_bytes=10_000, max_resident_tokens=8192)
    record(cache, "a", 100, 1000)
    record(cache, "b", 300, 2000)
    cache.allocate_for_record(P("c"), 64, 5, Dropper(cache))
    cache.touch(P("a"))
    cache.touch(P("x"))
    assert cache.stats() == ResidentCacheStats(
        entries=2,
        resident_tokens=464,
        resident_cells=464,
        estimated_bytes=3005,
        max_entries=5,
        max_bytes=10_000,
        max_resident_tokens=8192,
        pending=1,
        records=2,
        evictions=0,
        uncacheable=0,
    )
    assert len(cache) == 2


# -- work clock and idle eviction ----------------------------------------------------------


def test_idle_entry_survives_up_to_the_threshold_then_goes() -> None:
    cache = make_cache()
    cache.advance_work(50)
    record(cache, "a", 100, 3)  # used at work 50
    cache.advance_work(100)  # 100 tokens idle
    drop = Dropper(cache)
    assert cache.evict_idle(100, drop) == []
    assert P("a") in cache
    assert cache.evict_idle(99, drop) == [ResidentEviction(P("a"), SeqId(8), 100, 3)]
    assert drop.dropped == ["a"]
    assert P("a") not in cache
    stats = cache.stats()
    assert (stats.entries, stats.resident_tokens, stats.estimated_bytes, stats.evictions) == (0, 0, 0, 1)
    cache.check_invariants()


def test_evict_idle_at_zero_spares_only_entries_used_since_the_last_work() -> None:
    cache = make_cache()
    record(cache, "a", 100)
    assert cache.evict_idle(0, Dropper(cache)) == []
    cache.advance_work(0)  # no work, no idleness
    assert cache.evict_idle(0, Dropper(cache)) == []
    cache.advance_work(1)
    record(cache, "b", 100)
    assert [e.page_id for e in cache.evict_idle(0, Dropper(cache))] == ["a"]
    assert pages(cache) == ["b"]


@pytest.mark.parametrize("use", ["touch", "allocate_exists"])
def test_a_use_resets_the_idle_count(use: str) -> None:
    cache = make_cache()
    record(cache, "a", 100)
    record(cache, "b", 100)
    cache.advance_work(80)
    if use == "touch":
        assert cache.touch(P("a")) is not None
    else:
        assert cache.allocate_for_record(P("a"), 100, 0, Dropper(cache)).reason == "exists"
    cache.advance_work(80)  # a: 80 idle, b: 160
    assert [e.page_id for e in cache.evict_idle(100, Dropper(cache))] == ["b"]
    assert pages(cache) == ["a"]
    cache.advance_work(20)  # a: exactly 100
    assert cache.evict_idle(100, Dropper(cache)) == []
    cache.advance_work(1)
    assert [e.page_id for e in cache.evict_idle(100, Dropper(cache))] == ["a"]


def test_peek_does_not_reset_the_idle_count() -> None:
    cache = make_cache()
    record(cache, "a", 100)
    cache.advance_work(80)
    assert cache.peek(P("a")) is not None
    cache.advance_work(21)
    # Idle since its commit at 0, not since the peek at 80.
    assert [e.page_id for e in cache.evict_idle(100, Dropper(cache))] == ["a"]


def test_commit_not_allocation_starts_the_idle_count() -> None:
    cache = make_cache()
    allocation = cache.allocate_for_record(P("a"), 100, 0, Dropper(cache))
    cache.advance_work(500)
    # Pending entries are not the cache's to evict.
    assert cache.evict_idle(0, Dropper(cache)) == []
    assert cache.stats().pending == 1
    cache.commit_record(P("a"), allocation.seq_id, 100, 0)
    cache.advance_work(10)
    assert cache.evict_idle(10, Dropper(cache)) == []
    cache.advance_work(1)
    assert [e.page_id for e in cache.evict_idle(10, Dropper(cache))] == ["a"]


def test_evict_idle_takes_the_oldest_use_first() -> None:
    cache = make_cache()
    record(cache, "a", 100, 1)  # used at 0
    cache.advance_work(10)
    record(cache, "c", 200, 2)  # used at 10
    cache.advance_work(10)
    record(cache, "b", 300, 3)  # used at 20
    cache.advance_work(10)
    cache.touch(P("a"))  # used at 30
    cache.advance_work(10)
    record(cache, "d", 400, 4)  # used at 40
    cache.advance_work(60)  # work 100: idle a 70, c 90, b 80, d 60
    drop = Dropper(cache)
    # Neither page order, nor record order: the order of last use.
    assert cache.evict_idle(60, drop) == [
        ResidentEviction(P("c"), SeqId(9), 200, 2),
        ResidentEviction(P("b"), SeqId(10), 300, 3),
        ResidentEviction(P("a"), SeqId(8), 100, 1),
    ]
    assert drop.dropped == ["c", "b", "a"]
    assert pages(cache) == ["d"]
    stats = cache.stats()
    assert (stats.resident_tokens, stats.estimated_bytes, stats.evictions) == (400, 4, 3)
    # Ids were freed in eviction order; the most recently freed comes back first.
    assert record(cache, "e", 100).seq_id == 8
    assert record(cache, "f", 100).seq_id == 10


def test_evict_idle_on_an_empty_cache() -> None:
    cache = make_cache()
    cache.advance_work(1000)
    assert cache.evict_idle(0, Dropper(cache)) == []
    assert cache.stats().evictions == 0


def test_failing_drop_in_evict_idle_leaves_the_entry_booked() -> None:
    cache = make_cache()
    record(cache, "a", 100, 7)  # used at 0
    cache.advance_work(10)
    record(cache, "b", 100, 7)  # used at 10
    cache.advance_work(10)
    record(cache, "c", 100, 7)  # used at 20
    cache.advance_work(100)
    before_stats = cache.stats()
    before_entries = cache.entries()
    # The first (oldest) drop fails: nothing changes.
    with pytest.raises(OSError, match="native drop of a failed"):
        cache.evict_idle(50, Dropper(cache, fail_on="a"))
    assert cache.stats() == before_stats
    assert cache.entries() == before_entries
    cache.check_invariants()
    # A later drop fails: what went before it is gone, it and the rest stay booked.
    drop = Dropper(cache, fail_on="b")
    with pytest.raises(OSError, match="native drop of b failed"):
        cache.evict_idle(50, drop)
    assert drop.dropped == ["a"]
    assert cache.entries() == [ResidentLookup(P("b"), SeqId(9), 100), ResidentLookup(P("c"), SeqId(10), 100)]
    stats = cache.stats()
    assert (stats.entries, stats.resident_tokens, stats.estimated_bytes, stats.evictions) == (2, 200, 14, 1)
    cache.check_invariants()
    # Once the drop works, both go, and b's id is not handed out while it is booked.
    assert [e.page_id for e in cache.evict_idle(50, Dropper(cache))] == ["b", "c"]
    assert cache.stats().evictions == 3


@pytest.mark.parametrize("tokens", [-1, -100])
def test_negative_advance_work_raises(tokens: int) -> None:
    cache = make_cache()
    record(cache, "a", 100)
    cache.advance_work(5)
    with pytest.raises(ResidentCacheError, match="backwards"):
        cache.advance_work(tokens)
    # The clock did not move: a is 5 idle, not 5 + tokens (or less).
    assert cache.evict_idle(5, Dropper(cache)) == []
    assert [e.page_id for e in cache.evict_idle(4, Dropper(cache))] == ["a"]


# -- model-based check ---------------------------------------------------------------------


class ModelError(Exception):
    """What the reference model raises where the cache must raise ResidentCacheError."""


class DropFailed(Exception):
    pass


@dataclasses.dataclass
class ModelEntry:
    seq: int
    tokens: int
    nbytes: int
    last_used: int
    #: The work clock at the entry's last use (commit, touch, or an "exists" record).
    used_at_work: int = 0


class ReferenceCache:
    """The design's rules, written plainly: dict + LRU by a logical clock + a LIFO free list."""

    def __init__(self, cfg: ResidentCacheConfig) -> None:
        self.cfg = cfg
        self.limit = min(cfg.reserved_seq_count + cfg.max_entries, LLAMA_MAX_SEQ)
        self.entries: dict[str, ModelEntry] = {}
        self.pending: dict[str, tuple[int, int, int]] = {}
        self.free: list[int] = []
        self.next_id = cfg.reserved_seq_count
        self.clock = 0
        self.work = 0
        self.records = self.evictions = self.uncacheable = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def tokens(self) -> int:
        return sum(e.tokens for e in self.entries.values()) + sum(p[1] for p in self.pending.values())

    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values()) + sum(p[2] for p in self.pending.values())

    def touch(self, page: str) -> tuple[str, int, int] | None:
        e = self.entries.get(page)
        if e is None:
            return None
        e.last_used = self.tick()
        e.used_at_work = self.work
        return (page, e.seq, e.tokens)

    def victim(self, *, freeing_tokens: bool = False) -> str | None:
        """The least recently used entry; with `freeing_tokens` (over the token cap alone) the least
        recently used that holds a token first, as the cache picks: dropping an empty one frees none."""
        order = sorted(self.entries, key=lambda p: self.entries[p].last_used)
        if freeing_tokens:
            order = [p for p in order if self.entries[p].tokens] + [p for p in order if not self.entries[p].tokens]
        return order[0] if order else None

    def evict(self, page: str, fail_on: str | None) -> tuple:
        e = self.entries[page]
        if page == fail_on:
            raise DropFailed
        del self.entries[page]
        self.free.append(e.seq)
        self.evictions += 1
        return (page, e.seq, e.tokens, e.nbytes)

    def allocate(self, page: str, tokens: int, nbytes: int, fail_on: str | None) -> tuple:
        cfg = self.cfg
        if tokens < cfg.min_tokens:
            raise ModelError
        if page in self.entries:
            self.entries[page].last_used = self.tick()
            self.entries[page].used_at_work = self.work
            return (self.entries[page].seq, (), False, "exists")
        if page in self.pending:
            raise ModelError
        if (cfg.max_bytes and nbytes > cfg.max_bytes) or (
            cfg.max_resident_tokens and tokens > cfg.max_resident_tokens
        ):
            self.uncacheable += 1
            return (NO_SEQ, (), False, "uncacheable")
        # What no eviction can free (the pending entries): if the new record
        # does not fit beside it, refuse before evicting anything.
        held = list(self.pending.values())
        if (
            len(held) + 1 > cfg.max_entries
            or (cfg.max_bytes and sum(b for _, _, b in held) + nbytes > cfg.max_bytes)
            or (cfg.max_resident_tokens and sum(t for _, t, _ in held) + tokens > cfg.max_resident_tokens)
        ):
            raise ModelError
        evictions = []
        while True:
            over_entries_or_bytes = len(self.entries) + len(self.pending) + 1 > cfg.max_entries or (
                cfg.max_bytes and self.nbytes() + nbytes > cfg.max_bytes
            )
            if not over_entries_or_bytes and not (
                cfg.max_resident_tokens and self.tokens() + tokens > cfg.max_resident_tokens
            ):
                break
            victim = self.victim(freeing_tokens=not over_entries_or_bytes)
            if victim is None:
                raise ModelError
            evictions.append(self.evict(victim, fail_on))
        if self.free:
            seq = self.free.pop()
        elif self.next_id < self.limit:
            seq, self.next_id = self.next_id, self.next_id + 1
        else:
            raise ModelError
        self.pending[page] = (seq, tokens, nbytes)
        return (seq, tuple(evictions), True, None)

    def commit(self, page: str) -> None:
        self.entries[page] = ModelEntry(
            *self.pending.pop(page), last_used=self.tick(), used_at_work=self.work
        )
        self.records += 1

    def advance_work(self, tokens: int) -> None:
        if tokens < 0:
            raise ModelError
        self.work += tokens

    def idle(self, idle_tokens: int) -> dict[str, int]:
        """The pages `evict_idle(idle_tokens)` must evict, with the work clock at their last use."""
        return {
            p: e.used_at_work
            for p, e in self.entries.items()
            if self.work - e.used_at_work > idle_tokens
        }


PAGES = [f"p{i}" for i in range(10)]
# Mostly at or above every generated min_tokens (0..64); uniform draws start at 0 and
# would spend most records on the below-min error.
record_tokens = st.one_of(st.integers(64, 900), st.integers(64, 900), st.integers(0, 900))
page_names = st.sampled_from(PAGES)
fail_choice = st.one_of(st.none(), page_names)

configs = st.builds(
    ResidentCacheConfig,
    max_entries=st.integers(1, 6),
    max_bytes=st.one_of(st.just(0), st.integers(50, 1500)),
    min_tokens=st.integers(0, 64),
    # Mostly roomy id spaces; a quarter near LLAMA_MAX_SEQ, where ids run out before entries do.
    reserved_seq_count=st.one_of(*[st.integers(0, 10)] * 3, st.integers(245, 255)),
    max_resident_tokens=st.one_of(st.just(0), st.integers(100, 2000)),
)


class ResidentCacheMachine(RuleBasedStateMachine):
    @initialize(cfg=configs)
    def setup(self, cfg: ResidentCacheConfig) -> None:
        self.cache = ResidentPrefixCache(cfg)
        self.model = ReferenceCache(cfg)

    def _both(
        self, model_op: Callable[[], object], cache_op: Callable[[], object]
    ) -> tuple[object, object]:
        """Run one operation on both; they must fail alike, else (model result, cache result)."""
        try:
            expected: object = model_op()
            expected_exc: type | None = None
        except ModelError:
            expected, expected_exc = None, ResidentCacheError
        except DropFailed:
            expected, expected_exc = None, OSError
        if expected_exc is None:
            got = cache_op()
            return expected, got
        with pytest.raises(expected_exc):
            cache_op()
        return None, None

    def _drop(self, fail_on: str | None) -> Dropper:
        return Dropper(self.cache, fail_on=fail_on)

    def _allocate(self, page: str, tokens: int, nbytes: int, fail_on: str | None) -> RecordAllocation | None:
        expected, got = self._both(
            lambda: self.model.allocate(page, tokens, nbytes, fail_on),
            lambda: self.cache.allocate_for_record(P(page), tokens, nbytes, self._drop(fail_on)),
        )
        if got is None:
            return None
        assert isinstance(got, RecordAllocation)
        assert (
            got.seq_id,
            tuple((e.page_id, e.seq_id, e.token_count, e.estimated_bytes) for e in got.evictions),
            got.should_save,
            got.reason,
        ) == expected
        return got

    @rule(
        page=page_names,
        tokens=record_tokens,
        nbytes=st.integers(0, 600),
        fail_on=fail_choice,
        commit=st.booleans(),
    )
    def record_now(self, page: str, tokens: int, nbytes: int, fail_on: str | None, commit: bool) -> None:
        # Not committing leaves the record pending, for `finish_pending` to commit later.
        got = self._allocate(page, tokens, nbytes, fail_on)
        if got is not None and got.should_save and commit:
            self.cache.commit_record(P(page), got.seq_id, tokens, nbytes)
            self.model.commit(page)

    @rule(data=st.data(), fail_on=fail_choice, commit=st.booleans())
    def record_at_a_boundary(self, data: st.DataObject, fail_on: str | None, commit: bool) -> None:
        # Sizes on the edges of the budgets, which uniform draws rarely hit.
        cfg, model = self.model.cfg, self.model
        token_edges = [cfg.min_tokens, max(cfg.min_tokens - 1, 0)]
        if cfg.max_resident_tokens:
            room = cfg.max_resident_tokens - model.tokens()
            token_edges += [cfg.max_resident_tokens, cfg.max_resident_tokens + 1, room, room + 1]
        byte_edges = [0, 1]
        if cfg.max_bytes:
            room = cfg.max_bytes - model.nbytes()
            byte_edges += [cfg.max_bytes, cfg.max_bytes + 1, room, room + 1]
        tokens = data.draw(st.sampled_from([t for t in token_edges if t >= 0]))
        nbytes = data.draw(st.sampled_from([b for b in byte_edges if b >= 0]))
        self.record_now(data.draw(page_names), tokens, nbytes, fail_on, commit)

    @precondition(lambda self: bool(self.model.pending))
    @rule(data=st.data())
    def finish_pending(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(sorted(self.model.pending)))
        seq, tokens, nbytes = self.model.pending[page]
        self.cache.commit_record(P(page), SeqId(seq), tokens, nbytes)
        self.model.commit(page)

    @rule(page=page_names)
    def touch(self, page: str) -> None:
        hit = self.cache.touch(P(page))
        expected = self.model.touch(page)
        assert (None if hit is None else (hit.page_id, hit.seq_id, hit.token_count)) == expected

    @rule(page=page_names)
    def peek(self, page: str) -> None:
        hit = self.cache.peek(P(page))
        e = self.model.entries.get(page)
        expected = None if e is None else (e.seq, e.tokens)
        assert (None if hit is None else (hit.seq_id, hit.token_count)) == expected

    @rule(fail_on=fail_choice)
    def evict_one(self, fail_on: str | None) -> None:
        def model_op() -> tuple | None:
            victim = self.model.victim()
            return None if victim is None else self.model.evict(victim, fail_on)

        expected, got = self._both(model_op, lambda: self.cache.evict_one_lru_entry(self._drop(fail_on)))
        if got is not None:
            assert isinstance(got, ResidentEviction)
            got = (got.page_id, got.seq_id, got.token_count, got.estimated_bytes)
        assert got == expected

    @rule(fail_on=fail_choice)
    def clear(self, fail_on: str | None) -> None:
        def model_op() -> list[tuple]:
            # LRU order; a failing drop stops it there, with what went before already gone.
            evictions = []
            while (victim := self.model.victim()) is not None:
                evictions.append(self.model.evict(victim, fail_on))
            return evictions

        expected, got = self._both(model_op, lambda: self.cache.clear(self._drop(fail_on)))
        if got is not None:
            assert isinstance(got, list)
            assert [(e.page_id, e.seq_id, e.token_count, e.estimated_bytes) for e in got] == expected

    # Mostly real work: hypothesis leans to 0, which ages nothing.
    @rule(tokens=st.one_of(*[st.integers(1, 400)] * 3, st.sampled_from([0, -1, -400])))
    def advance_work(self, tokens: int) -> None:
        self._both(lambda: self.model.advance_work(tokens), lambda: self.cache.advance_work(tokens))

    @rule(data=st.data(), fail_on=fail_choice)
    def evict_idle(self, data: st.DataObject, fail_on: str | None) -> None:
        # Thresholds on either side of some entry's idle count, which uniform draws rarely hit.
        work = self.model.work
        edges = sorted({max(work - e.used_at_work + d, 0) for e in self.model.entries.values() for d in (-1, 0)})
        thresholds = st.integers(0, 600)
        idle_tokens = data.draw(st.one_of(thresholds, st.sampled_from(edges)) if edges else thresholds)
        idle = self.model.idle(idle_tokens)
        drop = self._drop(fail_on)
        try:
            got: list[ResidentEviction] | None = self.cache.evict_idle(idle_tokens, drop)
        except OSError:
            got = None
        dropped = drop.dropped
        # Only idle entries go, oldest use first; the order among equal uses is not specified,
        # so the drops the cache actually made decide it, checked against the rule.
        assert set(dropped) <= idle.keys()
        uses = [idle[p] for p in dropped]
        assert uses == sorted(uses)
        if fail_on in idle:
            assert got is None, "the failing drop must propagate"
            assert fail_on not in dropped
            assert all(use <= idle[fail_on] for use in uses)
            assert {p for p, use in idle.items() if use < idle[fail_on]} <= set(dropped)
        else:
            assert got is not None
            assert set(dropped) == idle.keys()
        expected = [self.model.evict(p, None) for p in dropped]
        if got is not None:
            assert [(e.page_id, e.seq_id, e.token_count, e.estimated_bytes) for e in got] == expected

    @invariant()
    def books_agree(self) -> None:
        if not hasattr(self, "cache"):
            return
        cache, model = self.cache, self.model
        cache.check_invariants()
        # Same pages, ids, sizes, in the same LRU order.
        lru = sorted(model.entries.items(), key=lambda item: item[1].last_used)
        assert [(e.page_id, e.seq_id, e.token_count) for e in cache.entries()] == [
            (p, e.seq, e.tokens) for p, e in lru
        ]
        assert cache.stats() == ResidentCacheStats(
            entries=len(model.entries),
            resident_tokens=model.tokens(),
            resident_cells=model.tokens(),
            estimated_bytes=model.nbytes(),
            max_entries=model.cfg.max_entries,
            max_bytes=model.cfg.max_bytes,
            max_resident_tokens=model.cfg.max_resident_tokens,
            pending=len(model.pending),
            records=model.records,
            evictions=model.evictions,
            uncacheable=model.uncacheable,
        )
        # The budgets, stated independently of both implementations' bookkeeping.
        cfg = model.cfg
        seqs = [e.seq for e in model.entries.values()] + [p[0] for p in model.pending.values()]
        assert len(seqs) == len(set(seqs)) <= cfg.max_entries
        assert all(cfg.reserved_seq_count <= s < min(cache.seq_id_limit, LLAMA_MAX_SEQ) for s in seqs)
        if cfg.max_bytes:
            assert model.nbytes() <= cfg.max_bytes
        if cfg.max_resident_tokens:
            assert model.tokens() <= cfg.max_resident_tokens


def test_the_machine_over_the_token_cap_skips_an_empty_entry_as_the_cache_does() -> None:
    # A case hypothesis found: an entry of 0 tokens frees nothing, so the cap's eviction passes it by.
    machine = ResidentCacheMachine()
    machine.setup(ResidentCacheConfig(max_entries=3, max_bytes=0, min_tokens=0, reserved_seq_count=0,
                                      max_resident_tokens=100))
    for page, tokens in (("p0", 0), ("p2", 100)):
        machine.record_now(page, tokens, 0, None, commit=True)
    machine.record_now("p1", 100, 0, None, commit=False)
    machine.books_agree()
    assert [e.page_id for e in machine.cache.entries()] == ["p0"]


ResidentCacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestResidentCacheMachine = ResidentCacheMachine.TestCase


class IdleEvictionMachine(ResidentCacheMachine):
    """The same model check in a roomy cache, where entries live long enough to go idle.

    Under `configs` budgets evict entries within a few steps, so `evict_idle`
    seldom sees two entries with different last uses.
    """

    @initialize(
        cfg=st.builds(
            ResidentCacheConfig,
            max_entries=st.integers(4, 10),
            max_bytes=st.just(0),
            min_tokens=st.just(0),
            reserved_seq_count=st.integers(0, 10),
            max_resident_tokens=st.just(0),
        )
    )
    def setup(self, cfg: ResidentCacheConfig) -> None:
        self.cache = ResidentPrefixCache(cfg)
        self.model = ReferenceCache(cfg)

    @precondition(lambda self: bool(self.model.entries))
    @rule(data=st.data(), peek=st.booleans())
    def use_an_entry(self, data: st.DataObject, peek: bool) -> None:
        # Reads of what is held (the `touch` and `peek` rules draw from all pages and mostly
        # miss): a touch restarts the entry's idle count, a peek must not; `evict_idle` checks it.
        page = data.draw(st.sampled_from(sorted(self.model.entries)))
        if peek:
            self.peek(page)
        else:
            self.touch(page)


IdleEvictionMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=100, deadline=None)
TestIdleEvictionMachine = IdleEvictionMachine.TestCase


def test_record_that_cannot_fit_beside_pending_entries_evicts_nothing() -> None:
    # Regression: the cache used to evict every committed entry and then raise,
    # emptying itself for a record that could never be placed.
    cache = make_cache(max_entries=8, max_resident_tokens=1000)
    cache.allocate_for_record(P("big"), 800, 0, Dropper(cache))
    record(cache, "small", 100)
    dropper = Dropper(cache)
    with pytest.raises(ResidentCacheError, match="no releasable entries"):
        cache.allocate_for_record(P("new"), 300, 0, dropper)
    assert P("small") in cache
    assert cache.stats().evictions == 0
    cache.check_invariants()
