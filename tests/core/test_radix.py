"""PrefixIndex: exact shared lengths, spaces, preference and tie-breaks, pruning, and a model check."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from skippy_cache.identity import PageId
from skippy_cache.radix import PrefixIndex, PrefixMatch


def P(name: str) -> PageId:
    return PageId(name)


def M(length: int, page: str) -> PrefixMatch:
    return PrefixMatch(length, P(page))


def make_index(*entries: tuple[str, Sequence[int]], space: Hashable = "s") -> PrefixIndex:
    index = PrefixIndex()
    for page, tokens in entries:
        index.insert(space, tokens, P(page))
    index.check_invariants()
    return index


def shared(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def node_count(index: PrefixIndex) -> int:
    """Nodes of every space's tree, roots included (white-box: the merge tests count them)."""
    stack = list(index._roots.values())
    n = 0
    while stack:
        node = stack.pop()
        n += 1
        stack.extend(node.children.values())
    return n


def assert_compact(index: PrefixIndex) -> None:
    """Edges are maximal: no node but a root is page-less with a single child (white-box)."""
    for root in index._roots.values():
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            assert node.pages or len(node.children) != 1, f"node {node.edge} should have been folded"
            stack.extend(node.children.values())


# -- shared length -------------------------------------------------------------------------


def test_query_diverging_mid_edge() -> None:
    index = make_index(("a", [1, 2, 3, 4, 5, 6]))
    assert index.longest("s", [1, 2, 3, 9, 9]) == M(3, "a")
    assert index.longest("s", [1, 9]) == M(1, "a")
    assert index.longest("s", [9, 1, 2]) is None


def test_query_diverging_mid_edge_below_a_split() -> None:
    # Root -> (1, 2) -> {(3, 4, 5, 6): a, (7, 8, 9): b}
    index = make_index(("a", [1, 2, 3, 4, 5, 6]), ("b", [1, 2, 7, 8, 9]))
    assert index.longest("s", [1, 2, 3, 4, 0]) == M(4, "a")
    assert index.longest("s", [1, 2, 7, 8, 0, 0]) == M(4, "b")
    assert index.longest("s", [1, 2, 7, 0]) == M(3, "b")


def test_query_diverging_at_an_edge_end() -> None:
    # The split node (1, 2) holds no page: the match is both entries' first two tokens.
    index = make_index(("a", [1, 2, 3, 4]), ("b", [1, 2, 5, 6, 7]))
    match = index.longest("s", [1, 2, 9, 9])
    assert match is not None and match.length == 2 and match.page_id in {P("a"), P("b")}
    # Past a page-holding node into no child: the entry that ends there, whole.
    index.insert("s", [1, 2], P("c"))
    assert index.longest("s", [1, 2, 9, 9]) == M(2, "c")
    # Exactly at the end of a leaf edge, then on.
    assert index.longest("s", [1, 2, 3, 4, 0, 0]) == M(4, "a")


def test_query_is_a_strict_prefix_of_an_entry() -> None:
    index = make_index(("a", [1, 2, 3, 4, 5]))
    for n in range(1, 5):
        assert index.longest("s", [1, 2, 3, 4, 5][:n]) == M(n, "a")
    index = make_index(("a", [1, 2, 3, 4, 5]), ("b", [1, 2, 3, 7]))
    assert index.longest("s", [1, 2, 3, 4]) == M(4, "a")
    assert index.longest("s", [1, 2, 3, 7]) == M(4, "b")


def test_entry_is_a_strict_prefix_of_the_query() -> None:
    index = make_index(("a", [1, 2, 3]))
    assert index.longest("s", [1, 2, 3, 4, 5, 6]) == M(3, "a")
    assert index.longest("s", [1, 2, 3]) == M(3, "a")
    # An entry inside another's path: each is the answer for the queries that reach it.
    index = make_index(("long", [1, 2, 3, 4, 5, 6]), ("short", [1, 2, 3]))
    assert index.longest("s", [1, 2, 3, 4, 5, 6, 7]) == M(6, "long")
    assert index.longest("s", [1, 2, 3, 9]) == M(3, "short")
    assert index.longest("s", [1, 2, 3, 4, 9]) == M(4, "long")


def test_matches_are_the_longest_sharers_and_the_entries_on_the_way() -> None:
    index = make_index(("short", [1, 2]), ("mid", [1, 2, 3, 4]), ("a", [1, 2, 3, 4, 5, 6]),
                       ("b", [1, 2, 3, 4, 5, 7, 7]), ("off", [1, 2, 8]))
    found = {(m.length, str(m.page_id)) for m in index.matches("s", [1, 2, 3, 4, 5, 9])}
    # "off" branched off before the deepest shared node and is not a prefix of the query.
    assert found == {(2, "short"), (4, "mid"), (5, "a"), (5, "b")}
    assert {str(m.page_id) for m in index.matches("s", [1, 2, 3, 4, 5, 9], min_length=3)} == {"mid", "a", "b"}
    assert index.matches("other", [1, 2]) == []


def test_longest_among_finds_entries_that_branched_off_early() -> None:
    index = make_index(("long", [1, 2, 3, 4, 5, 6]), ("short", [1, 2, 3, 9]), ("other", [7, 8]))
    query = [1, 2, 3, 4, 5, 6, 0]
    assert index.matches("s", query) == [M(6, "long")]
    assert index.longest_among("s", query, {P("short"), P("other")}) == M(3, "short")
    assert index.longest_among("s", query, {P("long"), P("short")}) == M(6, "long")
    assert index.longest_among("s", query, {P("other")}) is None
    assert index.longest_among("s", [1, 2], {P("short")}) == M(2, "short")
    assert index.longest_among("elsewhere", query, {P("short")}) is None


def test_empty_query_and_empty_index() -> None:
    assert PrefixIndex().longest("s", [1, 2, 3]) is None
    index = make_index(("a", [1, 2, 3]))
    assert index.longest("s", []) is None
    assert index.longest("s", (), min_length=0) is None


def test_tuple_and_list_tokens_are_the_same() -> None:
    index = PrefixIndex()
    index.insert("s", (1, 2, 3), P("a"))
    assert index.longest("s", [1, 2, 3]) == M(3, "a")
    assert index.longest("s", (1, 2, 9)) == M(2, "a")


# -- spaces --------------------------------------------------------------------------------


def test_spaces_never_see_each_others_entries() -> None:
    index = PrefixIndex()
    index.insert(("model", 1), [1, 2, 3, 4], P("a"))
    index.insert(("model", 2), [1, 2, 3, 4, 5, 6], P("b"))
    index.insert("other", [1, 2], P("c"))
    index.check_invariants()
    assert index.longest(("model", 1), [1, 2, 3, 4, 5, 6]) == M(4, "a")
    assert index.longest(("model", 2), [1, 2, 3, 4, 5, 6]) == M(6, "b")
    assert index.longest("other", [1, 2, 3, 4, 5, 6]) == M(2, "c")
    assert index.longest(("model", 3), [1, 2, 3]) is None
    # Emptying one space leaves the others alone.
    assert index.remove(P("b"))
    index.check_invariants()
    assert index.longest(("model", 2), [1, 2, 3, 4, 5, 6]) is None
    assert index.longest(("model", 1), [1, 2, 3, 4, 5, 6]) == M(4, "a")
    # And the emptied space works again.
    index.insert(("model", 2), [1, 2], P("b"))
    assert index.longest(("model", 2), [1, 2, 3]) == M(2, "b")
    index.check_invariants()


def test_same_tokens_in_two_spaces() -> None:
    index = PrefixIndex()
    index.insert("x", [5, 5, 5], P("a"))
    index.insert("y", [5, 5, 5], P("b"))
    assert index.longest("x", [5, 5, 5]) == M(3, "a")
    assert index.longest("y", [5, 5, 5]) == M(3, "b")
    assert index.remove(P("a"))
    assert index.longest("x", [5, 5, 5]) is None
    assert index.longest("y", [5, 5, 5]) == M(3, "b")
    index.check_invariants()


# -- prefer and the fallback ---------------------------------------------------------------


def test_prefer_picks_the_preferred_page_among_ties() -> None:
    # All four share exactly [1, 2] with the query.
    index = make_index(("a", [1, 2]), ("b", [1, 2, 3]), ("c", [1, 2, 3, 4]), ("d", [1, 2, 5, 5, 5]))
    query = [1, 2, 9]
    for page in "abcd":
        assert index.longest("s", query, prefer={P(page)}) == M(2, page)
    assert index.longest("s", query, prefer=[P("c"), P("d")]) in {M(2, "c"), M(2, "d")}
    # Nothing preferred: the shortest.
    assert index.longest("s", query) == M(2, "a")
    assert index.longest("s", query, prefer={P("zzz")}) == M(2, "a")


def test_prefer_does_not_beat_a_longer_match() -> None:
    index = make_index(("short", [1, 2]), ("long", [1, 2, 3, 4]))
    assert index.longest("s", [1, 2, 3, 4], prefer={P("short")}) == M(4, "long")
    assert index.longest("s", [1, 2, 3], prefer={P("short")}) == M(3, "long")


def test_prefer_at_a_mid_edge_divergence() -> None:
    index = make_index(("a", [1, 2, 3, 4, 5]), ("b", [1, 2, 3, 4, 6, 7]), ("c", [1, 2, 3, 4, 6, 8]))
    assert index.longest("s", [1, 2, 3, 0], prefer={P("c")}) == M(3, "c")
    assert index.longest("s", [1, 2, 3, 0]) == M(3, "a")
    assert index.longest("s", [1, 2, 3, 4, 6, 0], prefer={P("a")}) in {M(5, "b"), M(5, "c")}


def test_prefer_picks_the_shortest_preferred_page() -> None:
    index = make_index(("a", [1, 2]), ("b", [1, 2, 3, 4, 5]), ("c", [1, 2, 6, 7]), ("d", [1, 2, 3]))
    assert index.longest("s", [1, 2, 9], prefer={P("b"), P("c")}) == M(2, "c")
    assert index.longest("s", [1, 2, 9], prefer={P("b"), P("c"), P("d")}) == M(2, "d")
    assert index.longest("s", [1, 2, 3, 9], prefer={P("b"), P("d")}) == M(3, "d")


def test_fallback_is_the_shortest_entry_at_the_same_depth() -> None:
    index = make_index(("long", [1, 2, 3, 4, 5, 6]), ("short", [1, 2, 7]))
    assert index.longest("s", [1, 2, 0]) == M(2, "short")
    index = make_index(("short", [1, 2, 7]), ("long", [1, 2, 3, 4, 5, 6]))
    assert index.longest("s", [1, 2, 0]) == M(2, "short")


def test_fallback_is_the_shortest_entry_not_the_fewest_nodes_down() -> None:
    # Root -> (0,) -> {(1, 1, 1, 1): long, (2,) -> {(3,): b, (4,): c}}
    # "long" ends one node below the match point but 4 tokens past it; b and c end two
    # nodes below but only 2 tokens past it. The docstring promises the shortest.
    index = make_index(("long", [0, 1, 1, 1, 1]), ("b", [0, 2, 3]), ("c", [0, 2, 4]))
    match = index.longest("s", [0, 9])
    assert match is not None and match.length == 1
    assert index.token_count(match.page_id) == 3, f"picked {match.page_id!r}, not one of the shortest (b, c)"


# -- min_length ----------------------------------------------------------------------------


def test_min_length() -> None:
    index = make_index(("a", [1, 2, 3, 4]))
    assert index.longest("s", [1, 2, 3, 9], min_length=3) == M(3, "a")
    assert index.longest("s", [1, 2, 3, 9], min_length=4) is None
    assert index.longest("s", [1, 2, 3, 4, 5], min_length=4) == M(4, "a")
    assert index.longest("s", [1, 2, 3, 4, 5], min_length=5) is None
    # The default is one shared token; zero or less does not turn a miss into a hit.
    assert index.longest("s", [1]) == M(1, "a")
    assert index.longest("s", [9]) is None
    assert index.longest("s", [9], min_length=0) is None
    assert index.longest("s", [9], min_length=-3) is None
    assert index.longest("s", [1], min_length=0) == M(1, "a")


# -- removal -------------------------------------------------------------------------------


def test_removing_a_middle_entry_merges_the_split_back() -> None:
    index = make_index(("a", [1, 2, 3, 4, 5, 6]))
    alone = node_count(index)
    index.insert("s", [1, 2, 3], P("mid"))  # splits a's edge at 3
    index.check_invariants()
    assert node_count(index) == alone + 1
    assert index.longest("s", [1, 2, 3, 0]) == M(3, "mid")
    assert index.remove(P("mid"))
    index.check_invariants()
    assert_compact(index)
    assert node_count(index) == alone
    assert P("mid") not in index and len(index) == 1
    assert index.longest("s", [1, 2, 3, 0]) == M(3, "a")
    assert index.longest("s", [1, 2, 3, 4, 5, 6, 7]) == M(6, "a")
    assert index.longest("s", [1, 2, 3, 4, 0]) == M(4, "a")


def test_removing_a_branch_merges_its_parent_into_the_other_branch() -> None:
    index = make_index(("a", [1, 2, 3, 4]))
    alone = node_count(index)
    index.insert("s", [1, 2, 7, 8], P("b"))  # split node (1, 2) with two children
    assert node_count(index) == alone + 2
    assert index.remove(P("b"))
    index.check_invariants()
    assert_compact(index)
    assert node_count(index) == alone
    assert index.longest("s", [1, 2, 7, 8]) == M(2, "a")
    assert index.longest("s", [1, 2, 3, 4]) == M(4, "a")
    # Remove the first of two instead: the survivor keeps working the same.
    index = make_index(("a", [1, 2, 3, 4]), ("b", [1, 2, 7, 8]))
    assert index.remove(P("a"))
    index.check_invariants()
    assert_compact(index)
    assert node_count(index) == alone
    assert index.longest("s", [1, 2, 3, 4]) == M(2, "b")
    assert index.longest("s", [1, 2, 7, 8, 9]) == M(4, "b")


def test_removing_a_page_that_shares_its_node() -> None:
    index = make_index(("a", [1, 2, 3]), ("b", [1, 2, 3]), ("c", [1, 2, 3, 4]))
    nodes = node_count(index)
    assert index.remove(P("a"))
    index.check_invariants()
    assert node_count(index) == nodes  # b still ends there
    assert index.longest("s", [1, 2, 3]) == M(3, "b")
    assert index.remove(P("b"))
    index.check_invariants()
    assert_compact(index)
    assert node_count(index) == nodes - 1
    assert index.longest("s", [1, 2, 3]) == M(3, "c")


def test_removing_a_deep_leaf_folds_only_its_parent() -> None:
    # (1,) -> {(2,) -> {(3,): a, (4,): b}, (5,): c}
    index = make_index(("a", [1, 2, 3]), ("b", [1, 2, 4]), ("c", [1, 5]))
    assert index.remove(P("a"))
    index.check_invariants()
    assert_compact(index)
    assert index.longest("s", [1, 2, 4]) == M(3, "b")
    assert index.longest("s", [1, 2, 3]) == M(2, "b")
    assert index.longest("s", [1, 5]) == M(2, "c")


def test_remove_everything_empties_the_index() -> None:
    entries = [("a", [1, 2, 3]), ("b", [1, 2]), ("c", [1, 2, 3, 4]), ("d", [2]), ("e", [1, 3])]
    index = make_index(*entries)
    for page, _ in entries:
        assert index.remove(P(page))
        index.check_invariants()
        assert_compact(index)
    assert len(index) == 0
    assert node_count(index) == 0  # the space's root went too
    assert index.longest("s", [1, 2, 3, 4]) is None


def test_remove_unknown_page_returns_false() -> None:
    index = make_index(("a", [1, 2]))
    assert not index.remove(P("zzz"))
    assert index.remove(P("a"))
    assert not index.remove(P("a"))  # twice
    assert len(index) == 0
    index.check_invariants()


# -- insert errors, bookkeeping ------------------------------------------------------------


def test_duplicate_insert_raises_and_changes_nothing() -> None:
    index = make_index(("a", [1, 2, 3]))
    nodes = node_count(index)
    with pytest.raises(ValueError, match="already indexed"):
        index.insert("s", [1, 2, 3], P("a"))
    with pytest.raises(ValueError, match="already indexed"):
        index.insert("s", [1, 9], P("a"))  # other tokens, same page
    with pytest.raises(ValueError, match="already indexed"):
        index.insert("other", [1, 2, 3], P("a"))  # other space, same page
    index.check_invariants()
    assert node_count(index) == nodes
    assert len(index) == 1 and index.token_count(P("a")) == 3
    assert index.longest("s", [1, 9]) == M(1, "a")


@pytest.mark.parametrize("empty", [[], ()], ids=["list", "tuple"])
def test_empty_tokens_raise(empty: Sequence[int]) -> None:
    index = PrefixIndex()
    with pytest.raises(ValueError, match="no tokens"):
        index.insert("s", empty, P("a"))
    assert len(index) == 0 and P("a") not in index
    assert node_count(index) == 0
    index.check_invariants()


def test_token_count_len_and_contains() -> None:
    index = make_index(("a", [1, 2, 3]), ("b", [1]), ("c", [4, 4, 4, 4, 4]))
    assert [index.token_count(P(p)) for p in "abc"] == [3, 1, 5]
    assert index.token_count(P("zzz")) is None
    assert len(index) == 3
    assert P("a") in index and P("zzz") not in index
    index.remove(P("a"))
    assert index.token_count(P("a")) is None
    assert len(index) == 2 and P("a") not in index


def test_check_invariants_notices_a_corrupt_tree() -> None:
    index = make_index(("a", [1, 2, 3]), ("b", [1, 2, 4]))
    root = index._roots["s"]
    (split,) = root.children.values()
    split.count += 1
    with pytest.raises(AssertionError):
        index.check_invariants()
    split.count -= 1
    index.check_invariants()
    index._where[P("b")] = ("s", split, 2)
    with pytest.raises(AssertionError):
        index.check_invariants()


# -- model-based check ---------------------------------------------------------------------


# Mostly one space, so that its tree grows deep enough to split, fold and tie.
spaces = st.sampled_from(["s", "s", "s", ("model", 2), 7])
PAGES = [f"p{i}" for i in range(12)]

# A small alphabet and short tails: entries extend, split and share each other's prefixes.
tokens_small = st.one_of(
    st.lists(st.integers(0, 3), min_size=0, max_size=2), st.lists(st.integers(0, 3), min_size=0, max_size=6)
)


class PrefixIndexMachine(RuleBasedStateMachine):
    """Against a plain dict page -> (space, tokens); max common prefix by brute force."""

    #: Also hold the fallback to the documented "shortest entry" rule (see the subclass).
    check_shortest = False

    @initialize(data=st.data(), seeds=st.integers(0, 8))
    def setup(self, data: st.DataObject, seeds: int) -> None:
        self.index = PrefixIndex()
        self.model: dict[str, tuple[Hashable, tuple[int, ...]]] = {}
        # Start from a few entries, so that few runs are spent querying an empty index.
        for page in PAGES[:seeds]:
            self.insert(data, data.draw(spaces, label="seed space"), page)

    def _tokens_from(self, data: st.DataObject, space: Hashable) -> tuple[int, ...]:
        """Mostly a prefix of an entry of `space` (or any entry), then a few small tokens."""
        same = [t for s, t in self.model.values() if s == space]
        others = [t for _, t in self.model.values()]
        pool = same or others
        if pool and data.draw(st.integers(0, 4), label="base?") > 0:
            base = data.draw(st.sampled_from(pool), label="base")
            cut = data.draw(st.integers(0, len(base)), label="cut")
            return base[:cut] + tuple(data.draw(tokens_small, label="tail"))
        return tuple(data.draw(tokens_small, label="fresh"))

    @rule(data=st.data(), space=spaces, page=st.sampled_from(PAGES))
    def insert(self, data: st.DataObject, space: Hashable, page: str) -> None:
        tokens = self._tokens_from(data, space)
        if page in self.model or not tokens:
            with pytest.raises(ValueError):
                self.index.insert(space, list(tokens), P(page))
            return
        self.index.insert(space, list(tokens), P(page))
        self.model[page] = (space, tokens)

    @rule(page=st.sampled_from(PAGES))
    def remove(self, page: str) -> None:
        assert self.index.remove(P(page)) == (page in self.model)
        self.model.pop(page, None)

    @rule(
        data=st.data(),
        space=spaces,
        prefer=st.frozensets(st.sampled_from(PAGES)),
        min_length=st.integers(-1, 5),
    )
    def query(self, data: st.DataObject, space: Hashable, prefer: frozenset[str], min_length: int) -> None:
        query = self._tokens_from(data, space)
        lengths = {page: shared(tokens, query) for page, (s, tokens) in self.model.items() if s == space}
        best = max(lengths.values(), default=0)
        match = self.index.longest(space, query, prefer={P(p) for p in prefer}, min_length=min_length)
        # `matches`: the entries that share the most, and the entries that are a prefix of the query.
        expected = {
            (n, page) for page, n in lengths.items()
            if n >= max(min_length, 1) and (n == best or n == len(self.model[page][1]))
        }
        found = [(m.length, str(m.page_id)) for m in self.index.matches(space, query, min_length=min_length)]
        assert sorted(found) == sorted(expected)
        # `longest_among`: the most any entry of `prefer` shares, branched off early or not.
        among = {p: n for p, n in lengths.items() if p in prefer and n > 0}
        held = self.index.longest_among(space, query, {P(p) for p in prefer})
        if not among:
            assert held is None, f"no entry of {sorted(prefer)} shares a token, got {held}"
        else:
            assert held is not None and held.length == max(among.values())
            assert among.get(str(held.page_id)) == held.length
        if best < max(min_length, 1):
            assert match is None, f"expected no match (best {best}), got {match}"
            return
        assert match is not None, f"expected length {best}, got no match"
        assert match.length == best
        page = str(match.page_id)
        assert page in lengths, f"{page!r} is not an entry of {space!r}"
        assert lengths[page] == best, f"{page!r} shares {lengths[page]} tokens, not {best}"
        tied = {p for p, n in lengths.items() if n == best}
        if tied & prefer:
            assert page in prefer, f"{page!r} returned while preferred {sorted(tied & prefer)} tie"
        if self.check_shortest:
            candidates = (tied & prefer) or tied
            shortest = min(len(self.model[p][1]) for p in candidates)
            assert len(self.model[page][1]) == shortest, (
                f"{page!r} has {len(self.model[page][1])} tokens; a candidate has {shortest}"
            )

    @invariant()
    def consistent(self) -> None:
        self.index.check_invariants()
        assert_compact(self.index)
        assert len(self.index) == len(self.model)
        for page in PAGES:
            expected = len(self.model[page][1]) if page in self.model else None
            assert self.index.token_count(P(page)) == expected
            assert (P(page) in self.index) == (page in self.model)


PrefixIndexMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
TestPrefixIndexMachine = PrefixIndexMachine.TestCase


class ShortestFallbackMachine(PrefixIndexMachine):
    """The same, and the answer is a shortest tied preferred entry, or if none, a shortest tied entry."""

    check_shortest = True


ShortestFallbackMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
TestShortestFallbackMachine = ShortestFallbackMachine.TestCase
