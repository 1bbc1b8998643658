"""Prompt lookup decoding on the real model: a lone decode's spare row decodes a guessed next token,
and the reply, its logprobs and what the cache records are those of a plain decode, bit for bit."""

from __future__ import annotations

import pytest
from exactmode import assert_bit_exact, run_all

from skippy_cache.drafts import Drafter
from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.requests import FinishReason, GenerationRequest

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

#: A question whose answer repeats the prompt's words and its own phrases: most steps guess.
QUESTION = ("Summarize: the cache keeps the KV state of repeated prefixes resident in the llama.cpp context "
            "and reuses it exactly, so a repeated prefix costs a sequence copy instead of a prefill.")


@pytest.fixture(scope="module")
def plain_engine():
    """Exact mode with every lone decode padded: the reference."""
    engine = Engine(EngineConfig(ctx_size=4096, lanes=2, lookup_decoding=False, check_invariants=True))
    yield engine
    engine.close()


def chat(engine: Engine, question: str) -> list[int]:
    # Past `min_tokens` with the system message: the prompt and its reply are recorded.
    return engine.model.tokenize("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                                 f"Hugging Face<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
                                 "<|im_start|>assistant\n")


def taken_guesses(prompt: list[int], reply: list[int], max_tokens: int) -> list[int]:
    """Indexes of the reply's tokens that a step sampled as the guess it had fed (engine.py): the steps
    replayed from the reply itself. A step feeds `reply[j]` and guesses `reply[j + 1]`; a right guess
    gives `reply[j + 2]` from the same step."""
    taken, j = [], 0
    while j + 1 < len(reply):
        guess = Drafter([*prompt, *reply[: j + 1]]).guess() if j + 2 < max_tokens else None
        if guess == reply[j + 1]:
            taken.append(j + 1)
            j += 2
        else:
            j += 1
    return taken


def test_guessed_tokens_are_a_plain_decodes_tokens_and_logprobs(
    exact_engine: Engine, plain_engine: Engine
) -> None:
    request = GenerationRequest(tokens=chat(exact_engine, QUESTION), max_tokens=96, top_logprobs=3,
                                record=False, lookup=False)
    before = exact_engine.stats()
    [(guessed, _)] = run_all(exact_engine, [request])
    after = exact_engine.stats()
    [(plain, _)] = run_all(plain_engine, [request])
    assert plain_engine.stats().guesses == 0
    taken = after.guesses_taken - before.guesses_taken
    assert taken >= 10, f"only {taken} of {after.guesses - before.guesses} guesses taken"
    assert [e.token for e in guessed] == [e.token for e in plain]
    assert [e.logprobs for e in guessed] == [e.logprobs for e in plain]  # floats compared exactly
    assert exact_engine.invariant_failures == []


def test_a_reply_that_stops_on_a_guessed_token_is_recorded_without_the_guessed_row(
    exact_engine: Engine, plain_engine: Engine, cold_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stop string that first shows up in a token the step sampled as its guess: the lane ends with
    # the guessed row's cell still in place, and what the cache records or exports from the lane
    # must not hold it.
    exact_engine.clear_cache()
    seen: list[tuple[int, int]] = []  # (the lane's last position, its positions decoded) as it is recorded
    finished = exact_engine.cache.finished

    def recording(lane):  # type: ignore[no-untyped-def]
        seen.append((exact_engine.pool.cells.pos_max(lane.seq_id), lane.n_past))
        return finished(lane)

    monkeypatch.setattr(exact_engine.cache, "finished", recording)
    prompt = chat(exact_engine, QUESTION)
    reply = list(plain_engine.generate(GenerationRequest(tokens=prompt, max_tokens=96, record=False)).tokens)
    text_before = b""
    stop = None
    for i in taken_guesses(prompt, reply, 96):
        piece = exact_engine.model.token_bytes(reply[i]).decode("utf-8", "ignore").strip()
        text_before = b"".join(exact_engine.model.token_bytes(t) for t in reply[:i])
        if len(piece) >= 4 and piece.encode() not in text_before:
            stop = piece
            break
    assert stop is not None, "no guessed token makes a stop string"
    before = exact_engine.stats().guesses_taken
    done = exact_engine.generate(GenerationRequest(tokens=prompt, max_tokens=96, stop=(stop,)))
    assert done.finish_reason is FinishReason.STOP
    assert list(done.tokens) == reply[: len(done.tokens)] and len(done.tokens) == i + 1
    assert exact_engine.stats().guesses_taken > before
    decoded = done.stats.prompt_tokens + len(done.tokens) - 1  # the last token is never fed back
    assert seen == [(decoded - 1, decoded)]
    # Every entry holds exactly the cells it books (the lane's guessed row went before the record).
    for entry in exact_engine.cache.tiers.resident.entries():
        assert exact_engine.pool.cells.pos_max(entry.seq_id) + 1 == entry.token_count
    assert exact_engine.invariant_failures == []
    # The next turn reuses the reply's state and continues as a cold run does, bit for bit.
    follow = [*prompt, *done.tokens,
              *exact_engine.model.tokenize("<|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n")]
    request = GenerationRequest(tokens=follow, max_tokens=24, keep_first_logits=True)
    warm, cold = exact_engine.generate(request), cold_engine.generate(request)
    assert warm.stats.cached_tokens > len(prompt)
    assert_bit_exact(warm, cold, "the turn after a reply that stopped on a guessed token")
