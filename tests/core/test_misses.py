"""The miss book: ghosts of evicted prefixes (with when) and namespaces of recorded ones, bounded."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from skippy_cache.identity import IdentityKey, PageId, prefix_identities
from skippy_cache.misses import MissBook, age_bucket, lengths

KEY = IdentityKey(model_id="m", model_digest="d", stage_id="s", stage_index=0, layer_start=0, layer_end=1,
                  runtime_abi="abi", weight_layout="CPU", type_k="f16", type_v="f16", flash_attn=True,
                  kv_unified=True, ctx_size=4096)


def ids(tokens: list[int], namespace: str | None = None) -> dict[int, PageId]:
    key = KEY.with_namespace(namespace)
    return {n: i.page_id for n, i in prefix_identities(key, tokens, lengths(len(tokens), 64)).items()}


def test_lengths_are_the_grid_and_the_whole() -> None:
    assert lengths(200, 64) == [64, 128, 192, 200]
    assert lengths(128, 64) == [64, 128]
    assert lengths(10, 64) == [10]
    assert lengths(0, 64) == []


def test_age_buckets() -> None:
    assert [age_bucket(s) for s in (0, 59.9, 60, 299, 300, 3599, 3600)] == [
        "<1 min", "<1 min", "<5 min", "<5 min", "<1 h", "<1 h", "older"]


def test_an_evicted_prefix_is_found_from_a_prompt_that_shares_it() -> None:
    book = MissBook()
    stored = list(range(300))
    book.left(ids(stored).values(), now=10.0)
    prompt = stored[:200] + [9999] * 50
    found = book.evicted(ids(prompt), longer_than=0)
    assert found is not None and (found.length, found.at) == (192, 10.0)
    # What the plan found held already covers it: not an eviction.
    assert book.evicted(ids(prompt), longer_than=192) is None
    # Recorded again: no longer a ghost.
    book.held(ids(stored).values())
    assert book.evicted(ids(prompt), longer_than=0) is None


def test_the_same_tokens_under_another_namespace() -> None:
    book = MissBook()
    tokens = list(range(150))
    book.recorded(ids(tokens).values(), ("tenant-a", "salt-a"))
    assert book.other_namespace(ids(tokens), ("tenant-a", "salt-b"), longer_than=0) == (150, True)
    assert book.other_namespace(ids(tokens), ("tenant-a", "salt-a"), longer_than=0) == (0, True)
    assert book.other_namespace(ids(tokens[:100] + [7] * 20), ("tenant-a", "salt-b"), longer_than=0) == (64, True)


def test_another_tenants_tokens_are_told_apart_from_another_salts() -> None:
    book = MissBook()
    tokens = list(range(150))
    book.recorded(ids(tokens).values(), ("tenant-a", "salt-a"))
    assert book.other_namespace(ids(tokens), ("tenant-b", "salt-a"), longer_than=0) == (150, False)
    assert book.other_namespace(ids(tokens), ("tenant-b", "salt-a"), longer_than=150) == (0, True)


@given(st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=200), max_size=30), st.integers(1, 64))
def test_the_books_stay_bounded(prompts: list[list[int]], capacity: int) -> None:
    book = MissBook(capacity)
    for i, tokens in enumerate(prompts):
        book.left(ids(tokens).values(), now=float(i))
        book.recorded(ids(tokens).values(), (str(i % 2), str(i % 3)))
        book.check_invariants()
