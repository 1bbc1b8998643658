"""A quantized KV cache (`--cache-type-k/v`) on the real model: exact mode's hits, resident and
restored from the store, are bit for bit the cache-off run of the same types; and an entry stored
with one KV type is never a hit for a server with another (the types are in the prefix identity)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from exactmode import assert_bit_exact
from prompts import make_tokens

from skippy_cache.config import CacheConfig, CacheMode
from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.requests import GenerationRequest

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]


def config(type_k: str, type_v: str, **overrides: object) -> EngineConfig:
    base = dict(ctx_size=4096, lanes=2, type_k=type_k, type_v=type_v, host_cache_bytes=64 << 20,
                disk_reserve_bytes=0, chunk_tokens=128, check_invariants=True)
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


def run(engine: Engine, tokens: list[int]):
    return engine.generate(GenerationRequest(tokens=tokens, max_tokens=8, keep_first_logits=True))


@pytest.fixture(scope="module")
def q8() -> Iterator[tuple[Engine, Engine]]:
    """q8_0 keys and values: the cache on, and the cache off (the reference)."""
    on = Engine(config("q8_0", "q8_0"))
    off = Engine(config("q8_0", "q8_0", cache=CacheConfig(mode=CacheMode.DISABLED)))
    yield on, off
    on.close()
    off.close()


def test_a_quantized_caches_hits_are_its_cold_run_bit_for_bit(q8: tuple[Engine, Engine]) -> None:
    on, off = q8
    prompt = make_tokens(on, 400, seed=71)
    cold = run(off, prompt)
    first = run(on, prompt)
    assert_bit_exact(first, cold, "q8_0, first run")
    resident = run(on, prompt)
    assert resident.stats.cached_tokens >= 256 and resident.stats.cache_source == "resident"
    assert_bit_exact(resident, cold, "q8_0, resident hit")
    # Demoted to the RAM tier and restored from its chunks: still the cold run's floats.
    assert on.call(on.cache.drop_resident) >= 1
    assert on.cache.store is not None and on.cache.store.drain(30)
    restored = run(on, prompt)
    assert restored.stats.cache_source == "ram" and restored.stats.cached_tokens >= 256
    assert_bit_exact(restored, cold, "q8_0, restored from RAM")
    assert on.invariant_failures == []


def test_a_quantized_cache_takes_less_memory_per_token(q8: tuple[Engine, Engine]) -> None:
    on, _ = q8
    f16 = on.model.kv_bytes_per_token("f16", "f16")
    # A q8_0 block is 34 bytes for 32 values, against 64 bytes in f16.
    assert abs(on.model.kv_bytes_per_token("q8_0", "q8_0") - f16 * 34 / 64) <= 1
    assert on.model.kv_bytes_per_token("q4_0", "q4_0") < on.model.kv_bytes_per_token("q8_0", "q8_0") < f16


def test_chunks_on_disk_from_another_kv_type_are_never_a_hit(tmp_path: Path) -> None:
    prompt: list[int] = []
    first = Engine(config("f16", "f16", cache_dir=tmp_path, deterministic=False, idle_tokens=64))
    try:
        prompt = make_tokens(first, 400, seed=72)
        run(first, prompt)
        assert run(first, prompt).stats.cached_tokens == len(prompt)
        first.call(first.cache.drop_resident)
        assert first.cache.store is not None and first.cache.store.drain(30)
        assert first.stats().cache.store.pages >= 1
    finally:
        first.close()
    second = Engine(config("q8_0", "q8_0", cache_dir=tmp_path, deterministic=False))
    off = Engine(config("q8_0", "q8_0", cache=CacheConfig(mode=CacheMode.DISABLED), deterministic=False))
    try:
        store = second.stats().cache.store
        assert store is not None and store.chunks.disk is not None and store.chunks.disk.found_at_start >= 1
        again = run(second, prompt)
        assert again.stats.cached_tokens == 0, again.stats
        assert np.array_equal(again.first_logits, run(off, prompt).first_logits)
    finally:
        second.close()
        off.close()
