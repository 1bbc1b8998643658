"""The state store on the real model: entries leave the pool as chunks in RAM and on disk, and come back exact."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from exactmode import assert_as_cold, assert_bit_exact
from fastmode import assert_logits_close
from prompts import make_tokens

from skippy_cache.chunks import chunk_key
from skippy_cache.config import CacheConfig, CacheMode
from skippy_cache.identity import prefix_identity
from skippy_cache.runtime import CacheDirBusy, Engine, EngineConfig
from skippy_cache.runtime.gguf_info import default_model_path
from skippy_cache.runtime.native import Batch, ContextParams, NativeContext, NativeModel
from skippy_cache.runtime.requests import FinishReason, GenerationRequest
from skippy_cache.runtime.statestore import EntryMeta
from skippy_cache.stateformat import join, parse, split

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

IDLE = 64
CHUNK = 128


def config(cache_dir: Path | None, **overrides: object) -> EngineConfig:
    base = dict(ctx_size=4096, lanes=4, idle_tokens=IDLE, host_cache_bytes=256 << 20, cache_dir=cache_dir,
                disk_reserve_bytes=0, chunk_tokens=CHUNK, deterministic=False, check_invariants=True)
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    engine = Engine(config(tmp_path_factory.mktemp("store")))
    yield engine
    engine.close()


@pytest.fixture
def warm_exact() -> Iterator[Engine]:
    """Deterministic mode with the store: entries it demotes come back bit for bit."""
    engine = Engine(config(None, deterministic=True))
    yield engine
    engine.close()


@pytest.fixture
def cold_exact() -> Iterator[Engine]:
    """Deterministic mode with the cache off: the reference for cache-on output."""
    off = CacheConfig(mode=CacheMode.DISABLED)
    engine = Engine(config(None, deterministic=True, cache=off))
    yield engine
    engine.close()


def run(engine: Engine, tokens: list[int], max_tokens: int = 1):
    # One token: the lane's sequence is then the prompt alone, and each prompt
    # records exactly one entry (a longer reply would record a second one).
    return engine.generate(GenerationRequest(tokens=tokens, max_tokens=max_tokens, keep_first_logits=True))


def settle(engine: Engine) -> None:
    """Wait for the store's writer, so what a test checks next is on RAM and disk."""
    assert engine.cache.store is not None and engine.cache.store.drain(60)


def persist(engine: Engine) -> None:
    """Wait until the idle engine has exported every reused entry, and the writer has stored them."""
    deadline = time.monotonic() + 60
    while engine.call(lambda: engine.cache.persist_left):
        assert time.monotonic() < deadline, "the idle engine never exported its reused entries"
        time.sleep(0.05)
    settle(engine)


def resident_pages(engine: Engine) -> set[str]:
    return engine.call(lambda: {e.page_id for e in engine.cache.tiers.resident.entries()})


def chunk_files(root: Path) -> list[Path]:
    return sorted((root / "v1" / "chunks").rglob("*.chunk"))


def idle_out(engine: Engine, seed: int) -> None:
    """Other work, past IDLE decoded tokens: every entry recorded before it leaves the pool."""
    run(engine, make_tokens(engine, 200, seed=seed))
    settle(engine)


def demote_unpinned(engine: Engine) -> None:
    """Every entry but the pinned ones leaves the pool for the store, as a decode that needs cells would make it."""

    def demote() -> None:
        resident = engine.cache.tiers.resident
        while resident.stats().entries > resident.stats().pinned:
            assert engine.cache.evict_one()

    engine.call(demote)
    settle(engine)


def test_a_state_cut_into_chunks_and_joined_imports_bit_exact() -> None:
    # Export, split, join, import into an empty pool on one thread: the last
    # token's logits must equal those decoded on the original cells bit for bit.
    model = NativeModel(default_model_path(), use_extra_bufts=False)  # plain weights: safe on every CPU
    ctx = NativeContext(model, ContextParams(n_ctx=1024, n_batch=512, n_seq_max=4, n_threads=1))
    try:
        tokens = model.tokenize("The river keeps the garden green " * 80)[:301]
        assert len(tokens) == 301
        batch = Batch(512)
        batch.add(0, tokens[:-1], 0, False)
        assert ctx.decode(batch) == 0
        payload = ctx.state_seq_get(0)
        batch.clear()
        batch.add(0, tokens[-1:], 300, True)
        assert ctx.decode(batch) == 0
        original = ctx.logits(0).copy()
        ctx.seq_rm(0)
        state = parse(payload)
        assert state.n_tokens == 300
        for size in (64, 128, 256):
            joined = join(state.layout, split(state, size), 300)
            assert joined == bytes(payload)
            assert ctx.state_seq_set(0, joined) and ctx.seq_pos_max(0) == 299
            batch.clear()
            batch.add(0, tokens[-1:], 300, True)
            assert ctx.decode(batch) == 0
            assert np.array_equal(ctx.logits(0), original), f"chunks of {size}: logits moved"
            ctx.seq_rm(0)
    finally:
        ctx.close()
        model.close()


def test_an_idle_entry_leaves_as_chunks_and_an_exact_repeat_needs_no_decode(engine: Engine) -> None:
    engine.clear_cache()
    prompt = make_tokens(engine, 300, seed=41)
    cold = run(engine, prompt)
    assert resident_pages(engine), "the cold run recorded nothing"
    idle_out(engine, 42)
    before = engine.stats().cache
    assert before.counters.idle_evictions >= 1 and before.store is not None and before.store.pages >= 1
    # 300 tokens in chunks of 128: two chunks and a tail of 44.
    assert before.store.chunks.ram_chunks >= 3
    warm = run(engine, prompt)
    after = engine.stats().cache
    assert warm.stats.cached_tokens == len(prompt)
    assert after.counters.restores == before.counters.restores + 1
    assert after.counters.restore_tokens == before.counters.restore_tokens + len(prompt)
    # The first token comes from the logits stored with the tail: bit for bit.
    assert np.array_equal(warm.first_logits, cold.first_logits)
    assert warm.tokens[0] == cold.tokens[0]
    again = run(engine, prompt)
    assert again.stats.cached_tokens == len(prompt)
    assert engine.stats().cache.counters.restores == after.counters.restores, "restored once, then resident"
    assert engine.invariant_failures == []


def test_a_partial_hit_reads_only_the_chunks_it_needs(engine: Engine) -> None:
    engine.clear_cache()
    first = make_tokens(engine, 600, seed=43)
    second = first[:280] + make_tokens(engine, 40, seed=44)
    run(engine, first)
    recorded = resident_pages(engine)
    idle_out(engine, 45)
    assert recorded and not recorded & resident_pages(engine), "the first prompt is still resident"
    hits_before = engine.stats().cache.store.chunks
    done = run(engine, second)
    assert done.stats.cached_tokens == 280
    chunks = engine.stats().cache.store.chunks
    # 280 of 600 tokens: chunks [0, 128), [128, 256), [256, 384); never the ones past it.
    assert (chunks.ram_hits + chunks.disk_hits) - (hits_before.ram_hits + hits_before.disk_hits) == 3
    assert done.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert engine.invariant_failures == []


def test_prompts_that_share_a_prefix_share_its_chunks(engine: Engine) -> None:
    engine.clear_cache()
    system = make_tokens(engine, 600, seed=50)
    for i in range(3):
        run(engine, system + make_tokens(engine, 20, seed=51 + i))
    idle_out(engine, 55)
    store = engine.stats().cache.store
    assert store is not None and store.pages >= 3
    # Each entry has four chunks of the system prompt and its own tail: the four are held once.
    assert store.chunks.duplicates >= 8
    assert store.chunks.dedup_ratio > 1.5


def test_the_disk_tier_survives_a_restart(tmp_path: Path) -> None:
    first = Engine(config(tmp_path))
    try:
        prompt = make_tokens(first, 500, seed=60)
        cold = run(first, prompt)
        # A resident hit marks the entry as worth keeping; the idle engine exports it.
        assert run(first, prompt).stats.cached_tokens == len(prompt)
        persist(first)
        assert first.stats().cache.store.pages >= 1
    finally:
        first.close()
    files = chunk_files(tmp_path)
    assert len(files) >= 4, files  # 500 tokens: three chunks of 128 and a tail
    second = Engine(config(tmp_path))
    try:
        store = second.stats().cache.store
        assert store is not None and store.chunks.disk is not None
        assert store.chunks.disk.found_at_start == len(files)
        again = run(second, prompt)
        counters = second.stats().cache.counters
        assert again.stats.cached_tokens == len(prompt)
        assert counters.restores == 1 and counters.disk_restores == 1
        assert np.array_equal(again.first_logits, cold.first_logits)
        assert second.invariant_failures == []
    finally:
        second.close()


def test_a_second_engine_on_the_same_cache_dir_is_refused(tmp_path: Path) -> None:
    engine = Engine(config(tmp_path))
    try:
        with pytest.raises(CacheDirBusy, match=str(tmp_path)):
            Engine(config(tmp_path))
    finally:
        engine.close()


def first_chunk_key(engine: Engine, tokens: list[int]) -> str:
    """The name of the chunk holding tokens [0, CHUNK) of `tokens`."""
    store = engine.cache.store
    assert store is not None
    (ident,) = store.chunk_identities(engine.cache.identity_key.with_namespace(None), tokens[:CHUNK])
    return chunk_key(ident.page_id, store.layout_id)


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_damaged_chunk_is_quarantined_and_served_as_a_miss(tmp_path: Path, damage: str) -> None:
    first = Engine(config(tmp_path, host_cache_bytes=0))
    try:
        prompt = make_tokens(first, 300, seed=70)
        other = make_tokens(first, 300, seed=71)
        cold = run(first, prompt)
        for tokens in (prompt, other, other):
            run(first, tokens)
        persist(first)
        mine, foreign = first_chunk_key(first, prompt), first_chunk_key(first, other)
    finally:
        first.close()
    by_key = {f.stem: f for f in chunk_files(tmp_path)}
    assert mine in by_key and foreign in by_key, "the prompts' chunks are not on disk"
    target = by_key[mine]
    data = target.read_bytes()
    if damage == "flip":
        target.write_bytes(data[:-10] + bytes([data[-10] ^ 1]) + data[-9:])
    elif damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    else:
        # Another prompt's chunk under this name: the name sealed inside it gives it away.
        target.write_bytes(by_key[foreign].read_bytes())
    second = Engine(config(tmp_path, host_cache_bytes=0))
    try:
        again = run(second, prompt, max_tokens=2)
        store = second.stats().cache.store
        assert store is not None and store.chunks.quarantined == 1
        assert store.chunks.disk is not None and store.chunks.disk.quarantined == 1
        assert again.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        # The first chunk was bad, so nothing before it: computed from scratch, the right answer.
        assert again.stats.cached_tokens == 0
        assert_logits_close(again.first_logits, cold.first_logits, "after a bad chunk vs cold")
        assert len(list((tmp_path / "v1" / "quarantine").iterdir())) == 1
        assert second.invariant_failures == []
    finally:
        second.close()


def test_a_full_disk_never_fails_a_request(tmp_path: Path) -> None:
    # A disk budget smaller than one chunk: nothing fits, every request is still answered.
    engine = Engine(config(tmp_path, host_cache_bytes=0, disk_cache_bytes=1 << 20))
    try:
        for seed in (80, 81, 82):
            prompt = make_tokens(engine, 300, seed=seed)
            assert run(engine, prompt).finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
            assert run(engine, prompt).stats.cached_tokens == len(prompt)
        persist(engine)
        idle_out(engine, 83)
        disk = engine.stats().cache.store.chunks.disk
        assert disk is not None and disk.chunks == 0 and disk.skipped_full > 0
        assert chunk_files(tmp_path) == []
        assert engine.invariant_failures == []
    finally:
        engine.close()


def test_deterministic_mode_restores_from_the_store_bit_for_bit(
    warm_exact: Engine, cold_exact: Engine
) -> None:
    # Entries demoted (here: all but the pins, as pressure or idleness would) come
    # back on a later hit onto cells on the block grid, and the output equals a cold
    # run's bit for bit.
    warm = warm_exact
    system = make_tokens(warm, 600, seed=90)
    # Tails that end the last whole block at 576 (reusing all 600) and at 768 (reusing 576,
    # then tiled blocks over the restored cells).
    prompts = [system + make_tokens(warm, n, seed=91 + i) for i, n in enumerate((20, 27, 200))]
    first = run(warm, prompts[0], max_tokens=8)
    for i, prompt in enumerate(prompts[1:] + [prompts[0]], start=1):
        demote_unpinned(warm)
        # A pinned 70-token entry decoded now leaves the allocator's next free cell off
        # the block grid: a restore put there would not compute as the cold run did.
        warm.generate(GenerationRequest(tokens=make_tokens(warm, 70, seed=80 + i), max_tokens=1, pin=True))
        on = run(warm, prompt, max_tokens=8)
        off = run(cold_exact, prompt, max_tokens=8)
        assert on.stats.cache_source == "ram", f"prompt {i}: {on.stats.cache_source}"
        assert on.stats.cached_tokens >= 576
        assert_bit_exact(on, off, f"prompt {i}")
    assert on.tokens == first.tokens  # the first prompt again, restored whole
    assert warm.stats().placement.unaligned_steps == 0
    assert warm.invariant_failures == []


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_prompt_longer_than_the_pool_s_budget_goes_to_the_store_from_its_lane(
    deterministic: bool, cold_exact: Engine
) -> None:
    # A prompt over the pool's byte budget (here 10 MiB: about 450 tokens) never becomes an entry,
    # and without the store its next turn would prefill it all again.
    engine = Engine(config(None, deterministic=deterministic, cache=CacheConfig(max_bytes=10 << 20)))
    try:
        prompt = make_tokens(engine, 700, seed=95)
        first = run(engine, prompt, max_tokens=8)
        settle(engine)
        assert engine.stats().cache.resident.uncacheable >= 1
        assert engine.cache.tiers.resident.entries() == []
        again = run(engine, prompt, max_tokens=8)
        assert again.stats.cache_source == "ram"
        assert again.stats.cached_tokens == len(prompt)
        assert again.tokens == first.tokens
        turn = prompt + list(first.tokens) + make_tokens(engine, 40, seed=96)
        on = run(engine, turn, max_tokens=8)
        assert on.stats.cache_source == "ram"
        assert on.stats.cached_tokens >= len(prompt) // CHUNK * CHUNK
        if deterministic:
            assert_bit_exact(on, run(cold_exact, turn, max_tokens=8), "the next turn")
            assert engine.stats().placement.unaligned_steps == 0
        assert engine.invariant_failures == []
    finally:
        engine.close()


@pytest.mark.parametrize("deterministic", [False, True])
def test_lanes_that_come_back_to_a_demoted_prefix_share_one_restore(deterministic: bool, cold_exact: Engine) -> None:
    # Four tenants' requests with one system prompt arrive together after its entry left the
    # pool: the first lane restores it, and what came back is resident again, so the other
    # three share its cells (a `seq_cp`) instead of importing three more copies of it.
    warm = Engine(config(None, deterministic=deterministic, idle_tokens=0))
    try:
        system = make_tokens(warm, 600, seed=96)
        run(warm, system + make_tokens(warm, 20, seed=97))
        demote_unpinned(warm)
        assert not resident_pages(warm)
        before = warm.stats().cache.counters
        prompts = [system + make_tokens(warm, 20 + 9 * i, seed=98 + i) for i in range(4)]
        done = warm.generate_many([GenerationRequest(tokens=p, max_tokens=8, keep_first_logits=True)
                                   for p in prompts])
        after = warm.stats().cache.counters
        assert after.restores == before.restores + 1
        assert sorted(d.stats.cache_source for d in done) == ["ram", "resident", "resident", "resident"]
        assert all(d.stats.cached_tokens >= 576 for d in done)
        if deterministic:
            for i, (prompt, on) in enumerate(zip(prompts, done, strict=True)):
                assert_bit_exact(on, run(cold_exact, prompt, max_tokens=8), f"tenant {i}")
            assert warm.stats().placement.unaligned_steps == 0
        assert warm.invariant_failures == []
    finally:
        warm.close()


def test_deterministic_mode_restores_chunks_written_before_a_restart_bit_for_bit(
    tmp_path: Path, cold_exact: Engine
) -> None:
    # Found by name: each chunk's name says which kernel computed its rows (exact.py).
    first = Engine(config(tmp_path, deterministic=True))
    system = make_tokens(first, 600, seed=70)
    prompt = system + make_tokens(first, 20, seed=71)
    try:
        cold_first = run(first, prompt)
        assert run(first, prompt).stats.cached_tokens == len(prompt)  # reused: its chunks go to disk
        persist(first)
    finally:
        first.close()
    second = Engine(config(tmp_path, deterministic=True))
    try:
        # Its last whole block ends at 768: the four tiled chunks of 128 serve, the rest is prefilled.
        other = system + make_tokens(second, 200, seed=72)
        on, off = run(second, other, max_tokens=8), run(cold_exact, other, max_tokens=8)
        assert (on.stats.cache_source, on.stats.cached_tokens) == ("disk", 4 * CHUNK)
        assert_bit_exact(on, off, "a prompt restored by chunk names")
        again = run(second, prompt)
        assert (again.stats.cache_source, again.stats.cached_tokens) == ("disk", len(prompt))
        assert np.array_equal(again.first_logits, cold_first.first_logits)
        assert second.stats().placement.unaligned_steps == 0
        assert second.invariant_failures == []
    finally:
        second.close()


def test_deterministic_chunk_names_tell_rows_computed_one_at_a_time_from_tiled_ones(
    warm_exact: Engine, cold_exact: Engine
) -> None:
    # A's reply is computed one token at a time; B resends it unmarked, so B's cold run tiles those
    # rows. A's finished entry holds them in its second chunk: found by name, it would serve B wrongly.
    a = make_tokens(warm_exact, 250, seed=75)
    reply = run(warm_exact, a, max_tokens=40).tokens
    demote_unpinned(warm_exact)
    b = a + list(reply) + make_tokens(warm_exact, 100, seed=76)
    on, off = run(warm_exact, b, max_tokens=8), run(cold_exact, b, max_tokens=8)
    # A's rows are tiled up to its last whole block (192) in both runs: that much is reused.
    assert (on.stats.cache_source, on.stats.cached_tokens) == ("ram", 192)
    assert_bit_exact(on, off, "a prompt that tiles another's reply")


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_restore_that_goes_on_from_a_resident_entry_imports_only_the_rest(deterministic: bool) -> None:
    # A resident entry holds the first 300 tokens of a page the store holds whole: a restore of the
    # page shares the entry's cells for its whole chunks and imports only the chunks after them,
    # and the rows it gives are the cold run's.
    warm = Engine(config(None, deterministic=deterministic, idle_tokens=0))
    cold = Engine(config(None, deterministic=deterministic, cache=CacheConfig(mode=CacheMode.DISABLED)))
    try:
        long = make_tokens(warm, 600, seed=95)
        run(warm, long)
        demote_unpinned(warm)
        short = long[:300] + make_tokens(warm, 20, seed=96)[1:]
        assert run(warm, short).stats.cache_source == "ram"  # from the page, onto fresh cells
        before = warm.stats()
        prompt = long + make_tokens(warm, 30, seed=97)[1:]
        on = run(warm, prompt, max_tokens=6)
        after = warm.stats()
        assert (on.stats.cache_source, on.stats.cached_tokens) == ("ram", len(long))
        shared = after.cache.counters.restore_shared_tokens - before.cache.counters.restore_shared_tokens
        assert shared == 2 * CHUNK
        # The lane held the entry's cells and its own: the restore added only the rest.
        assert after.cache.counters.restores == before.cache.counters.restores + 1
        off = run(cold, prompt, max_tokens=6)
        assert_as_cold(on, off, warm, deterministic, "a restore that goes on from a resident entry")
        assert warm.invariant_failures == []
    finally:
        warm.close()
        cold.close()


def test_without_a_store_idle_entries_stay_resident() -> None:
    engine = Engine(config(None, host_cache_bytes=0, lanes=2))
    try:
        prompt = make_tokens(engine, 200, seed=48)
        run(engine, prompt)
        run(engine, make_tokens(engine, 200, seed=49))
        stats = engine.stats()
        assert stats.cache.store is None
        assert stats.cache.counters.idle_evictions == 0 and stats.cache.counters.demotions == 0
        assert run(engine, prompt).stats.cached_tokens == len(prompt)
    finally:
        engine.close()


def test_chunk_files_are_never_left_half_written(tmp_path: Path) -> None:
    (tmp_path / "v1" / "chunks" / "ab").mkdir(parents=True)
    leftover = tmp_path / "v1" / "chunks" / "ab" / ("ab" * 16 + ".123456.tmp")
    leftover.write_bytes(b"half a chunk")
    engine = Engine(config(tmp_path))
    try:
        disk = engine.stats().cache.store.chunks.disk
        assert disk is not None and disk.removed_at_start == 1 and not leftover.exists()
    finally:
        engine.close()
    assert os.path.exists(tmp_path / "lock")


def test_a_chunk_cut_with_another_size_is_never_named_alike(engine: Engine) -> None:
    """A chunk is named by the prefix at its end; its rows depend on the chunk size too. Stores cut with
    different sizes (a disk directory from another configuration, a replica on the shared tier) must
    never share a name, or one would import the other's rows at the wrong positions."""
    from skippy_cache.chunkstore import ChunkStore
    from skippy_cache.runtime.statestore import StateStore

    store = engine.cache.store
    assert store is not None
    other = StateStore(ChunkStore(1 << 20, None, secret=bytes(32)), store.layout, 2 * CHUNK,
                       max_pending_bytes=1 << 20)
    try:
        tokens = make_tokens(engine, 4 * CHUNK + 10, seed=41)
        space = engine.cache.identity_key.with_namespace(None)
        ours = store._chunk_keys(store.chunk_identities(space, tokens))
        theirs = other._chunk_keys(other.chunk_identities(space, tokens))
        # Both have a chunk ending at token 2 * CHUNK, holding different rows: different names.
        assert ours[1] != theirs[0]
        assert not set(ours) & set(theirs)
    finally:
        other.close()


@pytest.mark.parametrize("durable", [False, True])
def test_a_write_under_way_when_the_store_is_cleared_leaves_nothing(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool
) -> None:
    """An operator's clear while the writer seals an export: the chunks sealed after it must not land,
    or the prompt is found again by its chunks' names (in RAM, or on disk after a restart)."""
    from skippy_cache.chunkstore import ChunkStore
    from skippy_cache.diskchunks import DiskChunks
    from skippy_cache.runtime import statestore

    tokens = make_tokens(engine, 3 * CHUNK + 10, seed=43)
    run(engine, tokens)
    entry = next(e for e in engine.call(lambda: list(engine.cache.tiers.resident.entries()))
                 if e.token_count == len(tokens))
    payload = engine.call(lambda: engine.pool.export(entry.seq_id))
    layout = engine.cache.store.layout

    sealing, resume = threading.Event(), threading.Event()
    disk = DiskChunks(tmp_path, 1 << 30, reserve_bytes=0)
    chunks = ChunkStore(1 << 26, disk, secret=bytes(32))
    real_seal = chunks.seal

    def slow_seal(chunk):  # noqa: ANN001, ANN202 - the writer's one call site
        sealing.set()
        assert resume.wait(30)
        return real_seal(chunk)

    monkeypatch.setattr(chunks, "seal", slow_seal)
    store = statestore.StateStore(chunks, layout, CHUNK, max_pending_bytes=1 << 28)
    written = threading.Event()
    real_write = store._write

    def write(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        try:
            real_write(*args, **kwargs)
        finally:
            written.set()

    store._write = write  # type: ignore[method-assign]
    try:
        space = engine.cache.identity_key.with_namespace(None)
        whole = prefix_identity(space, tokens)
        assert store.put(whole.page_id, EntryMeta(space, tokens, None, 0, reused=durable), payload, None)
        assert sealing.wait(30), "the writer never started sealing"
        store.clear()
        resume.set()
        assert written.wait(30), "the writer never finished the export"
        chunk_ids = store.chunk_identities(space, tokens)
        assert store.probe(chunk_ids, whole)[0] == 0
        assert store.stats().chunks.ram_chunks == 0
        assert chunk_files(tmp_path) == []
    finally:
        resume.set()
        store.close()
