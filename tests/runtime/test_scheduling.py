"""Step order on the real model: first tokens early, and a shared prefix prefilled once.

These run an engine without its thread and call `step()` themselves, so each
assertion is about which tokens one step decoded, never about time.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from fastmode import LOGIT_TOLERANCE, assert_logits_close
from prompts import make_tokens

from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.batching import JOIN_ROWS
from skippy_cache.runtime.lane import Lane, Phase
from skippy_cache.runtime.requests import DoneEvent, Event, FinishReason, GenerationRequest, TokenEvent

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def engine():
    """Fast mode, 4 lanes, no engine thread: each test drives the steps."""
    engine = Engine(EngineConfig(ctx_size=4096, lanes=4, deterministic=False, check_invariants=True),
                    start=False)
    yield engine
    engine.close(drain=False)


def submit(engine: Engine, request: GenerationRequest) -> list[Event]:
    events: list[Event] = []
    engine.submit(request, events.append)
    return events


def lane_of(engine: Engine, events: list[Event]) -> Lane:
    (lane,) = [lane for lane in engine.scheduler.lanes if lane.sink == events.append]
    return lane


def run_to_end(engine: Engine) -> dict[int, DoneEvent]:
    """Step until every lane is done; the done events by the id of their sink's list."""
    while engine.step():
        pass
    done = {id(sink.__self__): event for sink, event, _ in engine._outbox}
    engine._outbox.clear()
    assert engine.invariant_failures == []
    # Every lane's cells were freed: what the pool holds now belongs to cache entries.
    assert all(engine.pool.cells.pos_max(seq) == -1 for seq in range(engine.config.lanes))
    return done


def has_token(events: list[Event]) -> bool:
    return any(not isinstance(e, DoneEvent) for e in events)


def test_the_earliest_request_gets_its_first_token_first(engine: Engine) -> None:
    # Four cold prompts of 200 tokens, all waiting at once: the first lane's
    # prefill runs alone, and its last prompt token goes out on a step of
    # decodes only, before any other lane's prefill.
    prompts = [make_tokens(engine, 200, seed=500 + i) for i in range(4)]
    events = [submit(engine, GenerationRequest(tokens=p, max_tokens=3)) for p in prompts]
    engine.step()
    lanes = [lane_of(engine, e) for e in events]
    assert [lane.n_past for lane in lanes] == [199, 0, 0, 0]
    engine.step()
    assert has_token(events[0]) and not any(has_token(e) for e in events[1:])
    assert [lane.n_past for lane in lanes[1:]] == [0, 0, 0]
    engine.step()
    # The first lane decodes now: the next prefill step holds `fill_tokens` rows (fast mode), so
    # that lane's next token does not wait for a whole batch of rows.
    assert lanes[1].n_past == engine.config.fill_tokens and lanes[2].n_past == 0
    done = run_to_end(engine)
    assert all(done[id(e)].finish_reason is FinishReason.LENGTH for e in events)


def test_a_short_prefill_goes_before_a_long_one(engine: Engine) -> None:
    long = submit(engine, GenerationRequest(tokens=make_tokens(engine, 1500, seed=510), max_tokens=2))
    short = submit(engine, GenerationRequest(tokens=make_tokens(engine, 60, seed=511), max_tokens=2))
    engine.step()
    long_lane, short_lane = lane_of(engine, long), lane_of(engine, short)
    # The short prompt whole, then the long one up to the step's fill size, on the grid.
    assert short_lane.n_past == 59
    assert 0 < long_lane.n_past <= engine.config.fill_tokens and long_lane.n_past % 64 == 0
    engine.step()
    assert has_token(short) and not has_token(long)
    run_to_end(engine)


def test_a_prefill_that_other_requests_wait_on_goes_before_a_shorter_one(engine: Engine) -> None:
    # A 500-token prompt, then an 880-token one whose first 832 tokens two more requests share:
    # they join it (inflight.py), so its rows serve three requests, and it goes first.
    alone = submit(engine, GenerationRequest(tokens=make_tokens(engine, 500, seed=530), max_tokens=1))
    system = make_tokens(engine, 832, seed=531)
    shared = [submit(engine, GenerationRequest(tokens=system + make_tokens(engine, 48, seed=532 + i),
                                               max_tokens=1)) for i in range(3)]
    engine.step()
    leader, *joiners = [lane_of(engine, e) for e in shared]
    assert [lane.phase for lane in joiners] == [Phase.JOIN, Phase.JOIN]
    assert leader.n_past > 0 and lane_of(engine, alone).n_past == 0
    done = run_to_end(engine)
    assert [done[id(e)].stats.cache_source for e in shared] == ["none", "inflight", "inflight"]


def test_a_lane_joins_the_prefix_another_lane_is_prefilling(engine: Engine) -> None:
    system = make_tokens(engine, 600, seed=520)
    tails = [make_tokens(engine, 30, seed=521 + i) for i in range(3)]
    before = engine.cache.stats().counters
    events = [
        submit(engine, GenerationRequest(tokens=system + tail, max_tokens=2, keep_first_logits=True))
        for tail in tails
    ]
    engine.step()
    lanes = [lane_of(engine, e) for e in events]
    assert lanes[0].phase is Phase.PREFILL and lanes[0].n_past > 0
    assert [lane.phase for lane in lanes[1:]] == [Phase.JOIN, Phase.JOIN]
    assert [lane.n_past for lane in lanes[1:]] == [0, 0]
    done = run_to_end(engine)
    after = engine.cache.stats().counters
    assert after.joins - before.joins == 2
    assert after.join_tokens - before.join_tokens == 2 * 576
    assert [done[id(e)].stats.cached_tokens for e in events] == [0, 576, 576]
    assert [done[id(e)].stats.cache_source for e in events] == ["none", "inflight", "inflight"]
    assert [done[id(e)].stats.miss_reason for e in events] == ["never_seen", "diverged", "diverged"]
    # The shared cells hold the right prefix: each joiner's first-token logits
    # match its prompt computed without any reuse, within fast mode's noise.
    for tail, e in zip(tails[1:], events[1:], strict=True):
        alone = submit(engine, GenerationRequest(tokens=system + tail, max_tokens=1, lookup=False,
                                                 record=False, keep_first_logits=True))
        cold = run_to_end(engine)[id(alone)]
        assert cold.stats.cached_tokens == 0
        assert_logits_close(done[id(e)].first_logits, cold.first_logits, "joined vs cold logits")
    # And the logits differ from another prompt's by far more than that noise.
    assert float(np.abs(done[id(events[1])].first_logits - done[id(events[2])].first_logits).max()) > 3 * LOGIT_TOLERANCE


def test_no_join_across_namespaces_or_when_lookup_is_off(engine: Engine) -> None:
    system = make_tokens(engine, 400, seed=530)
    leader = submit(engine, GenerationRequest(tokens=system + [11, 12], max_tokens=1))
    other_tenant = submit(engine, GenerationRequest(tokens=system + [13, 14], max_tokens=1, namespace="b"))
    no_lookup = submit(engine, GenerationRequest(tokens=system + [15, 16], max_tokens=1, lookup=False))
    engine.step()
    assert all(lane_of(engine, e).phase is not Phase.JOIN for e in (leader, other_tenant, no_lookup))
    before = engine.cache.stats().counters.joins
    done = run_to_end(engine)
    assert engine.cache.stats().counters.joins == before
    assert done[id(other_tenant)].stats.cached_tokens == 0 and done[id(no_lookup)].stats.cached_tokens == 0


def test_a_joiner_whose_leader_is_cancelled_prefills_on_its_own(engine: Engine) -> None:
    system = make_tokens(engine, 700, seed=540)
    leader_events: list[Event] = []
    handle = engine.submit(GenerationRequest(tokens=system + [21, 22], max_tokens=1), leader_events.append)
    joiner = submit(engine, GenerationRequest(tokens=system + [23, 24], max_tokens=2))
    engine.step()
    assert lane_of(engine, joiner).phase is Phase.JOIN
    handle.cancel()
    before = engine.cache.stats().counters.joins
    done = run_to_end(engine)
    assert done[id(leader_events)].finish_reason is FinishReason.CANCELLED
    assert done[id(joiner)].finish_reason is FinishReason.LENGTH
    assert done[id(joiner)].stats.cached_tokens == 0
    assert engine.cache.stats().counters.joins == before


def test_a_decode_row_never_shares_a_step_with_a_prefill_chunk(engine: Engine) -> None:
    # A step of 64 rows or more runs llama.cpp's tiled attention kernel; a decode row there
    # would get other floats than in a step of decode rows. And no step holds one row alone.
    submit(engine, GenerationRequest(tokens=make_tokens(engine, 90, seed=550), max_tokens=6))
    engine.step()
    submit(engine, GenerationRequest(tokens=make_tokens(engine, 900, seed=551), max_tokens=2))
    kinds = []
    while engine.step():
        batch = engine._batch
        wants_logits = batch.logits[: batch.n_tokens].astype(bool)
        assert batch.n_tokens >= 2
        assert batch.n_tokens < 64 or not wants_logits.any()
        kinds.append("decode" if wants_logits.any() else "prefill")
    engine._outbox.clear()
    # The long prompt's chunks and the short one's tokens took turns.
    assert "decode" in kinds and "prefill" in kinds and kinds.index("prefill") < len(kinds) - kinds[::-1].index("decode")
    assert all(engine.pool.cells.pos_max(seq) == -1 for seq in range(engine.config.lanes + 1))


def test_an_exact_repeat_continues_bit_for_bit_whatever_else_the_pool_holds() -> None:
    # The repeat's first token comes from the logits kept with the entry; the ones after it are
    # decoded again, beside a pool five times as full. Decoding alone, a lane's one row would be
    # split across the two threads at a point that moves with that occupancy.
    engine = Engine(EngineConfig(ctx_size=8192, lanes=4, threads=2, idle_tokens=0, deterministic=False))
    try:
        prompt = make_tokens(engine, 600, seed=560)

        def logprobs_of(request: GenerationRequest) -> tuple[list[tuple[int, float]], DoneEvent]:
            events: list[Event] = []
            done = threading.Event()
            engine.submit(request, lambda e: (events.append(e), isinstance(e, DoneEvent) and done.set()))
            assert done.wait(300)
            tokens = [(e.token, e.logprobs.chosen.logprob) for e in events if isinstance(e, TokenEvent)]
            return tokens, events[-1]

        first, _ = logprobs_of(GenerationRequest(tokens=prompt, max_tokens=12, top_logprobs=0, pin=True))
        engine.generate(GenerationRequest(tokens=make_tokens(engine, 2400, seed=561), max_tokens=2))
        assert engine.pool.used_cells > 5 * len(prompt)
        again, done = logprobs_of(GenerationRequest(tokens=prompt, max_tokens=12, top_logprobs=0))
        assert done.stats.cached_tokens == len(prompt) and done.stats.cache_source == "resident"
        assert again == first
    finally:
        engine.close()


def test_exact_mode_computes_one_lanes_rows_before_the_next_lanes() -> None:
    # Rows computed one at a time cost the same alone or together, so packing four lanes' rows
    # into one step would only hold back the first lane's token. Four 60-token prompts (row by
    # row from position 0: their last partial block) waiting at once: the first lane's rows go
    # alone with its last prompt token, so its first token comes out of that step, and only
    # then (after its next token) the second lane's rows.
    engine = Engine(EngineConfig(ctx_size=4096, lanes=4, deterministic=True, check_invariants=True), start=False)
    try:
        events = [submit(engine, GenerationRequest(tokens=make_tokens(engine, 60, seed=570 + i), max_tokens=2))
                  for i in range(4)]
        engine.step()
        lanes = [lane_of(engine, e) for e in events]
        assert [lane.n_past for lane in lanes] == [60, 0, 0, 0]
        assert has_token(events[0]) and not any(has_token(e) for e in events[1:])
        engine.step()
        engine.step()
        assert [lane.n_past for lane in lanes[1:]] == [60, 0, 0]
        run_to_end(engine)
        # A short step is topped up with the next lane's rows, to JOIN_ROWS in all.
        events = [submit(engine, GenerationRequest(tokens=make_tokens(engine, n, seed=575 + n), max_tokens=2))
                  for n in (10, 48)]
        engine.step()
        assert [lane_of(engine, e).n_past for e in events] == [10, JOIN_ROWS - 10]
        run_to_end(engine)
        # 63 rows leave no room for the last token under 64 rows: it comes in a decode step.
        events = submit(engine, GenerationRequest(tokens=make_tokens(engine, 64, seed=579), max_tokens=1))
        engine.step()
        assert lane_of(engine, events).n_past == 63 and not has_token(events)
        run_to_end(engine)
    finally:
        engine.close(drain=False)


def test_exact_mode_joins_a_running_prefill_bit_for_bit() -> None:
    # Two tenants' requests on one new system prompt at once: the second waits for the first's
    # rows of the shared prefix and shares them; its first-token logits equal its prompt's
    # computed alone, bit for bit.
    engine = Engine(EngineConfig(ctx_size=4096, lanes=4, deterministic=True, check_invariants=True), start=False)
    try:
        system = make_tokens(engine, 600, seed=590)
        tails = [make_tokens(engine, 30, seed=591 + i) for i in range(2)]
        events = [submit(engine, GenerationRequest(tokens=system + tail, max_tokens=2, keep_first_logits=True))
                  for tail in tails]
        engine.step()
        assert lane_of(engine, events[1]).phase is Phase.JOIN
        done = run_to_end(engine)
        joined = done[id(events[1])]
        assert (joined.stats.cache_source, joined.stats.cached_tokens) == ("inflight", 576)
        alone = submit(engine, GenerationRequest(tokens=system + tails[1], max_tokens=2, lookup=False,
                                                 record=False, keep_first_logits=True))
        cold = run_to_end(engine)[id(alone)]
        assert cold.stats.cached_tokens == 0
        assert np.array_equal(joined.first_logits, cold.first_logits)
        assert joined.tokens == cold.tokens
    finally:
        engine.close(drain=False)
