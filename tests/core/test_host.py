"""HostTier: LRU eviction under a byte budget, counters, and a model check against a plain list."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from skippy_cache.host import HostEntry, HostTier, HostTierStats
from skippy_cache.identity import PageId


def P(name: str) -> PageId:
    return PageId(name)


def entry(nbytes: int, logits: int | None = None, tokens: int = 100) -> HostEntry:
    return HostEntry(tokens, b"\x01" * nbytes, None if logits is None else b"\x02" * logits)


def pages(tier: HostTier) -> list[str]:
    """Held pages, least recently used first."""
    return list(tier.pages())


# -- entries ---------------------------------------------------------------------------------


def test_entry_nbytes_counts_payload_and_logits() -> None:
    assert entry(30).nbytes == 30
    assert entry(30, logits=8).nbytes == 38
    assert entry(30, logits=0).nbytes == 30
    assert HostEntry(5, bytearray(12)).nbytes == 12


def test_logits_bytes_count_toward_the_budget() -> None:
    tier = HostTier(100)
    assert tier.put(P("a"), entry(60, logits=20)) == []
    assert tier.stats().bytes == 80
    # 80 + 20 fits exactly; one more logits byte would not.
    assert tier.put(P("b"), entry(10, logits=10)) == []
    assert tier.stats().bytes == 100
    assert tier.put(P("c"), entry(0, logits=1)) == ["a"]
    assert tier.stats().bytes == 21
    # Payload alone fits the whole tier, payload plus logits does not: rejected.
    assert tier.put(P("d"), entry(100, logits=1)) == []
    assert tier.stats().rejected == 1
    assert pages(tier) == ["b", "c"]
    tier.check_invariants()


@pytest.mark.parametrize("max_bytes", [0, -1, -1000])
def test_constructor_rejects_non_positive_budget(max_bytes: int) -> None:
    with pytest.raises(ValueError, match="positive byte budget"):
        HostTier(max_bytes)


# -- put / eviction ----------------------------------------------------------------------------


def test_put_evicts_least_recently_used_first() -> None:
    tier = HostTier(100)
    assert tier.put(P("a"), entry(40)) == []
    assert tier.put(P("b"), entry(40)) == []
    assert tier.get(P("a")) is not None  # a becomes the most recent
    assert tier.put(P("c"), entry(40)) == ["b"]
    assert pages(tier) == ["a", "c"]
    assert P("b") not in tier and P("a") in tier
    # One put may need several evictions, oldest first.
    assert tier.put(P("d"), entry(100)) == ["a", "c"]
    assert pages(tier) == ["d"]
    assert tier.stats() == HostTierStats(
        entries=1, bytes=100, max_bytes=100, puts=4, evictions=3, rejected=0
    )
    tier.check_invariants()


def test_put_alone_over_budget_is_rejected_and_evicts_nothing() -> None:
    tier = HostTier(100)
    tier.put(P("a"), entry(50))
    tier.put(P("b"), entry(50))
    before = tier.stats()
    assert tier.put(P("huge"), entry(101)) == []
    assert P("huge") not in tier
    assert pages(tier) == ["a", "b"]
    stats = tier.stats()
    assert stats.rejected == 1
    assert (stats.entries, stats.bytes, stats.puts, stats.evictions) == (
        before.entries,
        before.bytes,
        before.puts,
        before.evictions,
    )
    # Exactly the budget is not "over": it is stored, pushing everything else out.
    assert tier.put(P("full"), entry(100)) == ["a", "b"]
    assert tier.stats().rejected == 1


def test_rejected_put_of_a_held_page_keeps_the_old_entry() -> None:
    # The page id names one exact state, so the entry already held is still good.
    tier = HostTier(100)
    old = entry(40)
    tier.put(P("a"), old)
    tier.put(P("b"), entry(40))
    assert tier.put(P("a"), entry(200)) == []
    assert tier.peek(P("a")) is old
    assert pages(tier) == ["a", "b"]  # not even touched
    assert (tier.stats().bytes, tier.stats().rejected) == (80, 1)


def test_re_put_of_the_same_page_replaces_it_without_double_counting() -> None:
    tier = HostTier(100)
    tier.put(P("a"), entry(60))
    new = entry(70, logits=5)
    # 60 + 75 would be over the budget if the old entry were still counted.
    assert tier.put(P("a"), new) == []
    assert tier.peek(P("a")) is new
    assert len(tier) == 1
    stats = tier.stats()
    assert (stats.bytes, stats.puts, stats.evictions) == (75, 2, 0)
    tier.check_invariants()


def test_re_put_moves_the_page_to_most_recent_and_may_evict_others() -> None:
    tier = HostTier(100)
    for page in "abc":
        tier.put(P(page), entry(30))
    # a's old 30 bytes are freed first: 60 held + 50 is over, so b (now the oldest) goes.
    assert tier.put(P("a"), entry(50)) == ["b"]
    assert pages(tier) == ["c", "a"]
    stats = tier.stats()
    assert (stats.bytes, stats.evictions) == (80, 1)


# -- reads ----------------------------------------------------------------------------------


def test_get_refreshes_and_counts_nothing() -> None:
    # Hits are counted once, by the runtime's cache path, not per tier probe.
    tier = HostTier(1000)
    a = entry(10)
    tier.put(P("a"), a)
    tier.put(P("b"), entry(10))
    before = tier.stats()
    assert tier.get(P("a")) is a
    assert tier.get(P("zzz")) is None
    assert pages(tier) == ["b", "a"]
    assert tier.stats() == before


def test_touch_and_peek_count_nothing() -> None:
    tier = HostTier(1000)
    a = entry(10)
    tier.put(P("a"), a)
    tier.put(P("b"), entry(10))
    before = tier.stats()
    assert tier.peek(P("a")) is a
    assert pages(tier) == ["a", "b"]  # peek leaves recency alone
    assert tier.peek(P("zzz")) is None
    assert tier.touch(P("a")) is True
    assert pages(tier) == ["b", "a"]  # touch refreshes
    assert tier.touch(P("zzz")) is False
    assert tier.stats() == before


def test_touch_protects_from_the_next_eviction() -> None:
    tier = HostTier(100)
    tier.put(P("a"), entry(50))
    tier.put(P("b"), entry(50))
    tier.touch(P("a"))
    assert tier.put(P("c"), entry(50)) == ["b"]


# -- discard / clear --------------------------------------------------------------------------


def test_discard_frees_bytes_without_counting_an_eviction() -> None:
    tier = HostTier(100)
    tier.put(P("a"), entry(40, logits=10))
    tier.put(P("b"), entry(30))
    assert tier.discard(P("a")) is True
    assert tier.discard(P("a")) is False
    assert tier.discard(P("zzz")) is False
    assert pages(tier) == ["b"]
    stats = tier.stats()
    assert (stats.entries, stats.bytes, stats.evictions) == (1, 30, 0)
    # The freed room is really free: 70 more fits without evicting b.
    assert tier.put(P("c"), entry(70)) == []
    tier.check_invariants()


def test_clear_forgets_everything_and_keeps_counters() -> None:
    tier = HostTier(100)
    tier.put(P("a"), entry(40))
    tier.put(P("b"), entry(40))
    tier.get(P("a"))
    tier.get(P("x"))
    assert tier.clear() == 2
    assert pages(tier) == [] and len(tier) == 0
    assert tier.stats() == HostTierStats(
        entries=0, bytes=0, max_bytes=100, puts=2, evictions=0, rejected=0
    )
    assert tier.clear() == 0
    assert tier.put(P("c"), entry(100)) == []  # the whole budget is back
    tier.check_invariants()


def test_check_invariants_catches_broken_books() -> None:
    tier = HostTier(100)
    tier.put(P("a"), entry(40))
    tier._bytes += 1
    with pytest.raises(AssertionError, match="byte books"):
        tier.check_invariants()


# -- model-based check ---------------------------------------------------------------------


class ReferenceHostTier:
    """The rules written plainly: a list of (page, entry), least recently used first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.order: list[tuple[str, HostEntry]] = []
        self.puts = self.evictions = self.rejected = 0

    @staticmethod
    def size(e: HostEntry) -> int:
        return len(e.payload) + len(e.logits or b"")

    def nbytes(self) -> int:
        return sum(self.size(e) for _, e in self.order)

    def find(self, page: str) -> int | None:
        return next((i for i, (p, _) in enumerate(self.order) if p == page), None)

    def get(self, page: str) -> HostEntry | None:
        i = self.find(page)
        if i is None:
            return None
        self.order.append(self.order.pop(i))
        return self.order[-1][1]

    def touch(self, page: str) -> bool:
        i = self.find(page)
        if i is None:
            return False
        self.order.append(self.order.pop(i))
        return True

    def discard(self, page: str) -> bool:
        i = self.find(page)
        if i is None:
            return False
        del self.order[i]
        return True

    def put(self, page: str, e: HostEntry) -> list[str]:
        if self.size(e) > self.max_bytes:
            self.rejected += 1
            return []
        self.discard(page)
        evicted = []
        while self.nbytes() + self.size(e) > self.max_bytes:
            evicted.append(self.order.pop(0)[0])
            self.evictions += 1
        self.order.append((page, e))
        self.puts += 1
        return evicted

    def clear(self) -> int:
        n = len(self.order)
        self.order = []
        return n


HOST_PAGES = [f"h{i}" for i in range(6)]
host_pages = st.sampled_from(HOST_PAGES)
host_entries = st.builds(
    HostEntry,
    token_count=st.integers(1, 4096),
    payload=st.one_of(st.binary(max_size=120), st.binary(max_size=120).map(bytearray)),
    logits=st.one_of(st.none(), st.binary(max_size=40)),
)


class HostTierMachine(RuleBasedStateMachine):
    @initialize(max_bytes=st.one_of(st.integers(1, 60), st.integers(60, 400)))
    def setup(self, max_bytes: int) -> None:
        self.tier = HostTier(max_bytes)
        self.model = ReferenceHostTier(max_bytes)

    @rule(page=host_pages, e=host_entries)
    def put(self, page: str, e: HostEntry) -> None:
        assert self.tier.put(P(page), e) == self.model.put(page, e)

    @rule(page=host_pages)
    def get(self, page: str) -> None:
        assert self.tier.get(P(page)) is self.model.get(page)

    @rule(page=host_pages)
    def peek(self, page: str) -> None:
        i = self.model.find(page)
        assert self.tier.peek(P(page)) is (None if i is None else self.model.order[i][1])

    @rule(page=host_pages)
    def touch(self, page: str) -> None:
        assert self.tier.touch(P(page)) == self.model.touch(page)

    @rule(page=host_pages)
    def discard(self, page: str) -> None:
        assert self.tier.discard(P(page)) == self.model.discard(page)

    @rule()
    def clear(self) -> None:
        assert self.tier.clear() == self.model.clear()

    @invariant()
    def books_agree(self) -> None:
        if not hasattr(self, "tier"):
            return
        tier, model = self.tier, self.model
        tier.check_invariants()
        # Same pages and entries, in the same LRU order (so the same eviction order next).
        assert pages(tier) == [p for p, _ in model.order]
        assert [tier.peek(P(p)) for p, _ in model.order] == [e for _, e in model.order]
        assert len(tier) == len(model.order)
        assert all(P(p) in tier for p, _ in model.order)
        assert not any(P(p) in tier for p in set(HOST_PAGES) - {p for p, _ in model.order})
        assert tier.stats() == HostTierStats(
            entries=len(model.order),
            bytes=model.nbytes(),
            max_bytes=model.max_bytes,
            puts=model.puts,
            evictions=model.evictions,
            rejected=model.rejected,
        )
        # The budget, stated independently of both implementations' bookkeeping.
        assert model.nbytes() <= model.max_bytes


HostTierMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestHostTierMachine = HostTierMachine.TestCase
