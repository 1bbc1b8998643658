"""The official `openai` client against the live server: both endpoints, streamed and not, cache reporting.

Tests that compare the text of two greedy runs use `exact_server` (deterministic
mode): in fast mode the second run may differ in its last float bits and so in
a near-tie greedy choice (tests/runtime/fastmode.py).
"""

from __future__ import annotations

import pytest
from live_server import LiveServer

pytestmark = [pytest.mark.model, pytest.mark.timeout(180)]


def long_prompt(topic: str) -> str:
    """Well over 64 tokens (the default min_tokens), so the prefix is recorded."""
    return (
        f"Here are some notes about {topic}. "
        + " ".join(f"Fact number {i} about {topic} is worth remembering." for i in range(12))
        + f" In one sentence, {topic} is"
    )


def test_completion_non_streamed(server: LiveServer) -> None:
    client = server.openai()
    out = client.completions.create(model=server.model_id, prompt="The capital of France is", max_tokens=6,
                                    temperature=0)
    assert out.object == "text_completion"
    assert out.model == server.model_id
    choice = out.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_completion_streamed_matches_non_streamed(exact_server: LiveServer) -> None:
    client = exact_server.openai()
    args = dict(model="skippy-cache", prompt="Water boils at", max_tokens=6, temperature=0)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_non_streamed(server: LiveServer) -> None:
    client = server.openai()
    out = client.chat.completions.create(
        model=server.model_id,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
    )
    assert out.object == "chat.completion"
    message = out.choices[0].message
    assert message.role == "assistant" and message.content
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= 8
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_streamed_with_usage(exact_server: LiveServer) -> None:
    server = exact_server
    client = server.openai()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    whole = client.chat.completions.create(model=server.model_id, messages=messages, max_completion_tokens=8,
                                           temperature=0)
    stream = client.chat.completions.create(
        model=server.model_id, messages=messages, max_completion_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_deterministic_chat_reuses_the_previous_reply(exact_server: LiveServer) -> None:
    # The server finds the reply in the resent history and has its rows computed one at a
    # time, as they were generated: the second turn reuses the first turn's prompt and reply.
    server = exact_server
    client = server.openai()
    messages = [{"role": "system", "content": long_prompt("glaciers") + " " + long_prompt("tides")},
                {"role": "user", "content": "Name a colour."}]
    first = client.chat.completions.create(model=server.model_id, messages=messages, max_completion_tokens=12,
                                           temperature=0)
    assert first.usage.prompt_tokens > 128
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And another one, please."}]
    second = client.chat.completions.create(model=server.model_id, messages=messages, max_completion_tokens=4,
                                            temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > first.usage.prompt_tokens, f"{cached} cached: the reply was not reused"


def test_second_identical_request_reports_cached_tokens(server: LiveServer) -> None:
    client = server.openai()
    prompt = long_prompt("lighthouses")
    first = client.completions.create(model=server.model_id, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens > 64
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=server.model_id, prompt=prompt, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    # A full repeat reuses every prompt token: the first token comes from the
    # kept logits, bit for bit, so it is the cold run's first token even in
    # fast mode (the tokens after it are fast mode's float noise).
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens
    third = client.completions.create(model=server.model_id, prompt=prompt, max_tokens=1, temperature=0)
    assert third.usage.prompt_tokens_details.cached_tokens == third.usage.prompt_tokens
    assert third.choices[0].text and first.choices[0].text.startswith(third.choices[0].text)


def test_second_identical_chat_reports_cached_tokens(server: LiveServer) -> None:
    client = server.openai()
    messages = [{"role": "system", "content": long_prompt("volcanoes")},
                {"role": "user", "content": "Go on."}]
    args = dict(model=server.model_id, messages=messages, max_tokens=3, temperature=0)
    first = client.chat.completions.create(**args)
    second = client.chat.completions.create(**args)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_cache_salt_separates_tenants(server: LiveServer) -> None:
    client = server.openai()
    prompt = long_prompt("glaciers")

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else None
        out = client.completions.create(model=server.model_id, prompt=prompt, max_tokens=2, temperature=0,
                                        extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0, "tenant b reused tenant a's state"
    assert cached(None) == 0, "the unsalted namespace reused a salted entry"
    # The salted entry does exist: tenant a itself hits it.
    assert cached("tenant-a") > 0


def test_token_id_prompt(server: LiveServer) -> None:
    tokens = server.engine.tokenize("The sky is")
    out = server.openai().completions.create(model=server.model_id, prompt=tokens, max_tokens=3,
                                             temperature=0)
    assert out.usage.prompt_tokens == len(tokens)


def test_stop_string_ends_with_stop(exact_server: LiveServer) -> None:
    client = exact_server.openai()
    args = dict(model=exact_server.model_id, prompt="Count: 1, 2, 3,", max_tokens=8, temperature=0)
    free = client.completions.create(**args)
    text = free.choices[0].text
    assert len(text) > 2
    stop = text[2:4] if text[2:4].strip() else text[1:3]
    out = client.completions.create(**args, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert stop not in out.choices[0].text
    assert text.startswith(out.choices[0].text)


def test_models_endpoint(server: LiveServer) -> None:
    client = server.openai()
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model_id]
    assert client.models.retrieve(server.model_id).id == server.model_id


def answer(response: object) -> dict:
    """The top-level `skippy_cache` object, which the openai client keeps as an extra field."""
    extra = response.model_extra  # type: ignore[attr-defined]
    assert extra is not None and "skippy_cache" in extra, "no skippy_cache object in the response"
    return extra["skippy_cache"]


def test_every_response_says_what_it_reused_and_why_not_more(server: LiveServer) -> None:
    client = server.openai()
    prompt = long_prompt("orchards")
    args = dict(model=server.model_id, max_tokens=2, temperature=0)
    cold = client.completions.create(prompt=prompt, **args)
    said = answer(cold)
    times = {name: said.pop(name) for name in ("queue_ms", "prefill_ms")}
    assert said == {"source": "none", "matched_tokens": 0, "prompt_tokens": cold.usage.prompt_tokens,
                    "restore_ms": 0.0, "miss_reason": "never_seen"}
    # A cold prompt's first token took a prefill: the time from admission to it is not zero.
    assert times["queue_ms"] >= 0 and times["prefill_ms"] > 0
    repeat = client.completions.create(prompt=prompt, **args)
    got = answer(repeat)
    assert (got["source"], got["matched_tokens"]) == ("resident", repeat.usage.prompt_tokens)
    assert "miss_reason" not in got
    # The same start, another ending: reused as far as the two prompts agree, and said why not further.
    diverging = client.completions.create(prompt=prompt[: len(prompt) * 4 // 5] + " Then the river turned.", **args)
    got = answer(diverging)
    assert got["source"] == "resident" and got["miss_reason"] == "diverged"
    assert 0 < got["matched_tokens"] == diverging.usage.prompt_tokens_details.cached_tokens
    assert got["matched_tokens"] < diverging.usage.prompt_tokens
    with server.http() as http:
        counters = http.get("/v1/cache").json()["counters"]
    assert counters["misses"]["never_seen"] >= 1 and counters["misses"]["diverged"] >= 1
    # Chat, streamed with usage: the final chunk carries it next to `usage`.
    stream = client.chat.completions.create(
        messages=[{"role": "user", "content": long_prompt("quarries")}], stream=True,
        stream_options={"include_usage": True}, **args,
    )
    last = list(stream)[-1]
    assert last.usage is not None and answer(last)["prompt_tokens"] == last.usage.prompt_tokens
    assert answer(last)["miss_reason"] == "never_seen"
