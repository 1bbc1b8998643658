"""The store's books per tenant (no model: whole states are opaque bytes): a tenant's pages are
counted, cleared and held to its share without touching another tenant's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from skippy_cache.chunkstore import ChunkStore
from skippy_cache.identity import IdentityKey, prefix_identity
from skippy_cache.runtime.statestore import EntryMeta, StateStore

SPACE = IdentityKey(model_id="m", model_digest="d", stage_id="s", stage_index=0, layer_start=0, layer_end=1,
                    runtime_abi="abi", weight_layout="CPU_Mapped", type_k="f16", type_v="f16", flash_attn=False,
                    kv_unified=True, ctx_size=4096)
PAGE_BYTES = 1000


@pytest.fixture
def store() -> Iterator[StateStore]:
    store = StateStore(ChunkStore(1 << 20, None, secret=bytes(32)), "opaque-test-state", 64,
                       max_pending_bytes=1 << 20)
    yield store
    store.close()


def put(store: StateStore, owner: str | None, n: int) -> str:
    """A page of `owner`'s: tokens [n] * 8, state PAGE_BYTES bytes; its page id."""
    tokens = [n] * 8
    page_id = prefix_identity(SPACE, tokens).page_id
    assert store.put(page_id, EntryMeta(SPACE, tokens, owner, 0), bytes([n % 256]) * PAGE_BYTES, None)
    return page_id


def test_pages_are_counted_and_cleared_by_owner(store: StateStore) -> None:
    alice = [put(store, "alice", n) for n in range(3)]
    bob = put(store, "bob", 10)
    anonymous = put(store, None, 20)
    assert store.drain(30)
    assert store.owners() == {"alice": 3, "bob": 1, None: 1}
    assert sorted(store.clear_owner("alice")) == sorted(alice)
    assert store.owners() == {"bob": 1, None: 1}
    assert bob in store and anonymous in store
    assert all(store.available(page)[0] == 0 for page in alice), "their chunks went with them"
    assert store.available(bob)[0] == 8


def test_a_tenant_past_its_share_loses_its_own_oldest_pages_first(store: StateStore) -> None:
    store.owner_share_bytes = 3 * PAGE_BYTES
    bob = put(store, "bob", 100)
    alice = [put(store, "alice", n) for n in range(5)]
    assert store.drain(30)
    assert store.owners() == {"alice": 3, "bob": 1}
    assert [page in store for page in alice] == [False, False, True, True, True]
    assert bob in store
    # The engine's books hear of the pages that went at the next prune.
    assert set(store.prune()) == set(alice[:2])
    assert store.prune() == []


def test_without_tenants_there_is_no_share(store: StateStore) -> None:
    store.owner_share_bytes = PAGE_BYTES
    pages = [put(store, None, n) for n in range(4)]
    assert store.drain(30)
    assert all(page in store for page in pages)


def test_only_a_whole_prompts_tail_is_marked_for_the_eviction_policy() -> None:
    # A whole prompt's tail (with its logits) serves only an exact repeat: LRFU lets it go sooner.
    # An entry without logits (one that ends a reply) names its tail like a chunk, and the next
    # turn of its chat finds it: not a tail for the policy.
    store = StateStore(ChunkStore(1 << 20, None, policy="lrfu", secret=bytes(32)), "opaque-test-state", 64,
                       max_pending_bytes=1 << 20)
    try:
        for n, logits in ((1, b"\0" * 8), (2, None)):
            tokens = [n] * 8
            page_id = prefix_identity(SPACE, tokens).page_id
            assert store.put(page_id, EntryMeta(SPACE, tokens, None, 0), b"x" * PAGE_BYTES, logits)
        assert store.drain(30)
        books = store.chunks._ram_books._chunks  # type: ignore[attr-defined]
        assert sorted(chunk.tail for chunk in books.values()) == [False, True]
    finally:
        store.close()
