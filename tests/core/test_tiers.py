"""CacheTiers.plan: the one decision of a lookup, on plain data (no runtime)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_cache.config import ResidentCacheConfig
from skippy_cache.exact import kernels
from skippy_cache.identity import IdentityKey, PageId, PrefixIdentity, prefix_identity
from skippy_cache.resident import ResidentPrefixCache
from skippy_cache.tiers import CacheTiers, Hit, Query, Source, Why

KEY = IdentityKey(
    model_id="m", model_digest="d", stage_id="s", stage_index=0, layer_start=0, layer_end=30,
    runtime_abi="abi", weight_layout="CPU", type_k="f16", type_v="f16", flash_attn=True, kv_unified=True,
    ctx_size=4096,
)
SPACE = KEY
MIN = 8


class FakeStore:
    """The plan's view of a store, as plain dicts: pages with what is restorable, chunks by name."""

    def __init__(self) -> None:
        #: page -> (tokens restorable now, slowest tier, logits if a whole prompt held in full)
        self.held: dict[PageId, tuple[int, Source, np.ndarray | None]] = {}
        #: page ids of identities whose chunk is present, and whole prompts whose tail is
        self.chunks: dict[PageId, Source] = {}
        self.tails: dict[PageId, Source] = {}
        self.chunk_tokens = 8

    def __contains__(self, page_id: object) -> bool:
        return page_id in self.held

    def available(self, page_id: PageId) -> tuple[int, Source]:
        n, source, _ = self.held.get(page_id, (0, Source.NONE, None))
        return n, source

    def whole_logits(self, page_id: PageId) -> np.ndarray | None:
        return self.held[page_id][2] if page_id in self.held else None

    def probe(self, chunks, whole, tails=()):
        run, source = 0, Source.NONE
        for ident in chunks:
            if ident.page_id not in self.chunks:
                break
            run += 1
            source = Source.DISK if Source.DISK in (source, self.chunks[ident.page_id]) else self.chunks[ident.page_id]
        complete = whole is not None and run == len(chunks) and whole.page_id in self.tails
        if complete:
            source = Source.DISK if Source.DISK in (source, self.tails[whole.page_id]) else self.tails[whole.page_id]
            return run * self.chunk_tokens, source, True
        # A partial chunk goes on from the run when its rows start where the run ends.
        ends = [t.token_count for t in tails
                if t.page_id in self.chunks and t.token_count // self.chunk_tokens == run]
        return max(ends, default=run * self.chunk_tokens), source, False

    def pages(self) -> list[PageId]:
        return list(self.held)

    def discard(self, page_id: PageId) -> bool:
        return self.held.pop(page_id, None) is not None

    def check_invariants(self) -> None:
        pass


def tiers(*, store: bool = True) -> CacheTiers:
    resident = ResidentPrefixCache(
        ResidentCacheConfig(max_entries=8, max_bytes=0, min_tokens=MIN, reserved_seq_count=8, max_resident_tokens=0)
    )
    return CacheTiers(resident, FakeStore() if store else None)


def chunk_ids(tokens: list[int], every: int = 8) -> tuple[PrefixIdentity, ...]:
    return tuple(prefix_identity(SPACE, tokens[:n]) for n in range(every, len(tokens) + 1, every))


def whole_id(tokens: list[int]):
    return prefix_identity(KEY.with_namespace("whole"), tokens)


def make_resident(
    t: CacheTiers, tokens: list[int], *, logits: np.ndarray | None = None, prompt_tokens: int | None = None,
    replies: tuple[tuple[int, int], ...] = (),
) -> PageId:
    """Book a resident whole-prompt entry, as the runtime does after a record; with `prompt_tokens`, a
    deterministic-mode entry whose first `prompt_tokens` tokens were its prompt (the rest its reply),
    which resent earlier `replies`."""
    ident = whole_id(tokens)
    allocation = t.resident.allocate_for_record(ident.page_id, len(tokens), len(tokens), lambda _e: None)
    t.resident.commit_record(ident.page_id, allocation.seq_id, len(tokens), len(tokens))
    t.logits[ident.page_id] = logits if logits is not None else np.arange(4, dtype=np.float32)
    t.file(ident.page_id, SPACE, tokens, None if prompt_tokens is None else kernels(prompt_tokens - 1, replies))
    return ident.page_id


def make_stored(
    t: CacheTiers, tokens: list[int], *, logits: np.ndarray | None = None, available: int | None = None,
    source: Source = Source.RAM,
) -> PageId:
    """A page the store holds (whole prompt), `available` of its tokens restorable now."""
    ident = whole_id(tokens)
    assert isinstance(t.store, FakeStore)
    t.store.held[ident.page_id] = (len(tokens) if available is None else available, source, logits)
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


def test_exact_repeat_of_a_stored_page_carries_its_logits() -> None:
    t = tiers()
    stored = np.array([0.5, -1.0, 3.0], dtype=np.float32)
    page = make_stored(t, A, logits=stored, source=Source.DISK)
    hit = t.plan(query(A))
    assert (hit.source, hit.page_id, hit.length, hit.why) == (Source.DISK, page, len(A), Why.EXACT_REPEAT)
    assert hit.logits is not None and np.array_equal(hit.logits, stored)


def test_a_stored_page_not_held_in_full_is_reused_as_far_as_it_is_held() -> None:
    t = tiers()
    page = make_stored(t, A, logits=np.zeros(2, np.float32), available=24)
    hit = t.plan(query(A))
    assert (hit.source, hit.page_id, hit.length, hit.why, hit.logits) == (Source.RAM, page, 24, Why.DIVERGED, None)
    t.store.held[page] = (MIN - 1, Source.RAM, None)
    assert t.plan(query(A)) == Hit.miss(Why.NEVER_SEEN)


def test_chunks_are_found_by_name_without_any_page() -> None:
    # After a restart: no page, no index entry, only chunks named by prefix identities.
    t = tiers()
    store = t.store
    assert isinstance(store, FakeStore)
    ids = chunk_ids(A[:-1])
    for ident in ids[:3]:
        store.chunks[ident.page_id] = Source.DISK
    hit = t.plan(query(A, chunks=ids))
    assert (hit.source, hit.page_id, hit.length, hit.why) == (Source.DISK, None, 24, Why.DIVERGED)
    # Every chunk and the whole prompt's tail: an exact repeat, its logits read with the tail.
    for ident in ids:
        store.chunks[ident.page_id] = Source.RAM
    store.tails[whole_id(A).page_id] = Source.RAM
    hit = t.plan(query(A, chunks=ids))
    assert (hit.source, hit.page_id, hit.length, hit.why, hit.logits) == (
        Source.RAM, whole_id(A).page_id, len(A), Why.EXACT_REPEAT, None
    )


def test_a_partial_chunk_found_by_name_takes_the_run_to_where_a_reply_ended() -> None:
    # Another process's entry of A[:29] (a reply) left chunks [0, 8), ..., [16, 24) and the
    # partial chunk [24, 29), named by the prefix identity at its end.
    t = tiers()
    store = t.store
    assert isinstance(store, FakeStore)
    ids = chunk_ids(A[:-1])
    for ident in ids[:3]:
        store.chunks[ident.page_id] = Source.RAM
    tail = prefix_identity(SPACE, A[:29])
    store.chunks[tail.page_id] = Source.RAM
    hit = t.plan(query(A, chunks=ids, tails=(tail,)))
    assert (hit.source, hit.page_id, hit.length, hit.why) == (Source.RAM, None, 29, Why.DIVERGED)
    # Its rows start at 24: with chunk [24, 32) missing it still serves; with a chunk past its
    # start held, the run itself goes further and the partial chunk is of no use.
    store.chunks[ids[3].page_id] = Source.RAM
    assert t.plan(query(A, chunks=ids, tails=(tail,))).length == 32
    # Not asked for (a prompt that resends no reply there): the run alone.
    del store.chunks[ids[3].page_id]
    assert t.plan(query(A, chunks=ids)).length == 24


def test_a_longer_page_beats_chunks_found_by_name_and_chunks_beat_a_shorter_one() -> None:
    t = tiers()
    store = t.store
    assert isinstance(store, FakeStore)
    ids = chunk_ids(A[:-1])
    for ident in ids[:2]:
        store.chunks[ident.page_id] = Source.RAM
    page = make_resident(t, A[:30] + [1] * 5)
    assert (t.plan(query(A, chunks=ids)).page_id, t.plan(query(A, chunks=ids)).length) == (page, 30)
    for ident in ids[:4]:
        store.chunks[ident.page_id] = Source.RAM
    assert (t.plan(query(A, chunks=ids)).page_id, t.plan(query(A, chunks=ids)).length) == (None, 32)


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


def test_at_equal_length_a_resident_entry_beats_a_stored_page() -> None:
    t = tiers()
    host_page = make_stored(t, A[:25] + [1] * 10)
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


def exact_query(prompt: list[int], replies: tuple[tuple[int, int], ...] = ()) -> Query:
    return Query(SPACE, prompt[:-1], whole=whole_id(prompt), kernels=kernels(len(prompt) - 1, replies))


SYSTEM = list(range(1000, 1600))  # a 600-token system prompt: 9 whole blocks and 24 tokens


def test_deterministic_mode_reuses_past_the_tiled_end_when_both_prompts_tile_alike() -> None:
    t = tiers(store=False)
    page = make_resident(t, SYSTEM + [1] * 20, prompt_tokens=620)  # tiled end 576
    hit = t.plan(exact_query(SYSTEM + [2] * 30))  # tiled end 576 too
    assert (hit.source, hit.page_id, hit.length, hit.why) == (Source.RESIDENT, page, 600, Why.DIVERGED)


def test_deterministic_mode_stops_at_the_lower_tiled_end() -> None:
    t = tiers(store=False)
    page = make_resident(t, SYSTEM + [1] * 100, prompt_tokens=700)  # tiled end 640
    hit = t.plan(exact_query(SYSTEM + [2] * 30))  # tiled end 576
    assert (hit.page_id, hit.length, hit.why) == (page, 576, Why.GRID)
    # Fast mode (no tiled end in the query) takes all 600.
    assert t.plan(query(SYSTEM + [2] * 30)).length == 600


def test_deterministic_mode_picks_the_entry_that_serves_the_most_exactly() -> None:
    t = tiers(store=False)
    make_resident(t, SYSTEM + [1] * 100, prompt_tokens=700)  # shares 600, serves 576
    alike = make_resident(t, SYSTEM[:590], prompt_tokens=590)  # a prefix of the prompt, tiled end 576: serves 590
    hit = t.plan(exact_query(SYSTEM + [2] * 30))
    assert (hit.page_id, hit.length) == (alike, 590)


def test_deterministic_mode_reuses_a_reply_computed_row_by_row_past_the_same_tiled_end() -> None:
    t = tiers(store=False)
    # A 620-token prompt and a 10-token reply, recorded together when the request ended.
    turn = SYSTEM + [1] * 20 + [4] * 10
    page = make_resident(t, turn, prompt_tokens=620)
    hit = t.plan(exact_query(turn + [5] * 5))  # 635 tokens: tiled end 576 too
    assert (hit.page_id, hit.length, hit.why) == (page, 630, Why.DIVERGED)
    hit = t.plan(exact_query(turn + [5] * 50))  # tiled end 640: the reply's rows would be tiled cold
    assert (hit.page_id, hit.length, hit.why) == (page, 576, Why.GRID)
    # Unless the prompt says where the reply is: its cold run computes those rows one at a time too.
    hit = t.plan(exact_query(turn + [5] * 50, replies=((620, 630),)))
    assert (hit.page_id, hit.length, hit.why) == (page, 630, Why.DIVERGED)
    # The turn after reuses that turn's entry (and its reply) the same way.
    turn2 = turn + [5] * 50 + [6] * 12
    page2 = make_resident(t, turn2, prompt_tokens=680, replies=((620, 630),))
    hit = t.plan(exact_query(turn2 + [7] * 90, replies=((620, 630), (680, 692))))
    assert (hit.page_id, hit.length, hit.why) == (page2, 692, Why.DIVERGED)


def test_deterministic_mode_exact_repeat_and_misses() -> None:
    t = tiers(store=False)
    prompt = SYSTEM + [1] * 20
    page = make_resident(t, prompt, prompt_tokens=620)
    hit = t.plan(exact_query(prompt))
    assert (hit.page_id, hit.length, hit.why) == (page, 620, Why.EXACT_REPEAT)
    # The same tokens with a reply marked in them: other kernels, so a prefix serves, not a repeat.
    hit = t.plan(exact_query(prompt, replies=((100, 150),)))
    assert (hit.page_id, hit.length, hit.why) == (page, 64, Why.GRID)
    # Sharing 40 tokens with an entry that tiled them serves nothing: the prompt would resume mid-block.
    assert t.plan(exact_query(SYSTEM[:40] + [9] * 200)) == Hit.miss(Why.GRID)
    assert t.plan(exact_query([9] * 200)) == Hit.miss(Why.NEVER_SEEN)


def test_plan_changes_nothing() -> None:
    t = tiers()
    first = make_resident(t, A)
    second = make_resident(t, [5] * 40)
    make_stored(t, [6] * 40)
    make_stored(t, [7] * 40)
    before = ([e.page_id for e in t.resident.entries()], t.store.pages(), t.resident.stats())
    for prompt in (A, [5] * 40, [6] * 40, A[:30] + [1] * 9, [9] * 40):
        t.plan(query(prompt))
    after = ([e.page_id for e in t.resident.entries()], t.store.pages(), t.resident.stats())
    assert after == before
    assert before[0] == [first, second]


def test_forget_if_gone_keeps_the_index_rule() -> None:
    t = tiers()
    page = make_resident(t, A)
    t.check_invariants()
    # Demoted: in the store, still indexed; then pushed out of it too: unindexed.
    t.store.held[page] = (len(A), Source.RAM, None)
    t.resident.clear(lambda _e: None)
    t.forget_if_gone(page)
    assert page in t.index and page not in t.logits
    t.check_invariants()
    t.store.discard(page)
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


# -- recurrent and hybrid models: a hit ends where an entry ends (family.py) --------------------


def test_whole_entries_take_the_longest_entry_that_ends_inside_the_prompt() -> None:
    t = tiers(store=False)
    short = make_resident(t, A[:12])
    make_resident(t, A[:20] + [7] * 10)  # shares 20 tokens, but its state is that of its own end
    hit = t.plan(query(A, whole_entries=True))
    assert (hit.source, hit.page_id, hit.length, hit.why) == (Source.RESIDENT, short, 12, Why.CHECKPOINT)
    # Without the rule the longer entry's first 20 cells would be reused: wrong for a recurrent state.
    assert t.plan(query(A)).length == 20


def test_whole_entries_reuse_all_but_the_last_token_when_an_entry_ends_there() -> None:
    t = tiers(store=False)
    make_resident(t, A[:12])
    page = make_resident(t, A[:-1])
    hit = t.plan(query(A, whole_entries=True))
    assert (hit.page_id, hit.length, hit.why) == (page, len(A) - 1, Why.ALL_BUT_LAST)


def test_whole_entries_miss_says_why() -> None:
    t = tiers(store=False)
    make_resident(t, A[:20] + [7] * 10)
    assert t.plan(query(A, whole_entries=True)) == Hit.miss(Why.CHECKPOINT)
    assert t.plan(query(A, whole_entries=True, short_why=Why.WINDOW)) == Hit.miss(Why.WINDOW)
    assert t.plan(query([5] * 30, whole_entries=True)) == Hit.miss(Why.NEVER_SEEN)


@settings(max_examples=200, deadline=None)
@given(
    entries=st.lists(st.lists(st.integers(0, 3), min_size=MIN, max_size=24), min_size=1, max_size=6),
    prompt=st.lists(st.integers(0, 3), min_size=MIN + 1, max_size=30),
)
def test_whole_entries_hit_is_always_an_entry_that_is_a_prefix_of_the_prompt(entries, prompt) -> None:
    t = tiers(store=False)
    pages = {}
    for tokens in entries:
        if whole_id(tokens).page_id not in t.resident:
            pages[make_resident(t, tokens)] = tokens
    hit = t.plan(Query(SPACE, prompt[:-1], whole_entries=True))
    fits = [len(tokens) for tokens in pages.values() if prompt[: len(tokens)] == tokens and len(tokens) < len(prompt)]
    if hit.page_id is None:
        assert not fits
    else:
        tokens = pages[hit.page_id]
        assert hit.length == len(tokens) == max(fits) and prompt[: hit.length] == tokens
