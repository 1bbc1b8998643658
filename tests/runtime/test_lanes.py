"""Lanes are isolated: concurrent requests produce what each produces alone."""

from __future__ import annotations

import numpy as np
import pytest
from fastmode import LOGIT_TOLERANCE, assert_logits_close, max_diff
from prompts import make_tokens

from skippy_cache.runtime.native import SamplingParams
from skippy_cache.runtime.requests import FinishReason, GenerationRequest

pytestmark = pytest.mark.model


def test_deterministic_mode_output_does_not_depend_on_what_ran_before(exact_engine):
    # Deterministic mode steers every step's cells (steering.py): the same prompt
    # gives the same tokens whatever the pool held before it and whatever runs beside it.
    exact_engine.clear_cache()
    requests = [
        GenerationRequest(tokens=make_tokens(exact_engine, 80 + 40 * i, seed=60 + i), max_tokens=24, record=False)
        for i in range(4)
    ]
    solo = [exact_engine.generate(r).tokens for r in requests]
    together = [c.tokens for c in exact_engine.generate_many(requests)]
    assert together == solo


def test_concurrent_lanes_are_isolated_in_fast_mode(fast_engine):
    """4 prompts prefilled and decoded in shared batches give what each gives alone.

    Fast mode batches lanes together, which moves the last float bits
    (fastmode.py), so the first-token logits are compared within a tolerance:
    a lane that attended to another lane's cells would be off by several units.
    """
    requests = [
        GenerationRequest(
            tokens=make_tokens(fast_engine, 90 + 37 * i, seed=80 + i), max_tokens=1, record=False, keep_first_logits=True
        )
        for i in range(4)
    ]
    solo = [fast_engine.generate(r) for r in requests]
    together = fast_engine.generate_many(requests)
    for i, (alone, shared) in enumerate(zip(solo, together)):
        assert shared.stats.cached_tokens == 0
        assert_logits_close(alone.first_logits, shared.first_logits, f"lane {i}: alone vs batched logits")
    # The tolerance discriminates: different prompts' logits are far apart.
    assert max_diff(solo[0].first_logits, solo[1].first_logits) > 3 * LOGIT_TOLERANCE


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(exact_engine):
    # Reproducibility of a seed is compared in deterministic mode, where the
    # logits it samples from are the same bit for bit on every run.
    tokens = make_tokens(exact_engine, 40, seed=70)
    sampling = SamplingParams(temperature=1.5, top_k=50, top_p=0.95, min_p=0.01, seed=1234)
    a = exact_engine.generate(GenerationRequest(tokens=tokens, max_tokens=24, sampling=sampling, record=False))
    b = exact_engine.generate(GenerationRequest(tokens=tokens, max_tokens=24, sampling=sampling, record=False))
    greedy = exact_engine.generate(GenerationRequest(tokens=tokens, max_tokens=24, record=False))
    assert a.tokens == b.tokens
    assert a.tokens != greedy.tokens


def test_stop_string_and_max_tokens(exact_engine):
    # Two greedy runs compared token for token: deterministic mode.
    tokens = make_tokens(exact_engine, 40, seed=71)
    full = exact_engine.generate(GenerationRequest(tokens=tokens, max_tokens=20, record=False))
    assert full.finish_reason is FinishReason.LENGTH
    assert len(full.tokens) == 20
    words = full.text.split()
    assert len(words) >= 3, full.text
    stop = words[2]
    cut = exact_engine.generate(GenerationRequest(tokens=tokens, max_tokens=20, stop=(stop,), record=False))
    assert cut.finish_reason is FinishReason.STOP
    assert cut.text == full.text[: full.text.index(stop)]


def test_request_figures_are_reported(fast_engine):
    tokens = make_tokens(fast_engine, 150, seed=72)
    first = fast_engine.generate(GenerationRequest(tokens=tokens, max_tokens=8))
    second = fast_engine.generate(GenerationRequest(tokens=tokens, max_tokens=8))
    for c in (first, second):
        assert c.stats.prompt_tokens == 150
        assert c.stats.completion_tokens == len(c.tokens)
        assert c.stats.ttft_ms >= c.stats.prefill_ms > 0
    assert second.stats.cached_tokens == 150


def test_whole_prompt_hit_samples_like_a_cold_run(fast_engine):
    # The repeat samples its first token from the kept logits (no decode):
    # with a seeded chain it must draw exactly what the cold run drew. Later
    # tokens decode on other cells beside another pool, so fast mode does not
    # promise them bit for bit.
    fast_engine.clear_cache()
    tokens = make_tokens(fast_engine, 120, seed=73)
    sampling = SamplingParams(temperature=1.2, top_k=40, top_p=0.9, seed=99)
    request = GenerationRequest(tokens=tokens, max_tokens=12, sampling=sampling, keep_first_logits=True)
    cold = fast_engine.generate(request)
    warm = fast_engine.generate(request)
    assert cold.stats.cached_tokens == 0
    assert warm.stats.cached_tokens == len(tokens)
    assert np.array_equal(warm.first_logits, cold.first_logits)
    assert warm.tokens[0] == cold.tokens[0]
