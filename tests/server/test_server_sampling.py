"""The sampling fields over HTTP, with the official `openai` client: each changes the output the way
llama.cpp's sampler says, in OpenAI's response shapes, streamed and not.

Tests that compare the output of two runs use `exact_server` (deterministic
mode); fast-mode tests reason within one response, or against the logits an
exact repeat reads back bit for bit (tests/runtime/fastmode.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
import pytest
from live_server import LiveServer, run_server

from skippy_cache.runtime import GenerationRequest, SamplingParams
from skippy_cache.runtime.logprobs import log_softmax

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

#: Each penalty alone (frequency 1.0, presence 2.0, repeat 1.3) moves its greedy first pick, with a
#: margin of at least 1.9 between the first two penalised logits: no CPU's rounding flips it.
ALTERNATING = "yes no yes no yes no yes no yes no yes"

AGE_SCHEMA = {
    "type": "object",
    "properties": {"age": {"type": "integer"}},
    "required": ["age"],
    "additionalProperties": False,
}


def first_token(server: LiveServer, prompt: str) -> int:
    """The greedy first token of `prompt` (deterministic mode: what the server computes too)."""
    tokens = server.engine.tokenize(prompt)
    return server.engine.generate(GenerationRequest(tokens=tokens, max_tokens=1, record=False)).tokens[0]


def piece(server: LiveServer, token: int) -> str:
    return server.engine.detokenize([token])


# -- logit_bias ------------------------------------------------------------------


def test_a_large_negative_logit_bias_removes_the_greedy_token(exact_server: LiveServer) -> None:
    prompt = "The capital of France is"
    banned = first_token(exact_server, prompt)
    out = exact_server.openai().completions.create(
        model="any", prompt=prompt, max_tokens=8, temperature=0, logprobs=1, logit_bias={str(banned): -100})
    logprobs = out.choices[0].logprobs
    # The logprobs are the raw model's: the banned token is still its favourite, and was not taken.
    assert max(logprobs.top_logprobs[0], key=logprobs.top_logprobs[0].get) == piece(exact_server, banned)
    assert logprobs.tokens[0] != piece(exact_server, banned)
    assert piece(exact_server, banned) not in logprobs.tokens


def test_a_large_positive_logit_bias_forces_a_token(server: LiveServer) -> None:
    forced = server.engine.tokenize(" banana", add_special=False)[0]
    out = server.openai().chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Say hello."}], max_tokens=5, temperature=0.7, seed=1,
        logit_bias={str(forced): 100})
    assert out.choices[0].message.content == piece(server, forced) * 5
    assert out.choices[0].finish_reason == "length"


# -- penalties -------------------------------------------------------------------


def first_answered(server: LiveServer, **fields: object) -> str:
    """The first token of a greedy completion of ALTERNATING over HTTP, as the response's logprobs name it."""
    with server.http() as http:
        body = {"prompt": ALTERNATING, "max_tokens": 1, "temperature": 0, "logprobs": 0, **fields}
        response = http.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"][0]


@pytest.mark.parametrize("field, value", [("frequency_penalty", 1.0), ("presence_penalty", 2.0),
                                          ("repeat_penalty", 1.3)])
def test_each_penalty_reaches_the_sampler(exact_server: LiveServer, field: str, value: float) -> None:
    # Each field gives the pick the engine makes with that penalty (the runtime's tests check
    # the penalty's arithmetic); the values move the pick, so a field that were dropped would fail.
    engine = exact_server.engine
    direct = engine.generate(GenerationRequest(tokens=engine.tokenize(ALTERNATING), max_tokens=1,
                                               sampling=SamplingParams(**{field: value})))
    penalised = first_answered(exact_server, **{field: value})
    assert penalised == piece(exact_server, direct.tokens[0])
    assert penalised != first_answered(exact_server), "the penalty no longer moves the pick: the test proves nothing"


# -- logprobs --------------------------------------------------------------------


def test_completion_logprobs_match_the_engines_own_logits(server: LiveServer) -> None:
    # Over 64 tokens, so the cold run records the whole prompt with its logits, and the
    # engine's repeat below reads back exactly the logits the server's run sampled from.
    prompt = " ".join(f"Item {i} of the list of garden plants is a rose." for i in range(12)) + " The"
    out = server.openai().completions.create(model="any", prompt=prompt, max_tokens=1, temperature=0, logprobs=5)
    logprobs = out.choices[0].logprobs
    tokens = server.engine.tokenize(prompt)
    repeat = server.engine.generate(GenerationRequest(tokens=tokens, max_tokens=1, keep_first_logits=True))
    assert repeat.stats.cached_tokens == len(tokens), "not an exact repeat: the logits would differ by noise"
    expected = log_softmax(repeat.first_logits)
    best = np.argsort(-expected, kind="stable")[:5]
    top = logprobs.top_logprobs[0]
    assert list(top) == [piece(server, int(t)) for t in best]
    for token in best:
        assert abs(top[piece(server, int(token))] - expected[token]) < 1e-4
    # Greedy: the sampled token is the most likely one.
    assert logprobs.tokens[0] == piece(server, int(best[0]))
    assert abs(logprobs.token_logprobs[0] - expected[best[0]]) < 1e-4
    assert logprobs.text_offset == [0]


def test_chat_top_logprobs_list_the_greedy_token_first(server: LiveServer) -> None:
    out = server.openai().chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == entry.top_logprobs[0].logprob
        values = [alt.logprob for alt in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] <= 0.0
        assert bytes(entry.bytes).decode() == entry.token
    assert "".join(entry.token for entry in content) == out.choices[0].message.content


def test_streamed_chat_chunks_carry_logprobs(exact_server: LiveServer) -> None:
    args = dict(model="any", messages=[{"role": "user", "content": "Count to five."}], max_tokens=8,
                temperature=0, logprobs=True, top_logprobs=2)
    client = exact_server.openai()
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in whole.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens


def test_completions_logprobs_stream_with_offsets(exact_server: LiveServer) -> None:
    args = dict(model="any", prompt="The three primary colours are", max_tokens=6, temperature=0, logprobs=2)
    client = exact_server.openai()
    whole = client.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True) if c.choices]
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    # Each offset is where its token's text starts in the returned text.
    for token, offset in zip(whole.logprobs.tokens, whole.logprobs.text_offset, strict=True):
        assert whole.text[offset:offset + len(token)] == token


# -- response_format -------------------------------------------------------------


def test_json_object_gives_parseable_json(server: LiveServer) -> None:
    out = server.openai().chat.completions.create(
        model="any", max_tokens=200, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a cat as a JSON object with a name and an age."}])
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_json_schema_output_follows_the_schema(server: LiveServer) -> None:
    out = server.openai().chat.completions.create(
        model="any", max_tokens=60, temperature=0.8, seed=4,
        response_format={"type": "json_schema", "json_schema": {"name": "age", "schema": AGE_SCHEMA, "strict": True}},
        messages=[{"role": "user", "content": "How old is the cat?"}])
    assert out.choices[0].finish_reason == "stop"
    value = json.loads(out.choices[0].message.content)
    assert set(value) == {"age"} and type(value["age"]) is int


def test_completions_take_response_format_too(server: LiveServer) -> None:
    with server.http() as http:
        response = http.post(COMPLETIONS, json={
            "prompt": "A cat as JSON:", "max_tokens": 60, "temperature": 0,
            "response_format": {"type": "json_object", "schema": AGE_SCHEMA}})  # llama-cpp-python's spelling
    assert response.status_code == 200, response.text
    value = json.loads(response.json()["choices"][0]["text"])
    assert set(value) == {"age"} and type(value["age"]) is int


# -- n and echo ------------------------------------------------------------------


def test_n_choices_are_seeded_seed_plus_index(exact_server: LiveServer) -> None:
    client = exact_server.openai()
    args = dict(model="any", prompt="Once upon a time", max_tokens=12, temperature=1.0)
    both = client.completions.create(**args, n=2, seed=42)
    assert [c.index for c in both.choices] == [0, 1]
    singles = [client.completions.create(**args, seed=42 + i) for i in range(2)]
    texts = [c.text for c in both.choices]
    assert texts[0] != texts[1]
    assert texts == [single.choices[0].text for single in singles]
    # The prompt is counted once; the completions of both choices.
    assert both.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert both.usage.completion_tokens == sum(single.usage.completion_tokens for single in singles)


def test_n_choices_stream_with_their_index(exact_server: LiveServer) -> None:
    client = exact_server.openai()
    args = dict(model="any", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=10,
                temperature=1.0, seed=7, n=2)
    whole = client.chat.completions.create(**args)
    assert len(whole.choices) == 2
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_echo_returns_the_prompt_first(server: LiveServer) -> None:
    prompt = "Roses are red,"
    client = server.openai()
    out = client.completions.create(model="any", prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert out.choices[0].text.startswith(prompt) and len(out.choices[0].text) > len(prompt)
    chunks = [c for c in client.completions.create(model="any", prompt=prompt, max_tokens=4, temperature=0,
                                                   echo=True, stream=True) if c.choices]
    assert chunks[0].choices[0].text == prompt


# -- the cache stays exact -------------------------------------------------------


def test_a_cached_run_gives_the_uncached_runs_tokens(exact_server: LiveServer) -> None:
    prompt = " ".join(f"Note {i}: the river is calm today." for i in range(14)) + " Summarise as JSON."
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0.7, "seed": 3, "frequency_penalty": 0.5,
            "presence_penalty": 0.3, "repeat_penalty": 1.1, "logit_bias": {"11": -2.0}, "logprobs": 2,
            "response_format": {"type": "json_object"}}
    with exact_server.http() as http:
        first = http.post(COMPLETIONS, json=body).json()
        second = http.post(COMPLETIONS, json=body).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]


# -- refused ---------------------------------------------------------------------

# (name, path, body, param)
BAD = [
    ("logit_bias key not a token id", COMPLETIONS, {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit_bias out of range", CHAT, {"messages": USER, "logit_bias": {"5": 101}}, "logit_bias"),
    ("logit_bias token outside the vocabulary", COMPLETIONS, {"prompt": "x", "logit_bias": {"99999999": 1}},
     "logit_bias"),
    ("presence_penalty out of range", CHAT, {"messages": USER, "presence_penalty": 2.5}, "presence_penalty"),
    ("frequency_penalty out of range", COMPLETIONS, {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ("repeat_penalty zero", COMPLETIONS, {"prompt": "x", "repeat_penalty": 0}, "repeat_penalty"),
    ("completions logprobs above 5", COMPLETIONS, {"prompt": "x", "logprobs": 6}, "logprobs"),
    ("chat logprobs as a number", CHAT, {"messages": USER, "logprobs": 3}, "logprobs"),
    ("top_logprobs without logprobs", CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ("top_logprobs above 20", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("echo with logprobs", COMPLETIONS, {"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ("n above the limit", COMPLETIONS, {"prompt": "x", "n": 17}, "n"),
    ("n zero", CHAT, {"messages": USER, "n": 0}, "n"),
    ("unknown response_format type", CHAT, {"messages": USER, "response_format": {"type": "xml"}},
     "response_format.type"),
    ("json_schema without json_schema", CHAT, {"messages": USER, "response_format": {"type": "json_schema"}},
     "response_format"),
    ("a schema the converter refuses", CHAT,
     {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                   "schema": {"type": "foo"}}}},
     "response_format"),
    ("a schema whose grammar llama.cpp refuses", COMPLETIONS,
     {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": []}}}},
     "response_format"),
    ("a ref that goes nowhere", CHAT,
     {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}},
     "response_format"),
]


@pytest.mark.parametrize(("name", "path", "body", "param"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_sampling_field_is_a_400_naming_it(server: LiveServer, name: str, path: str, body: dict,
                                                 param: str) -> None:
    with server.http(timeout=30) as http:
        response = http.post(path, json={"max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


@pytest.fixture(scope="module")
def greedy_by_default(exact_server: LiveServer) -> Iterator[LiveServer]:
    """The exact server's engine behind an app whose requests without a temperature are greedy."""
    yield from run_server(exact_server.engine, replace(exact_server.settings, default_temperature=0.0))


STORY = [{"role": "user", "content": "Write a story about a dog."}]


@pytest.mark.parametrize(("path", "body", "text"), [
    (COMPLETIONS, {"prompt": "Once upon a time"}, lambda r: r["choices"][0]["text"]),
    (CHAT, {"messages": STORY}, lambda r: r["choices"][0]["message"]["content"]),
    ("/v1/messages", {"model": "m", "messages": STORY}, lambda r: r["content"][0]["text"]),
    ("/v1/responses", {"input": STORY}, lambda r: r["output"][0]["content"][0]["text"]),
], ids=["completions", "chat", "messages", "responses"])
def test_a_request_without_a_temperature_gets_the_servers_default(greedy_by_default: LiveServer, path: str,
                                                                   body: dict, text: Callable) -> None:
    """--default-temperature 0: a request that sets none is greedy, the same text as one that sets 0
    (24 tokens sampled at 1.0 would differ); one that sets its own keeps it."""
    limit = {"max_output_tokens": 24} if path == "/v1/responses" else {"max_tokens": 24}
    with greedy_by_default.http(timeout=120) as http:
        unset = [text(http.post(path, json={**body, **limit}).json()) for _ in range(2)]
        greedy = text(http.post(path, json={**body, **limit, "temperature": 0}).json())
        assert unset == [greedy, greedy]
        # An open prompt: at 1.0 four stories of 24 tokens are not all one.
        hot = {text(http.post(path, json={**body, **limit, "temperature": 1.0}).json()) for _ in range(4)}
        assert len(hot) > 1, hot
