"""Many distinct prompts overflow the pool several times: nothing fails, no budget is exceeded."""

from __future__ import annotations

import pytest
from prompts import make_tokens

from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.requests import FinishReason, GenerationRequest

pytestmark = pytest.mark.model


@pytest.mark.timeout(600)
def test_pool_overflow_is_absorbed_by_proactive_eviction():
    # No idle demotion: entries must leave because the pool needs their cells.
    engine = Engine(EngineConfig(ctx_size=2048, lanes=4, check_invariants=True, max_queue=128, idle_tokens=0,
                                 deterministic=False))
    try:
        requests = []
        for i in range(60):
            # Every sixth prompt is long: four of those running at once need
            # most of the pool, so resident entries must be evicted first.
            n = 420 if i % 6 == 5 else 300
            requests.append(GenerationRequest(tokens=make_tokens(engine, n, seed=500 + i), max_tokens=3))
        done = engine.generate_many(requests, timeout=540)
        stats = engine.stats()
    finally:
        engine.close()
    assert len(done) == 60
    assert all(c.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) for c in done)
    assert stats.decode_failures == 0
    assert engine.invariant_failures == []
    # 60 x ~300 tokens of entries through a 2,048-cell pool: eviction must have run.
    assert stats.cache.counters.proactive_evictions > 0
    assert stats.cache.counters.records >= 60


def test_entries_sharing_a_prefix_count_its_cells_once_against_the_resident_cap():
    # `seq_cp` shares cells: a prompt's entry, its reply's, and a longer prompt's that reused them
    # hold one prefix. Counted per entry these are over the cap (half of 8,192 cells) twice over,
    # and the prompt's own entry, which keeps the logits an exact repeat answers from, was evicted.
    engine = Engine(EngineConfig(ctx_size=8192, lanes=4, check_invariants=True, idle_tokens=0,
                                 deterministic=False))
    try:
        prompt = make_tokens(engine, 2200, seed=580)
        longer = prompt + make_tokens(engine, 300, seed=581)[1:]
        engine.generate(GenerationRequest(tokens=prompt, max_tokens=4))
        engine.generate(GenerationRequest(tokens=longer, max_tokens=4))
        stats = engine.stats().cache
        audit = engine.pool_audit()
        repeat = engine.generate(GenerationRequest(tokens=prompt, max_tokens=1))
    finally:
        engine.close()
    cap = stats.resident.max_resident_tokens
    assert cap == 4096
    assert stats.resident.resident_tokens > 2 * cap
    # The longer prompt and both replies (3 tokens fed back each): the first prompt adds no cell.
    assert stats.resident.resident_cells == audit.entry_cells <= len(longer) + 6
    assert stats.counters.budget_evictions == 0
    assert engine.invariant_failures == []
    assert repeat.stats.cache_source == "resident" and repeat.stats.cached_tokens == len(prompt)
