"""Each sampling field does what llama.cpp's sampler says, and the cache stays exact with it.

Fast-mode tests reason within one run only (a run's tokens against that run's
own first-token logits, `keep_first_logits`): across runs the logits move by
fast mode's float noise (fastmode.py). Comparisons across runs use
deterministic-mode engines, where they are exact.
"""

from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest
from prompts import make_tokens

from skippy_cache.runtime import PENALTY_LAST_N, json_grammar
from skippy_cache.runtime.logprobs import log_softmax
from skippy_cache.runtime.native import SamplingParams
from skippy_cache.runtime.requests import (
    DoneEvent,
    FinishReason,
    GenerationRequest,
    RequestError,
    TokenEvent,
)

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

#: Greedy decoding of this repeats "one two three" on and on.
REPETITIVE = "one two three one two three one two three one two three one two three"
#: Each penalty alone (frequency 1.0, presence 2.0, repeat 1.3) moves its greedy first pick, with a
#: margin of at least 1.9 between the first two penalised logits: no CPU's rounding flips it.
ALTERNATING = "yes no yes no yes no yes no yes no yes"

#: An object with one required integer field and nothing else.
AGE_SCHEMA = {
    "type": "object",
    "properties": {"age": {"type": "integer"}},
    "required": ["age"],
    "additionalProperties": False,
}


def chat_prompt(engine, text: str) -> list[int]:
    return engine.tokenize(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def run(engine, request: GenerationRequest) -> tuple[DoneEvent, list[TokenEvent]]:
    """The request's DoneEvent and its token events (which carry the logprobs)."""
    events: list[TokenEvent] = []
    done: list[DoneEvent] = []
    finished = threading.Event()

    def sink(event) -> None:
        if isinstance(event, DoneEvent):
            done.append(event)
            finished.set()
        elif event.token >= 0:
            events.append(event)

    engine.submit(request, sink)
    assert finished.wait(300), "the request did not finish"
    assert done[0].finish_reason in (FinishReason.STOP, FinishReason.LENGTH), done[0].error
    return done[0], events


# -- logit_bias ------------------------------------------------------------------


def test_a_large_negative_logit_bias_removes_the_greedy_token(fast_engine):
    tokens = chat_prompt(fast_engine, "Name the capital of France.")
    plain = fast_engine.generate(GenerationRequest(tokens=tokens, max_tokens=1, keep_first_logits=True))
    greedy = plain.tokens[0]
    assert greedy == int(np.argmax(plain.first_logits))

    bias = ((greedy, -100.0),)
    biased = fast_engine.generate(GenerationRequest(
        tokens=tokens, max_tokens=12, keep_first_logits=True, sampling=SamplingParams(logit_bias=bias)))
    assert biased.tokens[0] != greedy
    assert greedy not in biased.tokens
    # The pick is the argmax of this run's own logits with the bias added.
    shifted = biased.first_logits.copy()
    shifted[greedy] -= 100.0
    assert biased.tokens[0] == int(np.argmax(shifted))


def test_a_large_positive_logit_bias_forces_a_token(fast_engine):
    forced = fast_engine.tokenize(" banana", add_special=False)[0]
    tokens = chat_prompt(fast_engine, "Say hello.")
    out = fast_engine.generate(GenerationRequest(
        tokens=tokens, max_tokens=6, sampling=SamplingParams(temperature=0.8, seed=3, logit_bias=((forced, 100.0),))))
    assert out.tokens == (forced,) * 6


# -- penalties -------------------------------------------------------------------


def penalised(logits: np.ndarray, history: list[int], repeat: float, freq: float, present: float) -> np.ndarray:
    """llama.cpp's penalties sampler over `history` (its last PENALTY_LAST_N tokens), in numpy."""
    out = logits.astype(np.float32).copy()
    ids, counts = np.unique(np.asarray(history[-PENALTY_LAST_N:]), return_counts=True)
    for token, count in zip(ids, counts, strict=True):
        out[token] = out[token] * repeat if out[token] <= 0 else out[token] / repeat
        out[token] -= count * freq + present
    return out


def test_penalties_count_the_prompt_as_llama_server_does(fast_engine):
    # llama-server feeds the prompt through its sampler before the first pick,
    # so the first token is already penalised for what the prompt repeats.
    tokens = fast_engine.tokenize(REPETITIVE)
    params = SamplingParams(repeat_penalty=1.3, frequency_penalty=0.8, presence_penalty=0.4)
    out = fast_engine.generate(GenerationRequest(tokens=tokens, max_tokens=1, keep_first_logits=True,
                                                 sampling=params))
    logits = out.first_logits
    assert int(np.argmax(logits)) in tokens, "the unpenalised pick no longer repeats the prompt"
    expected = penalised(logits, tokens, params.repeat_penalty, params.frequency_penalty, params.presence_penalty)
    assert out.tokens[0] == int(np.argmax(expected))
    assert out.tokens[0] != int(np.argmax(logits))


@pytest.mark.parametrize("field, value", [("frequency_penalty", 1.0), ("presence_penalty", 2.0),
                                          ("repeat_penalty", 1.3)])
def test_each_penalty_alone_moves_the_pick_as_llama_cpp_computes_it(exact_engine, field, value):
    # Checked by its arithmetic, not by how repetitive the text comes out: which text a penalty
    # leads to depends on float bits that differ between CPUs (presence_penalty 1.0 broke the
    # repetition of REPETITIVE on one machine and not on another).
    tokens = exact_engine.tokenize(ALTERNATING)
    params = SamplingParams(**{field: value})
    out = exact_engine.generate(GenerationRequest(tokens=tokens, max_tokens=1, keep_first_logits=True,
                                                  sampling=params))
    logits = out.first_logits
    expected = penalised(logits, tokens, params.repeat_penalty, params.frequency_penalty, params.presence_penalty)
    assert out.tokens[0] == int(np.argmax(expected))
    assert out.tokens[0] != int(np.argmax(logits)), "the penalty no longer moves the pick: the test proves nothing"


# -- logprobs --------------------------------------------------------------------


def test_top_logprobs_are_the_log_softmax_of_the_engines_own_logits(fast_engine):
    tokens = chat_prompt(fast_engine, "What colour is the sky?")
    done, events = run(fast_engine, GenerationRequest(tokens=tokens, max_tokens=4, top_logprobs=5,
                                                      keep_first_logits=True))
    assert len(events) == len(done.tokens) and all(e.logprobs is not None for e in events)
    first = events[0].logprobs
    expected = log_softmax(done.first_logits)
    # Greedy: the sampled token is the most likely one, listed first.
    assert first.chosen.token == done.tokens[0] == first.top[0].token == int(np.argmax(done.first_logits))
    assert first.chosen.logprob == first.top[0].logprob
    assert [t.token for t in first.top] == list(np.argsort(-expected, kind="stable")[:5])
    for item in first.top:
        assert abs(item.logprob - expected[item.token]) < 1e-4
        assert item.piece == fast_engine.model.token_bytes(item.token)
    assert all(a.logprob >= b.logprob for a, b in zip(first.top, first.top[1:], strict=False))
    assert abs(first.chosen.logprob - expected[first.chosen.token]) < 1e-4


def test_no_logprobs_unless_asked(fast_engine):
    _, events = run(fast_engine, GenerationRequest(tokens=chat_prompt(fast_engine, "Hi."), max_tokens=3))
    assert events and all(e.logprobs is None for e in events)


# -- grammar (response_format) ---------------------------------------------------


def test_a_json_grammar_gives_parseable_json(fast_engine):
    tokens = chat_prompt(fast_engine, "Give me a JSON object describing a cat with a name and an age.")
    out = fast_engine.generate(GenerationRequest(tokens=tokens, max_tokens=200,
                                                 sampling=SamplingParams(grammar=json_grammar())))
    assert out.finish_reason is FinishReason.STOP
    assert isinstance(json.loads(out.text), dict)


def test_a_schema_grammar_gives_json_that_follows_it(fast_engine):
    tokens = chat_prompt(fast_engine, "How old is the cat? Answer in JSON.")
    out = fast_engine.generate(GenerationRequest(tokens=tokens, max_tokens=60,
                                                 sampling=SamplingParams(grammar=json_grammar(AGE_SCHEMA))))
    assert out.finish_reason is FinishReason.STOP
    value = json.loads(out.text)
    assert set(value) == {"age"} and type(value["age"]) is int


def test_the_grammar_binds_sampling_at_temperature_too(fast_engine):
    tokens = chat_prompt(fast_engine, "Write a poem.")
    params = SamplingParams(temperature=1.5, seed=11, grammar=json_grammar(AGE_SCHEMA))
    out = fast_engine.generate(GenerationRequest(tokens=tokens, max_tokens=60, sampling=params))
    assert out.finish_reason is FinishReason.STOP
    assert type(json.loads(out.text)["age"]) is int


def test_a_grammar_that_allows_no_token_ends_its_request_alone(exact_engine):
    """A grammar whose only tokens the request's own logit bias bans: that request ends with the
    reason, and a request decoding beside it gets exactly the tokens it gets alone. (A schema that
    admits nothing is refused before it runs: test_an_unsatisfiable_schema_is_refused_up_front.)"""
    other = GenerationRequest(tokens=chat_prompt(exact_engine, "Name three rivers."), max_tokens=24,
                              record=False, lookup=False)
    alone = exact_engine.generate(other)
    (q,) = exact_engine.tokenize("Q", add_special=False)
    doomed = GenerationRequest(tokens=chat_prompt(exact_engine, "Say anything."), max_tokens=24,
                               sampling=SamplingParams(grammar='start: "Q"',
                                                       logit_bias=((q, -math.inf),)))
    results: dict[str, DoneEvent] = {}
    finished = threading.Semaphore(0)

    def sink_for(name: str):
        def sink(event) -> None:
            if isinstance(event, DoneEvent):
                results[name] = event
                finished.release()
        return sink

    exact_engine.submit(other, sink_for("other"))
    exact_engine.submit(doomed, sink_for("doomed"))
    for _ in range(2):
        assert finished.acquire(timeout=300)
    assert results["doomed"].finish_reason is FinishReason.ERROR
    assert "allows no token" in results["doomed"].error
    assert results["other"].finish_reason is alone.finish_reason
    assert tuple(results["other"].tokens) == tuple(alone.tokens)
    assert exact_engine.stats().lanes_busy == 0 and not exact_engine.invariant_failures


def test_an_unsatisfiable_schema_is_refused_up_front():
    # llama.cpp's grammar took it and refused every token once it ran; llguidance says so at once.
    with pytest.raises(ValueError, match="Unsatisfiable schema"):
        json_grammar({"type": "string", "pattern": "^[^\\x00-\\U0010FFFF]$"})


def test_a_lazy_grammar_holds_from_its_trigger_on(fast_engine):
    """Free text until a token ends the output with the trigger, then the grammar, then the end;
    a trigger inside a token that runs past it leaves the output free."""
    tokens = chat_prompt(fast_engine, "Write a sentence about the sea.")
    # Each run cold and alone, so the three compute the same logits (fast mode's floats depend
    # on what a step holds; a hit would compute the prompt otherwise).
    cold = {"record": False, "lookup": False}
    free = fast_engine.generate(GenerationRequest(tokens=tokens, max_tokens=30, **cold))
    grammar = 'start: " cat" | " dog"'
    for trigger in (" sea", " the"):
        lazy = fast_engine.generate(GenerationRequest(
            tokens=tokens, max_tokens=30, sampling=SamplingParams(grammar=grammar, grammar_trigger=trigger), **cold))
        cut = free.text.index(trigger) + len(trigger)
        assert lazy.finish_reason is FinishReason.STOP
        assert lazy.text[:cut] == free.text[:cut] and lazy.text[cut:] in (" cat", " dog"), (trigger, lazy.text)
    # "Th" is inside the token "The" and ends none: the grammar stays off and the text is free.
    assert free.text.startswith("The") and fast_engine.tokenize("The", add_special=False) == [free.tokens[0]]
    untriggered = fast_engine.generate(GenerationRequest(
        tokens=tokens, max_tokens=30, sampling=SamplingParams(grammar=grammar, grammar_trigger="Th"), **cold))
    assert untriggered.text == free.text


# -- refused before anything runs --------------------------------------------------


@pytest.mark.parametrize("request_args, param", [
    (dict(sampling=SamplingParams(grammar="start: undefined_rule")), "response_format"),
    (dict(sampling=SamplingParams(logit_bias=((10**7, 1.0),))), "logit_bias"),
    (dict(sampling=SamplingParams(repeat_penalty=0.0)), "repeat_penalty"),
    (dict(top_logprobs=21), "top_logprobs"),
])
def test_impossible_sampling_is_refused_at_submit(fast_engine, request_args, param):
    request = GenerationRequest(tokens=fast_engine.tokenize("Hello"), max_tokens=2, **request_args)
    with pytest.raises(RequestError) as err:
        fast_engine.submit(request, lambda _event: None)
    assert err.value.param == param


# -- exactness -------------------------------------------------------------------


def _variants(engine) -> dict[str, dict]:
    the, and_ = engine.tokenize(" the", add_special=False)[0], engine.tokenize(" and", add_special=False)[0]
    return {
        "logit_bias": dict(sampling=SamplingParams(logit_bias=((the, -5.0), (and_, 3.0)))),
        "penalties": dict(sampling=SamplingParams(frequency_penalty=0.7, presence_penalty=0.5, repeat_penalty=1.2)),
        "grammar": dict(sampling=SamplingParams(grammar=json_grammar(AGE_SCHEMA))),
        "seeded": dict(sampling=SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=5,
                                               frequency_penalty=0.3)),
        "seeded_grammar": dict(sampling=SamplingParams(temperature=1.2, seed=9, grammar=json_grammar())),
        "logprobs": dict(top_logprobs=3),
    }


VARIANTS = ["logit_bias", "penalties", "grammar", "seeded", "seeded_grammar", "logprobs"]


def _prompt(engine, variant: str) -> list[int]:
    """Long enough to be recorded (min_tokens 64), ending in a question a grammar can answer; one
    per variant, so no variant finds another's prefix in a tier `clear_cache` has not reached yet."""
    seed = 500 + VARIANTS.index(variant)
    return make_tokens(engine, 150, seed=seed) + chat_prompt(engine, "Tell me about the cat in JSON.")


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_and_uncached_runs_give_the_same_tokens(exact_engine, cold_engine, variant):
    """Deterministic mode: cache off, a cold run with the cache on, and a run that reuses the
    cold run's prefix agree token for token, logprobs included."""
    exact_engine.clear_cache()
    tokens = _prompt(exact_engine, variant)
    request = GenerationRequest(tokens=tokens, max_tokens=24, **_variants(exact_engine)[variant])
    off, off_events = run(cold_engine, request)
    cold, cold_events = run(exact_engine, request)
    warm, warm_events = run(exact_engine, request)
    assert off.stats.cached_tokens == 0 and cold.stats.cached_tokens == 0 and warm.stats.cached_tokens >= 128
    assert off.tokens == cold.tokens == warm.tokens
    assert [e.logprobs for e in off_events] == [e.logprobs for e in cold_events] == [e.logprobs for e in warm_events]


@pytest.mark.parametrize("variant", VARIANTS)
def test_an_exact_repeat_samples_its_first_token_as_the_cold_run_did(fast_engine, variant):
    """Fast mode: an exact repeat samples its first token from the stored logits (no decode), through
    the same sampler setup, so its first token and logprobs are the cold run's, bit for bit."""
    fast_engine.clear_cache()
    tokens = _prompt(fast_engine, variant)
    request = GenerationRequest(tokens=tokens, max_tokens=2, **_variants(fast_engine)[variant])
    cold, cold_events = run(fast_engine, request)
    warm, warm_events = run(fast_engine, request)
    assert cold.stats.cached_tokens == 0 and warm.stats.cached_tokens == len(tokens)
    assert warm.tokens[0] == cold.tokens[0]
    assert warm_events[0].logprobs == cold_events[0].logprobs
