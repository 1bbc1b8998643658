"""The serving flow's cache path on the real model."""

from __future__ import annotations

import pytest
from prompts import make_tokens

from skippy_cache.runtime.requests import FinishReason, GenerationRequest, RequestError

pytestmark = pytest.mark.model


def test_fast_mode_hit_covers_exactly_the_shared_prefix(fast_engine):
    fast_engine.clear_cache()
    first = make_tokens(fast_engine, 300, seed=7)
    second = first[:280] + make_tokens(fast_engine, 50, seed=8)
    assert second[280] != first[280]
    fast_engine.generate(GenerationRequest(tokens=first, max_tokens=1))
    done = fast_engine.generate(GenerationRequest(tokens=second, max_tokens=1))
    # The prefix index finds the 280 shared tokens inside the first prompt's entry.
    assert done.stats.cached_tokens == 280
    # A prompt that is a strict prefix of a cached one reuses all but its last token.
    shorter = first[:200]
    assert fast_engine.generate(GenerationRequest(tokens=shorter, max_tokens=1)).stats.cached_tokens == 199


def test_a_follow_up_reuses_the_reply_the_lane_generated(fast_engine):
    # A chat's next turn resends the reply inside its history: the lane's whole
    # sequence was recorded when the request ended, so the reply is not prefilled again.
    fast_engine.clear_cache()
    prompt = make_tokens(fast_engine, 150, seed=11)
    first = fast_engine.generate(GenerationRequest(tokens=prompt, max_tokens=12))
    # Every generated token is fed back, except the last when generation stopped on the length limit.
    fed = len(first.tokens) - (1 if first.finish_reason is FinishReason.LENGTH else 0)
    follow_up = prompt + list(first.tokens) + make_tokens(fast_engine, 30, seed=12)
    second = fast_engine.generate(GenerationRequest(tokens=follow_up, max_tokens=1))
    assert second.stats.cached_tokens == len(prompt) + fed
    # The prompt alone is still an exact repeat (its own entry keeps the first-token logits).
    assert fast_engine.generate(GenerationRequest(tokens=prompt, max_tokens=1)).stats.cached_tokens == len(prompt)
    assert fast_engine.invariant_failures == []


def test_deterministic_hit_reuses_only_rows_its_cold_run_computes_alike(exact_engine):
    # The first prompt tiles rows 0..255 and computes 256..298 row by row (exact.py).
    exact_engine.clear_cache()
    first = make_tokens(exact_engine, 300, seed=7)
    exact_engine.generate(GenerationRequest(tokens=first, max_tokens=1))
    # 330 tokens tile rows 0..319: of the 280 shared, only the rows both tiled.
    longer = exact_engine.generate(GenerationRequest(tokens=first[:280] + make_tokens(exact_engine, 50, seed=8),
                                                     max_tokens=1))
    assert (longer.stats.cached_tokens, longer.stats.miss_reason) == (256, "grid")
    # 295 tokens tile rows 0..255 too: all 290 shared, off the block grid.
    alike = exact_engine.generate(GenerationRequest(tokens=first[:290] + make_tokens(exact_engine, 5, seed=9),
                                                    max_tokens=1))
    assert (alike.stats.cached_tokens, alike.stats.miss_reason) == (290, "diverged")


def test_namespaces_never_share_state(fast_engine):
    fast_engine.clear_cache()
    tokens = make_tokens(fast_engine, 200, seed=9)
    fast_engine.generate(GenerationRequest(tokens=tokens, max_tokens=1, namespace="tenant-a"))
    other = fast_engine.generate(GenerationRequest(tokens=tokens, max_tokens=1, namespace="tenant-b"))
    same = fast_engine.generate(GenerationRequest(tokens=tokens, max_tokens=1, namespace="tenant-a"))
    assert other.stats.cached_tokens == 0
    assert same.stats.cached_tokens == len(tokens)


def test_eviction_frees_native_state(fast_engine):
    fast_engine.clear_cache()
    fast_engine.generate(GenerationRequest(tokens=make_tokens(fast_engine, 150, seed=20), max_tokens=1))
    resident = fast_engine.cache.tiers.resident

    def evict_all_one_by_one():
        steps = []
        while resident.entries():
            victim = resident.entries()[0]
            native_before = fast_engine.ctx.seq_pos_max(victim.seq_id)
            assert fast_engine.cache.evict_one()
            used = fast_engine.pool.used_cells
            steps.append((victim, native_before, fast_engine.ctx.seq_pos_max(victim.seq_id), used))
        return steps

    steps = fast_engine.call(evict_all_one_by_one)
    # Fast mode records one entry per prompt, the whole prompt; dropping it frees every cell.
    assert [(v.token_count, used) for v, _, _, used in steps] == [(150, 0)]
    for victim, native_before, native_after, _ in steps:
        assert native_before == victim.token_count - 1
        assert native_after == -1


def test_cache_off_records_nothing(cold_engine):
    tokens = make_tokens(cold_engine, 120, seed=30)
    cold_engine.generate(GenerationRequest(tokens=tokens, max_tokens=1))
    again = cold_engine.generate(GenerationRequest(tokens=tokens, max_tokens=1))
    assert again.stats.cached_tokens == 0
    assert cold_engine.stats().cache.resident.entries == 0


@pytest.mark.parametrize(
    ("tokens", "max_tokens", "param"),
    [
        ([], 4, "prompt"),
        ([1, 2, 3], 0, "max_tokens"),
        ([1, 2, 3], -5, "max_tokens"),
        ([10**7], 4, "prompt"),
        ([-1, 5], 4, "prompt"),
        ([5] * 4096, 1, "prompt"),
        ([5] * 4000, 200, "max_tokens"),
    ],
)
def test_impossible_requests_are_rejected_before_decode(fast_engine, tokens, max_tokens, param):
    steps = fast_engine.stats().steps
    with pytest.raises(RequestError) as err:
        fast_engine.submit(GenerationRequest(tokens=tokens, max_tokens=max_tokens), lambda _e: None)
    assert err.value.param == param
    assert fast_engine.stats().steps == steps


def test_decode_failure_fails_the_request_and_the_engine_survives(fast_engine, monkeypatch):
    tokens = make_tokens(fast_engine, 90, seed=40)
    real_decode = fast_engine.ctx.decode
    calls = {"n": 0}

    def failing_decode(batch):
        calls["n"] += 1
        return -3 if calls["n"] == 1 else real_decode(batch)

    monkeypatch.setattr(fast_engine.ctx, "decode", failing_decode)
    with pytest.raises(RuntimeError, match="llama_decode failed"):
        fast_engine.generate(GenerationRequest(tokens=tokens, max_tokens=4))
    monkeypatch.setattr(fast_engine.ctx, "decode", real_decode)
    after = fast_engine.generate(GenerationRequest(tokens=tokens, max_tokens=4))
    assert after.finish_reason is FinishReason.LENGTH
    assert fast_engine.stats().lanes_busy == 0
    assert fast_engine.stats().decode_failures >= 1
    # The ledger still matches llama.cpp's sequences after the failure.
    assert fast_engine.invariant_failures == []
