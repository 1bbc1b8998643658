"""Tenants on the real engine: each tenant's entries are counted and cleared apart, a tenant past its
share of the pool is evicted first, and a prompt another tenant recorded misses with reason `tenant`
while the request is told `never_seen`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prompts import make_tokens

from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.requests import GenerationRequest, Keep

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

CTX = 2048


def config(**overrides: object) -> EngineConfig:
    base = dict(ctx_size=CTX, lanes=2, idle_tokens=0, host_cache_bytes=0, cache_dir=None, deterministic=False,
                check_invariants=True)
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    # Past a quarter of the pool, a tenant's entries leave it before anyone else's.
    engine = Engine(config(tenant_cache_percent=25))
    yield engine
    engine.close()


def run(engine: Engine, tokens: list[int], tenant: str | None, namespace: str | None = None):
    return engine.generate(GenerationRequest(tokens=tokens, max_tokens=1, tenant=tenant,
                                             namespace=namespace if namespace is not None else tenant))


def test_a_tenants_entries_are_counted_and_cleared_apart(engine: Engine) -> None:
    engine.clear_cache()
    run(engine, make_tokens(engine, 200, seed=1), "alice")
    run(engine, make_tokens(engine, 200, seed=2), "alice")
    run(engine, make_tokens(engine, 200, seed=3), "bob")
    figures = engine.tenant_figures()
    assert figures["alice"].entries == 2 and figures["bob"].entries == 1
    assert figures["alice"].tokens == 400
    assert engine.clear_tenant("alice") == 2
    figures = engine.tenant_figures()
    assert "alice" not in figures and figures["bob"].entries == 1


def test_a_tenant_past_its_share_is_evicted_before_an_older_entry_of_another(engine: Engine) -> None:
    engine.clear_cache()
    bob = make_tokens(engine, 300, seed=10)
    run(engine, bob, "bob")  # the least recently used entry of all
    for seed in range(11, 15):  # 4 x 300 tokens: past a quarter of 2,048 cells
        run(engine, make_tokens(engine, 300, seed=seed), "alice")
    assert engine.tenant_figures()["alice"].tokens == 1200
    # 1,500 cells held, 548 free: a prompt of 1,000 tokens makes two entries leave.
    run(engine, make_tokens(engine, 1000, seed=20), None)
    figures = engine.tenant_figures()
    assert figures["bob"].entries == 1, "plain LRU would have evicted bob's entry first"
    assert figures["alice"].tokens < 1200
    again = run(engine, bob, "bob")
    assert again.stats.cached_tokens > 0


def test_another_tenants_prompt_is_a_miss_counted_as_tenant_and_told_never_seen(engine: Engine) -> None:
    engine.clear_cache()
    tokens = make_tokens(engine, 300, seed=30)
    run(engine, tokens, "alice")
    # The same tenant under another namespace (another cache_salt) is told why.
    salted = run(engine, tokens, "alice", namespace="alice/other-salt")
    assert salted.stats.cached_tokens == 0 and salted.stats.miss_reason == "namespace"
    before = engine.stats().cache.counters.misses.get("tenant", 0)
    other = run(engine, tokens, "bob")
    assert other.stats.cached_tokens == 0
    assert other.stats.miss_reason == "never_seen"
    assert engine.stats().cache.counters.misses.get("tenant", 0) == before + 1
    explained = engine.explain(GenerationRequest(tokens=tokens, max_tokens=1, tenant="carol", namespace="carol"))
    assert explained.matched_tokens == 0 and explained.miss_reason == "never_seen"


def test_clearing_a_tenant_empties_its_pages_in_the_store(tmp_path: Path) -> None:
    engine = Engine(config(host_cache_bytes=64 << 20, cache_dir=tmp_path, disk_reserve_bytes=0, chunk_tokens=64,
                           tenant_cache_percent=50))
    try:
        alice, bob = make_tokens(engine, 300, seed=40), make_tokens(engine, 300, seed=41)
        run(engine, alice, "alice")
        run(engine, alice, "alice")  # reused: its chunks go to disk too when it leaves
        run(engine, bob, "bob")
        run(engine, bob, "bob")
        engine.call(lambda: engine.cache.drop_resident())
        assert engine.cache.store is not None and engine.cache.store.drain(60)
        figures = engine.tenant_figures()
        assert figures["alice"].stored_pages >= 1 and figures["bob"].stored_pages >= 1
        engine.clear_tenant("alice")
        figures = engine.tenant_figures()
        assert "alice" not in figures and figures["bob"].stored_pages >= 1
        assert run(engine, alice, "alice").stats.cached_tokens == 0
        assert run(engine, bob, "bob").stats.cached_tokens > 0
    finally:
        engine.close()


def test_a_tenants_store_option_keeps_its_entries_off_disk_or_in_the_pool(tmp_path: Path) -> None:
    engine = Engine(config(host_cache_bytes=64 << 20, cache_dir=tmp_path, disk_reserve_bytes=0, chunk_tokens=64))
    try:
        prompts = {keep: make_tokens(engine, 300, seed=50 + i) for i, keep in enumerate(Keep)}
        for keep, tokens in prompts.items():
            for _ in range(2):  # reused: its chunks belong on disk when it leaves, if it may go there
                engine.generate(GenerationRequest(tokens=tokens, max_tokens=1, tenant=keep.value,
                                                  namespace=keep.value, keep=keep))
        engine.call(lambda: engine.cache.drop_resident())
        store = engine.cache.store
        assert store is not None and store.drain(60)
        figures = engine.tenant_figures()
        assert figures["all"].stored_pages >= 1 and figures["ram"].stored_pages >= 1
        assert "none" not in figures, "store=none: nothing of it left the pool for the store"
        disk = store.chunks.disk
        assert disk is not None
        on_disk = {path.name.removesuffix(".chunk") for path in (tmp_path / "v1" / "chunks").rglob("*.chunk")}
        pages = engine.call(lambda: {owner: [p for p, page in store._pages.items() if page.owner == owner]
                                     for owner in ("all", "ram")})
        keys = {owner: {k for p in ids for k in (*store._pages[p].chunk_keys, store._pages[p].tail_key)}
                for owner, ids in pages.items()}
        assert keys["all"] & on_disk, "a reused entry of a tenant with store=all is on disk"
        assert not keys["ram"] & on_disk, "store=ram: never on disk"
    finally:
        engine.close()
