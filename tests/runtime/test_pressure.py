"""Many distinct prompts overflow the pool several times: nothing fails, no budget is exceeded."""

from __future__ import annotations

import pytest
from prompts import make_tokens

from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.requests import FinishReason, GenerationRequest


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
