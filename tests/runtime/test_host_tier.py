"""The host tier on the real model: idle entries leave the pool, and come back exact."""

from __future__ import annotations

import numpy as np
import pytest
from fastmode import assert_logits_close
from prompts import make_tokens

from skippy_cache.host import HostEntry
from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.requests import FinishReason, GenerationRequest

IDLE = 64


@pytest.fixture(scope="module")
def engine():
    engine = Engine(EngineConfig(ctx_size=4096, lanes=4, idle_tokens=IDLE, check_invariants=True))
    yield engine
    engine.close()


def _run(engine: Engine, tokens: list[int], max_tokens: int = 1):
    # One token: the lane's sequence is then the prompt alone, and each prompt
    # records exactly one entry (a longer reply would record a second one).
    return engine.generate(GenerationRequest(tokens=tokens, max_tokens=max_tokens, keep_first_logits=True))


def _resident_pages(engine: Engine) -> set[str]:
    return engine.call(lambda: {e.page_id for e in engine.cache.tiers.resident.entries()})


def test_an_idle_entry_is_demoted_and_a_repeat_restores_it_exactly(engine):
    engine.clear_cache()
    prompt = make_tokens(engine, 300, seed=41)
    cold = _run(engine, prompt)
    assert _resident_pages(engine), "the cold run recorded nothing"
    # Other work idles the entry past IDLE decoded tokens: it leaves the pool for the host tier.
    _run(engine, make_tokens(engine, 200, seed=42), max_tokens=1)
    before = engine.stats()
    assert before.cache.counters.idle_evictions == 1
    assert before.cache.host is not None and before.cache.host.entries == 1
    warm = _run(engine, prompt)
    after = engine.stats()
    assert warm.stats.cached_tokens == len(prompt)
    assert after.cache.counters.host_hits == before.cache.counters.host_hits + 1
    assert after.cache.counters.host_hit_tokens == before.cache.counters.host_hit_tokens + len(prompt)
    # The first token comes from the logits stored with the entry: bit for bit.
    assert np.array_equal(warm.first_logits, cold.first_logits)
    assert warm.tokens[0] == cold.tokens[0]
    # The restored entry is resident again: the next repeat copies cells instead of restoring.
    again = _run(engine, prompt)
    assert again.stats.cached_tokens == len(prompt)
    assert engine.stats().cache.counters.host_hits == after.cache.counters.host_hits
    assert np.array_equal(again.first_logits, cold.first_logits)
    assert engine.invariant_failures == []


def test_a_partial_hit_restores_the_entry_and_keeps_the_shared_prefix(engine):
    engine.clear_cache()
    first = make_tokens(engine, 300, seed=43)
    second = first[:280] + make_tokens(engine, 40, seed=44)
    _run(engine, first, max_tokens=1)
    recorded = _resident_pages(engine)
    _run(engine, make_tokens(engine, 200, seed=45), max_tokens=1)
    assert recorded and not recorded & _resident_pages(engine), "the first prompt's entries are still resident"
    assert all(page in engine.cache.tiers.host for page in recorded)
    host_hits = engine.stats().cache.counters.host_hits
    done = _run(engine, second)
    assert done.stats.cached_tokens == 280
    assert engine.stats().cache.counters.host_hits == host_hits + 1
    # The restored entry held 300 positions; the lane keeps the 280 it shares.
    assert engine.ctx.seq_pos_max(0) == -1  # lanes are freed when a request ends
    assert done.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert engine.invariant_failures == []


def test_a_payload_llama_cpp_refuses_is_served_as_a_miss(engine):
    engine.clear_cache()
    prompt = make_tokens(engine, 260, seed=46)
    cold = _run(engine, prompt)
    _run(engine, make_tokens(engine, 200, seed=47), max_tokens=1)

    def corrupt_every_host_entry() -> int:
        host = engine.cache.tiers.host
        pages = host.pages()
        for page in pages:
            entry = host.peek(page)
            host.put(page, HostEntry(entry.token_count, bytes(entry.payload[:100]), entry.logits))
        return len(pages)

    assert engine.call(corrupt_every_host_entry) == 1
    failures = engine.stats().cache.counters.restore_failures
    again = _run(engine, prompt, max_tokens=4)
    stats = engine.stats()
    # Each refused payload is dropped from the host tier and the prompt is computed from scratch.
    assert stats.cache.counters.restore_failures >= failures + 1
    assert again.stats.cached_tokens == 0
    # Recomputed beside another pool: the same logits within fast mode's noise.
    assert_logits_close(again.first_logits, cold.first_logits, "recomputed vs cold logits")
    assert engine.invariant_failures == []


def test_without_a_host_tier_idle_entries_stay_resident():
    engine = Engine(EngineConfig(ctx_size=4096, lanes=2, host_cache_bytes=0, idle_tokens=IDLE, check_invariants=True))
    try:
        prompt = make_tokens(engine, 200, seed=48)
        _run(engine, prompt, max_tokens=1)
        _run(engine, make_tokens(engine, 200, seed=49), max_tokens=1)
        stats = engine.stats()
        assert stats.cache.host is None
        assert stats.cache.counters.idle_evictions == 0 and stats.cache.counters.demotions == 0
        assert _run(engine, prompt, max_tokens=1).stats.cached_tokens == len(prompt)
    finally:
        engine.close()


def test_deterministic_mode_has_no_host_tier():
    engine = Engine(EngineConfig(ctx_size=2048, lanes=1, deterministic=True), start=False)
    try:
        assert engine.cache.tiers.host is None
    finally:
        engine.close()
