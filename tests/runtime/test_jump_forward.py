"""Jump-forward on the real model: the tokens a grammar forces ride in their lane's decode step,
and the reply, its logprobs and what the cache records are those of one token per step, bit for
bit, alone, beside other lanes, sampled at a temperature, and when it ends inside a forced run."""

from __future__ import annotations

import pytest
from exactmode import run_all

from skippy_cache.runtime import Engine, EngineConfig, SamplingParams
from skippy_cache.runtime.lane import Phase
from skippy_cache.runtime.native import literal_json_grammar
from skippy_cache.runtime.requests import DoneEvent, Event, FinishReason, GenerationRequest, TokenEvent

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

PATH = {"type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}},
        "required": ["path", "lines"]}
QUERY = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
#: A call of one of three tools, as the server's tool grammar spells it: fixed text, a name the
#: first token or two settle, then the arguments' fixed keys.
CALL = literal_json_grammar(
    [(name, '<tool_call>\n{"name": "' + name + '", "arguments": ', schema, "}\n</tool_call>")
     for name, schema in (("read_file", PATH), ("write_file", PATH), ("search_code", QUERY))],
    repeat_with=None)


@pytest.fixture(scope="module")
def one_per_step():
    """Exact mode with every forced token decoded in a step of its own: the reference."""
    engine = Engine(EngineConfig(ctx_size=4096, lanes=4, jump_forward=False, check_invariants=True))
    yield engine
    engine.close()


def prompt(engine: Engine, question: str) -> list[int]:
    return engine.model.tokenize(
        "<|im_start|>system\nYou call tools: read_file(path, lines), write_file(path, lines), "
        f"search_code(query).<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


def request(engine: Engine, question: str, **kw) -> GenerationRequest:
    settings = {"max_tokens": 48, "sampling": SamplingParams(temperature=0.0, grammar=CALL),
                "top_logprobs": 2, "record": False, "lookup": False, **kw}
    return GenerationRequest(tokens=prompt(engine, question), **settings)


def same(a: tuple[list[TokenEvent], DoneEvent], b: tuple[list[TokenEvent], DoneEvent]) -> None:
    assert [e.token for e in a[0]] == [e.token for e in b[0]]
    assert [e.logprobs for e in a[0]] == [e.logprobs for e in b[0]]  # floats compared exactly
    assert a[1].finish_reason == b[1].finish_reason and a[1].text == b[1].text


def test_a_call_with_forced_tokens_fed_ahead_is_a_one_per_step_decodes_call(
    exact_engine: Engine, one_per_step: Engine
) -> None:
    question = request(exact_engine, "Show me the first 10 lines of setup.py.")
    before, steps = exact_engine.stats(), exact_engine.stats().steps
    [jumped] = run_all(exact_engine, [question])
    after = exact_engine.stats()
    reference_steps = one_per_step.stats().steps
    [plain] = run_all(one_per_step, [question])
    same(jumped, plain)
    assert jumped[1].text.startswith('<tool_call>\n{"name": "'), jumped[1].text
    taken = after.forced_taken - before.forced_taken
    # `<tool_call>\n{"name": "` alone is ten tokens; the rest of the name and the keys add more.
    assert taken >= 10, (taken, after.forced_fed - before.forced_fed)
    # Each forced token fed ahead is a step saved (less what lookup guesses save the reference).
    assert (after.steps - steps) + 10 <= one_per_step.stats().steps - reference_steps
    assert one_per_step.stats().forced_fed == 0
    assert exact_engine.invariant_failures == []


def test_lanes_decoding_forced_tokens_side_by_side_get_what_each_gets_alone(
    exact_engine: Engine, one_per_step: Engine
) -> None:
    questions = [request(exact_engine, q) for q in (
        "Read README.md.", "Search the code for 'def main'.", "Write 3 lines to notes.txt.")]
    together = run_all(exact_engine, questions, wait_s=180)
    for question, jumped in zip(questions, together, strict=True):
        [plain] = run_all(one_per_step, [question])
        same(jumped, plain)
    assert exact_engine.invariant_failures == []


def test_a_sampled_call_draws_the_same_tokens_with_the_same_seed(
    exact_engine: Engine, one_per_step: Engine
) -> None:
    # Each row is still sampled in turn, so the sampler's random draws are the same ones.
    seeded = SamplingParams(temperature=0.9, seed=7, grammar=CALL)
    sampled = request(exact_engine, "Open the config file.", sampling=seeded)
    [jumped] = run_all(exact_engine, [sampled])
    [plain] = run_all(one_per_step, [sampled])
    same(jumped, plain)


@pytest.mark.parametrize("end", ["max_tokens", "stop"])
def test_a_reply_that_ends_inside_a_forced_run_is_recorded_without_its_rows(
    exact_engine: Engine, one_per_step: Engine, end: str
) -> None:
    # Three tokens in, or on the stop string `name` (the forced run's fourth token from the end):
    # the lane ends with forced rows past its last token still in place; what the cache records
    # from it must not hold them.
    exact_engine.clear_cache()
    limits = {"max_tokens": 3} if end == "max_tokens" else {"stop": ("name",)}
    question = request(exact_engine, "Read the file a.txt.", record=True, lookup=True, **limits)
    [jumped] = run_all(exact_engine, [question])
    [plain] = run_all(one_per_step, [question])
    same(jumped, plain)
    assert jumped[1].finish_reason is (FinishReason.LENGTH if end == "max_tokens" else FinishReason.STOP)
    for entry in exact_engine.cache.tiers.resident.entries():
        assert exact_engine.pool.cells.pos_max(entry.seq_id) + 1 == entry.token_count
    assert exact_engine.invariant_failures == []


def test_the_forced_opening_rides_with_the_prompts_last_rows_in_exact_mode() -> None:
    # The prompt's last rows are computed one at a time and take its last token along (exact.py);
    # the call's forced opening joins them, so the step that gives the first token gives the
    # ten forced tokens and the first one the grammar leaves open, the name's first.
    engine = Engine(EngineConfig(ctx_size=2048, lanes=2, check_invariants=True), start=False)
    try:
        question = request(engine, "Read README.md.")
        events: list[Event] = []
        engine.submit(question, events.append)
        steps = 0
        while not events:
            assert engine.step()
            steps += 1
        (lane,) = engine.scheduler.lanes
        assert lane.phase is Phase.DECODE and len(lane.generated) == 11
        opening = b"".join(engine.model.token_bytes(t) for t in lane.generated[:10])
        assert opening == b'<tool_call>\n{"name": "'
        assert steps == 1 and engine.invariant_failures == []
    finally:
        engine.close(drain=False)
