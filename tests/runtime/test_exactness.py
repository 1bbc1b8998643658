"""Cache-on output equals cache-off output.

Full repeats are exact in every mode. Partial hits are exact in deterministic
mode (every core and every lane, whole 64-token blocks in chunks of their own
and the last partial block after them, cells aligned by imported pads, hits
that reuse only rows computed by the kernel the cold run uses); in fast
mode the last float bits may move with batching and pool occupancy, as they do
with the cache off (EXACTNESS.md), so fast mode is measured by the benchmark,
not asserted here.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import cache
from exactmode import assert_bit_exact
from prompts import make_tokens

from skippy_cache.config import CacheMode
from skippy_cache.runtime import Engine, EngineConfig, SamplingParams
from skippy_cache.runtime.requests import FinishReason, GenerationRequest

pytestmark = pytest.mark.model


def test_full_repeat_gives_bit_identical_first_token(fast_engine):
    # The repeat's first token comes from the logits stored with the entry, so
    # it is exact in fast mode too; the tokens after it decode on other cells
    # beside another pool and are fast mode's float noise (fastmode.py).
    fast_engine.clear_cache()
    tokens = make_tokens(fast_engine, 300, seed=1)
    request = GenerationRequest(tokens=tokens, max_tokens=4, keep_first_logits=True)
    cold = fast_engine.generate(request)
    warm = fast_engine.generate(request)
    assert cold.stats.cached_tokens == 0
    assert warm.stats.cached_tokens == len(tokens)
    assert np.array_equal(cold.first_logits, warm.first_logits), (
        f"max |diff| {np.abs(cold.first_logits - warm.first_logits).max()}"
    )
    assert warm.tokens[0] == cold.tokens[0]


def _suite(engine) -> list[list[int]]:
    """12 prompts: 4 shared prefixes (100..1000 tokens) x 3 different tails.

    The 600-token family's first two prompts end their last whole block at
    576: the second reuses all 600 shared tokens, past its tiled rows.
    """
    prompts = []
    for family, prefix_len in enumerate((100, 350, 600, 1000)):
        prefix = make_tokens(engine, prefix_len, seed=100 + family)
        for tail in range(3):
            prompts.append(prefix + make_tokens(engine, 20 + 17 * tail, seed=1000 + 10 * family + tail))
    return prompts


def test_partial_hits_match_cache_off_bit_for_bit(exact_engine, cold_engine):
    exact_engine.clear_cache()
    prompts = _suite(exact_engine)
    partial_hits = 0
    past_blocks = 0
    for i, tokens in enumerate(prompts + [prompts[7]]):
        request = GenerationRequest(tokens=tokens, max_tokens=32, keep_first_logits=True)
        on = exact_engine.generate(request)
        off = cold_engine.generate(request)
        assert off.stats.cached_tokens == 0
        if 0 < on.stats.cached_tokens < len(tokens) - 1:
            partial_hits += 1
            past_blocks += on.stats.cached_tokens % 64 != 0
        assert_bit_exact(on, off, f"prompt {i} ({len(tokens)} tokens)")
    # Two of each family's three prompts start from an earlier one's entry; the last is a repeat.
    assert partial_hits >= 8, f"only {partial_hits} partial hits: the suite no longer tests reuse"
    assert past_blocks >= 1, "no hit reused rows past its last whole block"
    assert on.stats.cached_tokens == len(prompts[7])
    assert exact_engine.stats().placement.unaligned_steps == 0
    assert not exact_engine.invariant_failures


def test_a_prompt_prefilled_beside_a_decoding_lane_and_kept_entries_matches_one_on_an_empty_pool(
        exact_engine, cold_engine):
    # The prompt's blocks are steered among the cells of entries kept (which widen the view) and
    # of a lane that decodes all through its prefill; the cold run has the pool to itself. Idle
    # entries would leave the pool during the next prefill, and a starting lane would take an
    # unused entry's cells (steering.py): both are turned off here.
    exact_engine.clear_cache()
    idle_tokens = exact_engine.cache.idle_tokens
    exact_engine.call(lambda: setattr(exact_engine.cache, "idle_tokens", 0))
    exact_engine.call(lambda: setattr(exact_engine.cache, "evict_where", lambda wanted: False))
    try:
        for k in range(3):
            exact_engine.generate(GenerationRequest(tokens=make_tokens(exact_engine, 1000, seed=400 + k),
                                                    max_tokens=1))
        request = GenerationRequest(tokens=make_tokens(exact_engine, 1100, seed=410), max_tokens=16,
                                    keep_first_logits=True)
        # A short prompt goes first, then decodes (never ending early) all through the long prefill.
        decoding = GenerationRequest(tokens=make_tokens(exact_engine, 40, seed=411), max_tokens=40,
                                     sampling=SamplingParams(logit_bias=((exact_engine.model.eos, -1e9),)))
        beside, on = exact_engine.generate_many([decoding, request])
        assert beside.stats.completion_tokens == 40
    finally:
        exact_engine.call(lambda: setattr(exact_engine.cache, "idle_tokens", idle_tokens))
        exact_engine.call(lambda: delattr(exact_engine.cache, "evict_where"))
    off = cold_engine.generate(request)
    assert on.stats.cached_tokens == 0
    assert_bit_exact(on, off, "a prompt on a wide view")
    assert exact_engine.stats().placement.unaligned_steps == 0


def test_a_prompt_tiled_in_smaller_steps_matches_one_in_larger_steps(cold_engine):
    # A wide KV view gets smaller prefill steps (prefill.step_rows): the tiled kernel's floats
    # must not depend on how many rows a step holds. Here the batch itself is smaller.
    small = Engine(EngineConfig(ctx_size=4096, lanes=4, n_batch=128, cache=cache(mode=CacheMode.DISABLED),
                                check_invariants=True))
    try:
        request = GenerationRequest(tokens=make_tokens(small, 1100, seed=412), max_tokens=16, keep_first_logits=True)
        assert_bit_exact(small.generate(request), cold_engine.generate(request), "128-row steps vs 256-row steps")
    finally:
        small.close()


def test_concurrent_requests_match_cache_off_one_at_a_time_bit_for_bit(exact_engine, cold_engine):
    # Four lanes at once: their prefill chunks take turns, their decode rows share
    # steps, and every step's cells are steered (steering.py). Each family's first
    # prompt runs cold beside three others, then the rest reuse it four at a time.
    exact_engine.clear_cache()
    prompts = _suite(exact_engine)
    order = prompts[0::3] + [p for i, p in enumerate(prompts) if i % 3]
    requests = [GenerationRequest(tokens=t, max_tokens=24, keep_first_logits=True) for t in order]
    got = [done for i in range(0, len(requests), 4) for done in exact_engine.generate_many(requests[i : i + 4])]
    for i, (request, on) in enumerate(zip(requests, got, strict=True)):
        off = cold_engine.generate(request)
        assert_bit_exact(on, off, f"request {i}")
    assert sum(on.stats.cached_tokens > 0 for on in got[4:]) == 8
    assert exact_engine.stats().placement.unaligned_steps == 0
    assert not exact_engine.invariant_failures


def test_the_next_chat_turn_reuses_the_reply_bit_for_bit(exact_engine, cold_engine):
    # Each turn resends the history, replies included, and says where the replies are
    # (the server finds them in the messages): their rows are computed one at a time
    # in the cold run too, so the previous turn's entry serves up to the reply's end.
    exact_engine.clear_cache()
    history = make_tokens(exact_engine, 620, seed=300)
    replies: tuple[tuple[int, int], ...] = ()
    reused_reply = None
    for turn in range(3):
        request = GenerationRequest(tokens=history, max_tokens=24, keep_first_logits=True, replies=replies)
        on = exact_engine.generate(request)
        off = cold_engine.generate(request)
        assert_bit_exact(on, off, f"turn {turn}")
        if reused_reply is not None:
            assert on.stats.cached_tokens == reused_reply, f"turn {turn}: {on.stats.cached_tokens} cached"
        # Every reply token, but the last one when it was cut at max_tokens: it was never fed back.
        reused_reply = len(history) + len(on.tokens) - (on.finish_reason is FinishReason.LENGTH)
        replies += ((len(history), len(history) + len(on.tokens)),)
        history = history + list(on.tokens) + make_tokens(exact_engine, 70, seed=310 + turn)
    # Without the replies' places, the reply's rows would be tiled cold: the hit stops before them.
    alone = exact_engine.generate(GenerationRequest(tokens=history, max_tokens=1, keep_first_logits=True))
    assert alone.stats.cached_tokens < replies[-1][0]
    assert exact_engine.stats().placement.unaligned_steps == 0
    assert not exact_engine.invariant_failures


def test_a_last_token_decoded_after_a_hit_matches_one_decoded_with_the_last_rows(exact_engine, cold_engine):
    # Cold, a prompt's last token goes in the step of its last rows (batching.py); after a hit
    # that reuses every other token, it is decoded in a step of its own, beside a pad row.
    # Both compute it row by row over the same cells in the same order.
    exact_engine.clear_cache()
    first = make_tokens(exact_engine, 300, seed=320)
    exact_engine.generate(GenerationRequest(tokens=first, max_tokens=1))
    request = GenerationRequest(tokens=first + make_tokens(exact_engine, 1, seed=321), max_tokens=16,
                                keep_first_logits=True)
    on = exact_engine.generate(request)
    off = cold_engine.generate(request)
    assert on.stats.cached_tokens == len(first)
    assert_bit_exact(on, off, "a last token decoded after a hit")
    assert exact_engine.stats().placement.unaligned_steps == 0


def test_the_team_size_moves_no_float_so_hits_survive_a_change_of_threads():
    # The engine shrinks its team while other processes keep cores busy (threads.py): a prompt
    # recorded by two threads and reused by one must still be the cache-off run of either.
    on = Engine(EngineConfig(ctx_size=4096, lanes=4, threads=2, cache=cache(shared_prefix_record_limit=0)))
    off = Engine(EngineConfig(ctx_size=4096, lanes=4, threads=1, cache=cache(mode=CacheMode.DISABLED)))
    try:
        prompts = _suite(on)
        firsts = [GenerationRequest(tokens=p, max_tokens=16, keep_first_logits=True) for p in prompts[0::3]]
        for request, cold in zip(firsts, on.generate_many(firsts), strict=True):
            assert_bit_exact(cold, off.generate(request), "two threads cold against one")
        on.call(lambda: on.ctx.set_threads(1))
        rest = [GenerationRequest(tokens=p, max_tokens=16, keep_first_logits=True)
                for i, p in enumerate(prompts) if i % 3]
        hits = on.generate_many(rest[:4]) + on.generate_many(rest[4:])
        for i, (request, hit) in enumerate(zip(rest, hits, strict=True)):
            assert hit.stats.cached_tokens > 0
            assert_bit_exact(hit, off.generate(request), f"hit {i} on one thread, recorded on two")
        assert on.stats().placement.unaligned_steps == 0
    finally:
        on.close()
        off.close()
