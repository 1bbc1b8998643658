"""Eviction books: LRU's order, LRFU's leaves-only rule, frequency and tails, and both policies' invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_cache.eviction import LrfuBooks, LruBooks, Policy, _Shadow, make_books


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


def test_a_new_bonus_reorders_leaves_already_ranked() -> None:
    clock = Clock()
    books = LrfuBooks(clock)
    books.add("seed", 1)
    clock.now = 10
    books.evict()  # a time scale of 0.1 s
    books.add("hot", 1)
    clock.now = 10.01
    books.touch("hot")  # used twice, last at 10.01
    clock.now = 10.05
    books.add("new", 1)
    books.bonus = 0.0
    assert books.evict()[0] == "hot"  # LRU's order: no touch needed to re-rank
    books.add("hot", 1)
    clock.now = 10.06
    books.add("newer", 1)
    books.bonus = 1.0
    assert books.evict()[0] == "new"


def _tier(books: LrfuBooks, clock: Clock, capacity: int, uses: list[tuple[float, str]]) -> int:
    """Drive the books as a tier of `capacity` one-byte chunks does; the uses it finds held."""
    served = 0
    for when, key in uses:
        clock.now = when
        if key in books:
            served += 1
            books.touch(key)
        else:
            while books.bytes + 1 > capacity:
                books.evict()
            books.add(key, 1)
        books.check_invariants()
    return served


def test_the_bonus_grows_when_chunks_used_again_return_after_more_than_a_turnover() -> None:
    # Four chunks come back every 25 s; one new chunk a second fills a tier of ten, so a chunk
    # unused for about 10 s goes. One turnover of bonus keeps a returning chunk ~20 s: too short.
    uses = []
    for t in range(3000):
        uses.append((float(t), f"once{t}"))
        if t % 25 < 4:
            uses.append((t + 0.5, f"hot{t % 25}"))
    clock = Clock()
    books = LrfuBooks(clock)
    served = _tier(books, clock, 10, uses)
    assert books.bonus >= 2.0
    fixed = LrfuBooks(clock := Clock(), bonuses=(1.0,))
    assert served > _tier(fixed, clock, 10, uses) + 100


def test_the_bonus_falls_to_lru_when_chunks_used_twice_never_return() -> None:
    # Each chunk is used twice at once and never again; chunks used once come back after 12 s.
    # Any bonus keeps the dead ones in place of those about to return.
    uses = []
    for t in range(3000):
        uses += [(float(t), f"pair{t}"), (t + 0.1, f"pair{t}"), (t + 0.2, f"back{t}")]
        if t >= 12:
            uses.append((t + 0.3, f"back{t - 12}"))
    clock = Clock()
    books = LrfuBooks(clock)
    served = _tier(books, clock, 40, uses)
    assert books.bonus == 0.0
    fixed = LrfuBooks(clock := Clock(), bonuses=(1.0,))
    assert served > _tier(fixed, clock, 40, uses) + 100


def test_a_shadow_counts_a_use_it_would_have_served_once_and_only_behind_its_prompt() -> None:
    clock = Clock()
    shadow = _Shadow(clock, 1.0)
    shadow.see("a", 1, None, False, capacity=2)
    shadow.see("b", 1, "a", False, capacity=2)
    assert shadow.served == 0
    clock.now = 1
    shadow.see("a", 1, None, False, capacity=2)
    shadow.see("a", 1, None, False, capacity=2)  # the same request writing what it read: one use
    assert shadow.served == 1
    clock.now = 2
    shadow.see("x", 1, None, False, capacity=2)  # full: "b", the only leaf, goes
    shadow.see("y", 1, None, False, capacity=2)  # then "a", a leaf now
    assert "a" not in shadow and "b" not in shadow
    shadow.see("b", 1, "a", False, capacity=2)  # "b" again, "a" still gone
    clock.now = 3
    shadow.see("b", 1, "a", False, capacity=2)  # held, but a lookup would stop at "a"
    assert "b" in shadow and shadow.served == 1


def test_one_bonus_is_fixed_and_none_is_refused() -> None:
    books = LrfuBooks(Clock(), bonuses=(2.0,))
    for i in range(50):
        books.add(f"k{i}", 1)
        if len(books) > 5:
            books.evict()
    assert books.bonus == 2.0
    with pytest.raises(ValueError):
        LrfuBooks(Clock(), bonuses=())
