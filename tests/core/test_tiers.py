"""CacheTiers.plan: the one decision of a lookup, on plain data (no runtime)."""

from __future__ import annotations

import numpy as np
import pytest

from skippy_cache.config import ResidentCacheConfig
from skippy_cache.host import HostEntry, HostTier
from skippy_cache.identity import IdentityKey, PageId, prefix_identity
from skippy_cache.radix import PrefixIndex
from skippy_cache.resident import ResidentPrefixCache
from skippy_cache.tiers import CacheTiers, Hit, Query, Source, Why

KEY = IdentityKey(
    model_id="m", model_digest="d", stage_id="s", stage_index=0, layer_start=0, layer_end=30,
    runtime_abi="abi", type_k="f16", type_v="f16", flash_attn=True, kv_unified=True, ctx_size=4096,
)
SPACE = KEY
MIN = 8


def tiers(*, host: bool = True, index: bool = True) -> CacheTiers:
    resident = ResidentPrefixCache(
        ResidentCacheConfig(max_entries=8, max_bytes=0, min_tokens=MIN, reserved_seq_count=8, max_resident_tokens=0)
    )
    return CacheTiers(resident, HostTier(1 << 20) if host else None, PrefixIndex() if index else None)


def whole_id(tokens: list[int]):
    return prefix_identity(KEY.with_namespace("whole"), tokens)


def make_resident(t: CacheTiers, tokens: list[int], *, logits: np.ndarray | None = None) -> PageId:
    """Book a resident whole-prompt entry, as the runtime does after a record."""
    ident = whole_id(tokens)
    allocation = t.resident.allocate_for_record(ident.page_id, len(tokens), len(tokens), lambda _e: None)
    t.resident.commit_record(ident.page_id, allocation.seq_id, len(tokens), len(tokens))
    t.logits[ident.page_id] = logits if logits is not None else np.arange(4, dtype=np.float32)
    t.file(ident.page_id, SPACE, tokens)
    return ident.page_id


def make_host(t: CacheTiers, tokens: list[int], *, logits: bytes | None = b"\0" * 16) -> PageId:
    ident = whole_id(tokens)
    assert t.host is not None
    t.host.put(ident.page_id, HostEntry(len(tokens), b"state", logits))
    t.file(ident.page_id, SPACE, tokens)
    return ident.page_id


def query(prompt: list[int], **kw: object) -> Query:
    return Query(SPACE, prompt[:-1], whole=whole_id(prompt), **kw)  # type: ignore[arg-type]


A = list(range(100, 140))


@pytest.mark.parametrize("why", [Why.CACHE_DISABLED, Why.LOOKUP_OFF, Why.BELOW_MIN_TOKENS])
def test_a_refused_lookup_is_a_miss_with_its_reason(why: Why) -> None:
    t = tiers()
    make_resident(t, A)
    assert t.plan(Query(SPACE, A[:-1], whole=whole_id(A), refused=why)) == Hit.miss(why)


def test_exact_repeat_of_a_resident_prompt_carries_its_logits() -> None:
    t = tiers()
    logits = np.array([1.0, 2.0], dtype=np.float32)
    page = make_resident(t, A, logits=logits)
    hit = t.plan(query(A))
    assert (hit.source, hit.page_id, hit.length, hit.why, hit.whole) == (
        Source.RESIDENT, page, len(A), Why.EXACT_REPEAT, True
    )
    assert hit.logits is logits


def test_exact_repeat_from_the_host_tier_decodes_its_stored_logits() -> None:
    t = tiers()
    stored = np.array([0.5, -1.0, 3.0], dtype=np.float32)
    page = make_host(t, A, logits=stored.tobytes())
    hit = t.plan(query(A))
    assert (hit.source, hit.page_id, hit.length, hit.why) == (Source.RAM, page, len(A), Why.EXACT_REPEAT)
    assert hit.logits is not None and np.array_equal(hit.logits, stored)


def test_a_diverging_prompt_reuses_exactly_the_shared_prefix() -> None:
    t = tiers()
    page = make_resident(t, A)
    other = A[:30] + [7, 8, 9, 10, 11]
    hit = t.plan(query(other))
    assert (hit.source, hit.page_id, hit.length, hit.why, hit.logits) == (
        Source.RESIDENT, page, 30, Why.DIVERGED, None
    )


def test_a_prompt_inside_a_cached_one_reuses_all_but_its_last_token() -> None:
    t = tiers()
    make_resident(t, A)
    shorter = A[:20]
    hit = t.plan(query(shorter))
    assert (hit.length, hit.why) == (19, Why.ALL_BUT_LAST)


def test_at_equal_length_a_resident_entry_beats_a_host_entry() -> None:
    t = tiers()
    host_page = make_host(t, A[:25] + [1] * 10)
    resident_page = make_resident(t, A[:25] + [2] * 10)
    hit = t.plan(query(A))
    assert (hit.source, hit.page_id, hit.length) == (Source.RESIDENT, resident_page, 25)
    t.resident.clear(lambda _e: None)
    t.forget_if_gone(resident_page)
    hit = t.plan(query(A))
    assert (hit.source, hit.page_id, hit.length) == (Source.RAM, host_page, 25)


def test_less_than_min_tokens_shared_is_never_seen() -> None:
    t = tiers()
    make_resident(t, A)
    assert t.plan(query(A[: MIN - 1] + [1] * 20)) == Hit.miss(Why.NEVER_SEEN)
    assert t.plan(Query(KEY.with_namespace("tenant-b"), A[:-1], whole=None)) == Hit.miss(Why.NEVER_SEEN)


def test_grid_mode_takes_the_longest_resident_grid_length() -> None:
    t = tiers(host=False, index=False)
    ids = {n: prefix_identity(SPACE, A[:n]) for n in (32, 16, 8)}
    for n in (16, 8):
        allocation = t.resident.allocate_for_record(ids[n].page_id, n, n, lambda _e: None)
        t.resident.commit_record(ids[n].page_id, allocation.seq_id, n, n)
    grid = tuple(ids[n] for n in (32, 16, 8))
    hit = t.plan(Query(SPACE, A[:-1], grid=grid))
    assert (hit.source, hit.page_id, hit.length, hit.why) == (Source.RESIDENT, ids[16].page_id, 16, Why.GRID)
    assert t.plan(Query(SPACE, A[:-1], grid=grid[:1])) == Hit.miss(Why.NEVER_SEEN)


def test_plan_changes_nothing() -> None:
    t = tiers()
    first = make_resident(t, A)
    second = make_resident(t, [5] * 40)
    make_host(t, [6] * 40)
    make_host(t, [7] * 40)
    before = ([e.page_id for e in t.resident.entries()], t.host.pages(), t.resident.stats(), t.host.stats())
    for prompt in (A, [5] * 40, [6] * 40, A[:30] + [1] * 9, [9] * 40):
        t.plan(query(prompt))
    after = ([e.page_id for e in t.resident.entries()], t.host.pages(), t.resident.stats(), t.host.stats())
    assert after == before
    assert before[0] == [first, second]


def test_forget_if_gone_keeps_the_index_rule() -> None:
    t = tiers()
    page = make_resident(t, A)
    t.check_invariants()
    # Demoted: in the host tier, still indexed; then pushed out of it too: unindexed.
    t.host.put(page, HostEntry(len(A), b"x", b"\0" * 16))
    t.resident.clear(lambda _e: None)
    t.forget_if_gone(page)
    assert page in t.index and page not in t.logits
    t.check_invariants()
    t.host.discard(page)
    t.forget_if_gone(page)
    assert page not in t.index
    t.check_invariants()


def test_check_invariants_catches_a_page_left_in_the_index() -> None:
    t = tiers()
    page = make_resident(t, A)
    t.resident.clear(lambda _e: None)  # the books let it go, the index was not told
    t.logits.pop(page)
    with pytest.raises(AssertionError, match="evicted page stayed in the index"):
        t.check_invariants()
