"""A token radix index: the longest cached prefix of a prompt, at token granularity.

Fixed record lengths only meet when two prompts share a whole grid length: a
system prompt of 600 tokens is reused as 576 of them, and the other 24 are
prefilled again on every request. The index instead keeps the tokens of every
cached entry (resident or in the state store) in one radix tree per *space* (the
identity of everything but the tokens: model, layout, namespace), and answers
"which entry shares the most leading tokens with this prompt". The first L
cells of an entry hold exactly the KV of its first L tokens (attention is
causal), so a lane may reuse any leading part of any entry of the same space.

Invariants, checked by `check_invariants` and the property tests:
- every registered page ends at a node whose path from the root spells its tokens;
- a node's `count` is the number of pages at or below it, and only the root
  may have a count of 0 (empty nodes are pruned on removal);
- an edge is never empty, and siblings never start with the same token;
- edges are maximal: a node other than the root holds a page or branches.
"""

from __future__ import annotations

from collections.abc import Container, Hashable, Sequence
from dataclasses import dataclass, field

from skippy_cache.identity import PageId


@dataclass(eq=False, slots=True)
class _Node:
    edge: tuple[int, ...]
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    #: Pages whose tokens end exactly here.
    pages: set[PageId] = field(default_factory=set)
    #: Pages at or below this node.
    count: int = 0


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    #: Leading tokens of the prompt that `page_id`'s entry also starts with.
    length: int
    page_id: PageId


class PrefixIndex:
    def __init__(self) -> None:
        self._roots: dict[Hashable, _Node] = {}
        #: page -> (space, node where its tokens end, token count).
        self._where: dict[PageId, tuple[Hashable, _Node, int]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, page_id: object) -> bool:
        return page_id in self._where

    def insert(self, space: Hashable, tokens: Sequence[int], page_id: PageId) -> None:
        """Register an entry's tokens. A page is registered once; the empty sequence is refused."""
        if page_id in self._where:
            raise ValueError(f"{page_id!r} is already indexed")
        if not tokens:
            raise ValueError("an entry of no tokens cannot be indexed")
        node = self._roots.setdefault(space, _Node((), None))
        path = [node]
        rest = tuple(tokens)
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                child = _Node(rest, node)
                node.children[rest[0]] = child
                node = child
                path.append(node)
                break
            shared = shared_length(child.edge, rest)
            if shared < len(child.edge):
                child = _split(child, shared)
            node = child
            path.append(node)
            rest = rest[shared:]
        node.pages.add(page_id)
        for n in path:
            n.count += 1
        self._where[page_id] = (space, node, len(tokens))

    def remove(self, page_id: PageId) -> bool:
        """Forget an entry; False if it was not indexed. Emptied nodes are pruned."""
        where = self._where.pop(page_id, None)
        if where is None:
            return False
        space, node, _ = where
        node.pages.discard(page_id)
        survivor: _Node | None = None
        walk: _Node | None = node
        while walk is not None:
            walk.count -= 1
            parent = walk.parent
            if walk.count == 0 and parent is not None:
                del parent.children[walk.edge[0]]
            elif survivor is None:
                survivor = walk
            walk = parent
        root = self._roots[space]
        if root.count == 0:
            del self._roots[space]
        elif survivor is not None:
            _fold_into_only_child(survivor)
        return True

    def token_count(self, page_id: PageId) -> int | None:
        where = self._where.get(page_id)
        return where[2] if where is not None else None

    def longest(
        self,
        space: Hashable,
        tokens: Sequence[int],
        prefer: Container[PageId] = frozenset(),
        min_length: int = 1,
    ) -> PrefixMatch | None:
        """The entry sharing the most leading tokens with `tokens`, and how many.

        None when no entry shares `min_length` tokens (every prompt that opens
        on BOS shares one token with every entry: not worth choosing among).

        Among entries that share the same length, one in `prefer` wins (the
        runtime prefers resident entries, which cost a `seq_cp` rather than a
        restore); otherwise the shortest, which frees the fewest cells on a trim.
        """
        walk = self._walk(space, tokens)
        if walk is None or walk[1] < max(min_length, 1):
            return None
        node, depth, _ = walk
        return PrefixMatch(depth, _pick(node, prefer))

    def matches(self, space: Hashable, tokens: Sequence[int], min_length: int = 1) -> list[PrefixMatch]:
        """Entries sharing at least `min_length` leading tokens with `tokens`, each with how many.

        Those that share the most (every page at or below where the walk
        stops), and those whose tokens are a prefix of `tokens` (pages on the
        way there); entries that branched off earlier are left out. For a
        caller that reuses less than the shared length of some entries
        (deterministic mode, exact.py) and must choose among them.
        """
        walk = self._walk(space, tokens)
        if walk is None:
            return []
        node, depth, path = walk
        found = [PrefixMatch(d, page) for n, d in path for page in n.pages if d >= max(min_length, 1)]
        if depth >= max(min_length, 1):
            stack = [node]
            while stack:
                n = stack.pop()
                found.extend(PrefixMatch(depth, page) for page in n.pages)
                stack.extend(n.children.values())
        return found

    def longest_among(self, space: Hashable, tokens: Sequence[int], among: Container[PageId]) -> PrefixMatch | None:
        """The entry of `among` sharing the most leading tokens with `tokens`, and how many (None: none
        shares a token). Entries that branched off early count too, unlike in `matches`.

        The subtree where the walk stops shares the most; failing a page of
        `among` there, each node passed on the way, deepest first, shares its
        depth with every page at it and in its other branches. Each node is
        visited once at most.
        """
        walk = self._walk(space, tokens)
        if walk is None:
            return None
        node, depth, path = walk
        found = _find(node, among)
        if found is not None:
            return PrefixMatch(depth, found) if depth > 0 else None
        below = node
        for n, d in reversed(path):
            if d == 0:
                return None
            found = next((page for page in n.pages if page in among), None)
            for child in n.children.values():
                if found is None and child is not below:
                    found = _find(child, among)
            if found is not None:
                return PrefixMatch(d, found)
            below = n
        return None

    def _walk(self, space: Hashable, tokens: Sequence[int]) -> tuple[_Node, int, list[tuple[_Node, int]]] | None:
        """Follow `tokens` down the space's tree: the node whose subtree shares the most leading
        tokens, how many, and the nodes passed on the way there (with their depth), which
        `tokens` cover whole. None when the space holds nothing."""
        node = self._roots.get(space)
        if node is None:
            return None
        depth = 0
        path: list[tuple[_Node, int]] = []
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            shared = shared_length(child.edge, tokens[depth:])
            path.append((node, depth))
            if shared < len(child.edge):
                return child, depth + shared, path
            node = child
            depth += shared
        return node, depth, path

    def check_invariants(self) -> None:
        """Raise AssertionError if the tree contradicts itself (tests and debug)."""
        seen: dict[PageId, tuple[Hashable, _Node]] = {}
        for space, root in self._roots.items():
            assert root.edge == () and root.parent is None, "a root has an edge or a parent"
            assert root.count > 0, f"space {space!r} is empty but kept"
            stack = [root]
            while stack:
                node = stack.pop()
                below = len(node.pages) + sum(c.count for c in node.children.values())
                assert node.count == below, f"node count {node.count} != pages at or below {below}"
                if node is not root:
                    assert node.pages or len(node.children) > 1, "a page-less node with one child was not folded"
                for first, child in node.children.items():
                    assert child.edge and child.edge[0] == first, "an edge is empty or filed under another token"
                    assert child.parent is node, "a child's parent link is wrong"
                    assert child.count > 0, "an empty node was not pruned"
                    stack.append(child)
                for page in node.pages:
                    seen[page] = (space, node)
        assert set(seen) == set(self._where), "pages in the tree != pages on the books"
        for page, (space, node, n) in self._where.items():
            assert seen[page] == (space, node), f"{page!r} is booked at another node"
            assert _depth(node) == n, f"{page!r} ends at depth {_depth(node)}, booked with {n} tokens"


def shared_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` have in common."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _split(node: _Node, at: int) -> _Node:
    """Cut `node`'s edge after `at` tokens; returns the new upper half (now `node`'s parent)."""
    parent = node.parent
    assert parent is not None and 0 < at < len(node.edge)
    upper = _Node(node.edge[:at], parent, count=node.count)
    parent.children[upper.edge[0]] = upper
    node.edge = node.edge[at:]
    node.parent = upper
    upper.children[node.edge[0]] = node
    return upper


def _fold_into_only_child(node: _Node) -> None:
    """After a removal, fold a page-less node with one child into that child, so edges stay maximal.

    Only the deepest node that survived a removal can have changed shape (it
    lost a page or a child); the nodes above it kept their children.
    """
    parent = node.parent
    if parent is None or node.pages or len(node.children) != 1:
        return
    (child,) = node.children.values()
    child.edge = node.edge + child.edge
    child.parent = parent
    parent.children[child.edge[0]] = child


def _pick(node: _Node, prefer: Container[PageId]) -> PageId:
    """A page at or below `node`: the shortest preferred one if any, else the shortest of all."""
    best: tuple[int, PageId] | None = None
    best_preferred: tuple[int, PageId] | None = None
    stack = [(node, 0)]
    while stack:
        n, below = stack.pop()
        for page in n.pages:
            key = (below, page)
            if page in prefer:
                best_preferred = key if best_preferred is None else min(best_preferred, key)
            best = key if best is None else min(best, key)
        stack.extend((child, below + len(child.edge)) for child in n.children.values())
    chosen = best_preferred or best
    assert chosen is not None, "a node with a positive count holds no page"
    return chosen[1]


def _find(node: _Node, among: Container[PageId]) -> PageId | None:
    """A page of `among` at or below `node`, None if there is none."""
    stack = [node]
    while stack:
        n = stack.pop()
        for page in n.pages:
            if page in among:
                return page
        stack.extend(n.children.values())
    return None


def _depth(node: _Node) -> int:
    depth = 0
    walk: _Node | None = node
    while walk is not None:
        depth += len(walk.edge)
        walk = walk.parent
    return depth
