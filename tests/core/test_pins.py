"""Pinned resident entries: never chosen while an unpinned entry can go, bounded by a token cap, oldest released
first, and one owner's (tenant's) pins never released for another's."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_cache.config import ResidentCacheConfig
from skippy_cache.identity import PageId
from skippy_cache.resident import ResidentEviction, ResidentPrefixCache


def make(max_pinned_tokens: int = 300, max_entries: int = 4) -> ResidentPrefixCache:
    config = ResidentCacheConfig(max_entries=max_entries, max_bytes=0, min_tokens=1, reserved_seq_count=2,
                                 max_resident_tokens=0)
    return ResidentPrefixCache(config, max_pinned_tokens=max_pinned_tokens)


def drop(_eviction: ResidentEviction) -> None:
    pass


def record(cache: ResidentPrefixCache, page: str, tokens: int) -> list[str]:
    allocation = cache.allocate_for_record(PageId(page), tokens, 0, drop)
    if allocation.should_save:
        cache.commit_record(PageId(page), allocation.seq_id, tokens, 0)
    return [e.page_id for e in allocation.evictions]


def test_lru_and_idleness_pass_over_a_pin() -> None:
    cache = make()
    record(cache, "a", 100)
    cache.pin(PageId("a"))
    for page in "bcd":
        record(cache, page, 100)
    assert record(cache, "e", 100) == ["b"]  # "a" is older, but pinned
    cache.advance_work(1000)
    assert [e.page_id for e in cache.evict_idle(10, drop)] == ["c", "d", "e"]
    assert PageId("a") in cache
    cache.check_invariants()


def test_the_cap_releases_the_oldest_pin_and_refuses_an_entry_alone_over_it() -> None:
    cache = make(max_pinned_tokens=250)
    for page in "abc":
        record(cache, page, 100)
    assert cache.pin(PageId("a")) == [] and cache.pin(PageId("b")) == []
    assert cache.pin(PageId("c")) == ["a"]
    assert (cache.pinned(PageId("a")), cache.pinned(PageId("b")), cache.pinned(PageId("c"))) == (False, True, True)
    record(cache, "big", 300)
    assert cache.pin(PageId("big")) == [] and not cache.pinned(PageId("big"))
    assert cache.stats().pinned_tokens == 200
    cache.check_invariants()


def test_a_pin_never_fails_a_request() -> None:
    # Only pinned entries left: a record's budget and a decode's cells still take them.
    cache = make(max_pinned_tokens=1000, max_entries=2)
    for page in "ab":
        record(cache, page, 100)
        cache.pin(PageId(page))
    assert record(cache, "c", 100) == ["a"]
    cache.pin(PageId("c"))
    assert cache.evict_one_lru_entry(drop) is None
    evicted = cache.evict_one_lru_entry(drop, pinned_too=True)
    assert evicted is not None and evicted.page_id == "b"
    assert cache.stats().pinned == 1
    cache.check_invariants()


def test_one_tenants_pins_never_release_anothers() -> None:
    cache = make(max_pinned_tokens=300, max_entries=6)
    cache.max_owner_pinned_tokens = 200
    for page in "abcde":
        record(cache, page, 100)
    assert cache.pin(PageId("a"), "A") == [] and cache.pin(PageId("b"), "A") == []
    # A third pin of A's is past A's share: A's own oldest goes.
    assert cache.pin(PageId("c"), "A") == ["a"]
    assert cache.pin(PageId("d"), "B") == []
    # The budget is full (b, c of A's; d of B's): B's next pin releases B's own, never A's.
    assert cache.pin(PageId("e"), "B") == ["d"]
    assert [cache.pinned(PageId(p)) for p in "abcde"] == [False, True, True, False, True]
    cache.check_invariants()


def test_a_pin_that_fits_only_by_releasing_anothers_is_not_taken() -> None:
    cache = make(max_pinned_tokens=300, max_entries=6)
    cache.max_owner_pinned_tokens = 300
    for page in "abcd":
        record(cache, page, 100)
    for page in "abc":
        cache.pin(PageId(page), "A")
    assert cache.pin(PageId("d"), "B") == [] and not cache.pinned(PageId("d"))
    assert all(cache.pinned(PageId(p)) for p in "abc")
    cache.check_invariants()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["A", "B", None]), st.integers(1, 150)),
                max_size=40))
def test_pins_are_released_only_for_their_owner(ops: list[tuple[int, str | None, int]]) -> None:
    cache = make(max_pinned_tokens=300, max_entries=6)
    cache.max_owner_pinned_tokens = 200
    for n, owner, tokens in ops:
        page = PageId(f"p{n}")
        if page not in cache:
            record(cache, page, tokens)
        pinned_before = {p.page_id: cache.pin_owner(p.page_id) for p in cache.entries() if cache.pinned(p.page_id)}
        released = cache.pin(page, owner)
        assert all(pinned_before[p] == owner for p in released)
        cache.check_invariants()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["record", "pin", "unpin", "evict", "idle", "touch"]),
                          st.integers(0, 7), st.integers(1, 200)), max_size=60))
def test_pins_keep_the_books(ops: list[tuple[str, int, int]]) -> None:
    cache = make(max_pinned_tokens=300, max_entries=5)
    for op, n, tokens in ops:
        page = PageId(f"p{n}")
        if op == "record":
            unpinned_before = {p.page_id for p in cache.entries() if not cache.pinned(p.page_id)}
            pinned_before = {p.page_id for p in cache.entries() if cache.pinned(p.page_id)}
            evicted = set(record(cache, page, tokens))
            # A pinned entry goes only once no unpinned one is left to go.
            if evicted & pinned_before:
                assert unpinned_before <= evicted
        elif op == "pin":
            cache.pin(page)
        elif op == "unpin":
            cache.unpin(page)
        elif op == "evict":
            eviction = cache.evict_one_lru_entry(drop)
            assert eviction is None or not cache.pinned(eviction.page_id)
        elif op == "idle":
            cache.advance_work(tokens)
            pinned = {p.page_id for p in cache.entries() if cache.pinned(p.page_id)}
            assert not {e.page_id for e in cache.evict_idle(50, drop)} & pinned
        else:
            cache.touch(page)
        cache.check_invariants()
