"""Eviction books: LRU's order, LRFU's leaves-only rule, frequency and tails, and both policies' invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_cache.eviction import LrfuBooks, LruBooks, Policy, make_books


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lru_evicts_the_least_recently_used_first() -> None:
    books = LruBooks()
    for key in "abc":
        books.add(key, 1)
    books.touch("a")
    assert [books.evict()[0] for _ in range(3)] == ["b", "c", "a"]
    with pytest.raises(KeyError):
        books.evict()


def test_lrfu_evicts_a_prompts_last_chunk_before_its_first() -> None:
    # LRU would take "a" first: the oldest use. Then "b" and "c" stay held and can never be
    # reached, since a lookup stops at the first chunk missing.
    clock = Clock()
    books = LrfuBooks(clock)
    books.add("a", 1)
    books.add("b", 1, parent="a")
    books.add("c", 1, parent="b")
    clock.now = 1
    books.add("x", 1)
    assert [books.evict()[0] for _ in range(3)] == ["c", "b", "a"]


def test_lrfu_keeps_a_chunk_used_twice_past_newer_ones_once_it_has_a_time_scale() -> None:
    clock = Clock()
    books = LrfuBooks(clock)
    books.add("old", 1)
    books.add("hot", 1)
    for t in range(1, 4):
        clock.now = t
        books.touch("hot")
    clock.now = 10
    assert books.evict()[0] == "old"  # teaches the books a time scale: "old" sat unused 10 s
    assert books.time_scale > 0
    clock.now = 11
    books.touch("hot")  # re-ranked with the time scale: a chunk used again stays one scale longer
    clock.now = 11.05
    books.add("new", 1)
    assert books.evict()[0] == "new"


def test_lrfu_lets_a_tail_go_before_a_chunk_a_longer_prompt_can_reuse() -> None:
    clock = Clock()
    books = LrfuBooks(clock)
    books.add("seed", 1)
    clock.now = 10
    books.evict()  # a time scale to rank with
    books.add("tail", 1, tail=True)
    clock.now = 10.01
    books.add("chunk", 1)
    assert books.evict()[0] == "tail"


def test_a_chunk_produced_again_after_its_eviction_keeps_its_uses() -> None:
    clock = Clock()
    books = LrfuBooks(clock)
    books.add("a", 1)
    clock.now = 1
    books.touch("a")
    assert books.evict() == ("a", 1)
    books.add("a", 1)  # back: it counts as used again, and ranks so once the books have a time scale
    assert books._chunks["a"].uses == 3
    books.remove("a")
    books.add("a", 1)  # removed, not evicted: nothing remembered
    assert books._chunks["a"].uses == 1


def test_the_books_remember_a_bounded_number_of_evictions() -> None:
    books = LrfuBooks(Clock())
    for i in range(100):
        books.add(f"k{i}", 1)
        if len(books) > 3:
            books.evict()
    assert len(books._ghosts) <= 4 * 3


def test_one_instant_counts_as_one_use() -> None:
    clock = Clock()
    books = LrfuBooks(clock)
    books.add("a", 1)
    books.touch("a")
    books.touch("a")
    assert books._chunks["a"].uses == 1
    clock.now = 1
    books.touch("a")
    assert books._chunks["a"].uses == 2


def test_removing_a_chunk_in_the_middle_leaves_the_rest_evictable() -> None:
    books = LrfuBooks(Clock())
    books.add("a", 1)
    books.add("b", 1, parent="a")
    books.add("c", 1, parent="b")
    assert books.remove("b") == 1
    books.check_invariants()
    assert sorted(books.evict()[0] for _ in range(2)) == ["a", "c"]
    assert books.remove("zzz") == 0


def test_make_books_knows_both_policies_and_refuses_others() -> None:
    assert isinstance(make_books("lru"), LruBooks)
    assert isinstance(make_books(Policy.LRFU), LrfuBooks)
    with pytest.raises(ValueError):
        make_books("fifo")


KEYS = st.sampled_from([f"k{i}" for i in range(12)])
OPS = st.lists(st.tuples(st.sampled_from(["add", "touch", "remove", "evict", "tick"]), KEYS, KEYS,
                         st.integers(1, 5), st.booleans()), max_size=120)


@settings(max_examples=300, deadline=None)
@given(policy=st.sampled_from(list(Policy)), ops=OPS)
def test_books_stay_consistent_and_evict_only_leaves(policy: Policy, ops: list) -> None:
    clock = Clock()
    books = make_books(policy, clock)
    held: dict[str, int] = {}
    for op, key, parent, size, tail in ops:
        if op == "add":
            books.add(key, size, parent=parent, tail=tail)
            held.setdefault(key, size)
        elif op == "touch":
            books.touch(key)
        elif op == "remove":
            assert books.remove(key) == held.pop(key, 0)
        elif op == "tick":
            clock.now += size
        elif held:
            if isinstance(books, LrfuBooks):
                leaves = {k for k, c in books._chunks.items() if not c.children}
            victim, got = books.evict()
            assert got == held.pop(victim)
            if isinstance(books, LrfuBooks):
                assert victim in leaves, "a chunk other held chunks continue was evicted"
        books.check_invariants()
        assert len(books) == len(held) and books.bytes == sum(held.values())
        assert set(books.keys()) == set(held)
    while held:
        victim, got = books.evict()  # never stuck: a victim is there while anything is held
        assert got == held.pop(victim)
