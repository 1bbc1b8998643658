"""POST /v1/messages and /v1/messages/count_tokens through the official anthropic client, on the real model.

Structure and constraints, never quality: `any` and `tool` make the reply a call of a known tool
(stop_reason tool_use) whose input follows its schema; streamed equals non-streamed (exact mode);
`none` renders the tools but returns no call; usage splits the prompt into cache reads and the
rest as Anthropic does; an agent's next step reuses the whole previous step, Claude Code's billing
line included; bad input is a 400 in Anthropic's error shape.
"""

from __future__ import annotations

import json

import anthropic
import pytest
from live_server import API_KEY, LiveServer
from test_server_tools import check_arguments

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

TOOLS = [
    {"name": "get_weather", "description": "The weather in a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                       "unit": {"type": "string", "enum": ["c", "f"]}},
                      "required": ["city"], "additionalProperties": False}},
    {"name": "add", "description": "Add two integers",
     "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"], "additionalProperties": False}},
]
SYSTEM = "You are a helpful assistant with tools."
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
#: Greedy: the current API has no temperature, so it goes as an extra field (this server takes it).
GREEDY = {"temperature": 0}


def client(server: LiveServer, **kwargs: object) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=kwargs.pop("api_key", "unused"), **kwargs)


def ask(server: LiveServer, **kwargs: object) -> anthropic.types.Message:
    extra = {**GREEDY, **kwargs.pop("extra_body", {})}
    return client(server).messages.create(
        model="skippy-cache", system=kwargs.pop("system", SYSTEM), messages=kwargs.pop("messages", MESSAGES),
        tools=kwargs.pop("tools", TOOLS), max_tokens=kwargs.pop("max_tokens", 64), extra_body=extra, **kwargs)


def check_input(block: anthropic.types.ToolUseBlock) -> None:
    check_arguments(block.name, json.dumps(block.input))


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "add"}], ids=["any", "tool"])
def test_any_and_a_named_tool_return_one_valid_call(exact_server: LiveServer, choice: dict) -> None:
    message = ask(exact_server, tool_choice=choice)
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    calls = [b for b in message.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].id.startswith("toolu_")
    assert calls[0].name == choice.get("name", calls[0].name) and calls[0].name in {"get_weather", "add"}
    check_input(calls[0])
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > 0
    assert message.model_extra["skippy_cache"]["prompt_tokens"] == (
        message.usage.input_tokens + message.usage.cache_read_input_tokens)


def test_a_streamed_message_is_the_non_streamed_message(exact_server: LiveServer) -> None:
    whole = ask(exact_server, tool_choice={"type": "any"})
    with client(exact_server).messages.stream(
            model="skippy-cache", system=SYSTEM, messages=MESSAGES, tools=TOOLS, max_tokens=64,
            tool_choice={"type": "any"}, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in streamed.content] == [
        (b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in whole.content]
    # The cache served the second copy of the prompt; the final usage says so.
    assert streamed.usage.cache_read_input_tokens > 0
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_text_streams_and_stop_sequences_are_reported(exact_server: LiveServer) -> None:
    whole = ask(exact_server, tools=[], messages=[{"role": "user", "content": "Count from one to ten."}],
                max_tokens=40)
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.content[0].type == "text"
    word = whole.content[0].text.split()[1]
    stopped = ask(exact_server, tools=[], messages=[{"role": "user", "content": "Count from one to ten."}],
                  max_tokens=40, stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    text = stopped.content[0].text if stopped.content else ""
    assert word not in text and whole.content[0].text.startswith(text)
    texts = []
    with client(exact_server).messages.stream(
            model="skippy-cache", system=SYSTEM, messages=[{"role": "user", "content": "Count from one to ten."}],
            max_tokens=40, extra_body=GREEDY) as stream:
        texts = list(stream.text_stream)
    assert "".join(texts) == whole.content[0].text


def test_none_renders_tools_but_returns_no_call(exact_server: LiveServer) -> None:
    message = ask(exact_server, tool_choice={"type": "none"})
    assert all(block.type == "text" for block in message.content)
    assert message.stop_reason in ("end_turn", "max_tokens")
    without = client(exact_server).messages.count_tokens(model="m", system=SYSTEM, messages=MESSAGES)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > without.input_tokens


def test_a_small_max_tokens_ends_cleanly(exact_server: LiveServer) -> None:
    message = ask(exact_server, tool_choice={"type": "any"}, max_tokens=5)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 5
    assert [b.type for b in message.content] == ["text"]


def test_count_tokens_is_the_prompt_a_message_would_send(exact_server: LiveServer) -> None:
    count = client(exact_server).messages.count_tokens(model="m", system=SYSTEM, messages=MESSAGES, tools=TOOLS)
    message = ask(exact_server, max_tokens=1)
    assert count.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_an_agents_steps_reuse_the_whole_previous_step_despite_the_billing_line(exact_server: LiveServer) -> None:
    history = list(MESSAGES)
    before = None
    for step in range(3):
        # Claude Code's first system block: its cch value changes on every request.
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.3; cch={step:05x};"},
                  {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
        message = ask(exact_server, system=system, messages=history, tool_choice={"type": "any"},
                      extra_body={"cache_salt": "anthropic-agent"})
        usage = message.usage
        if before is not None:
            assert usage.cache_read_input_tokens >= before, (step, usage)
        before = usage.input_tokens + usage.cache_read_input_tokens + usage.output_tokens
        call = next(b for b in message.content if b.type == "tool_use")
        history += [{"role": "assistant", "content": [b.model_dump() for b in message.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C"}]}]


def test_the_key_may_come_as_x_api_key(key_server: LiveServer) -> None:
    message = client(key_server, api_key=API_KEY).messages.create(
        model="m", max_tokens=2, messages=MESSAGES, extra_body=GREEDY)
    assert message.usage.output_tokens >= 1
    with pytest.raises(anthropic.AuthenticationError) as caught:
        client(key_server, api_key="wrong").messages.create(model="m", max_tokens=2, messages=MESSAGES)
    assert caught.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("change, words", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image'"),
    ({"tools": [{"name": "web_search", "type": "web_search_20250305"}]}, "web_search_20250305"),
    ({"tools": [{"name": "bad name!", "input_schema": {}}]}, "tools[0].name"),
    ({"tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
    ({"messages": [*MESSAGES, {"role": "assistant", "content": "ok"},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]},
     "toolu_x"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "add", "input": {}}]}]},
     "tool_use"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"tools": [{"name": "x", "input_schema": {"$ref": "#/nowhere"}}]}, "tool 'x'"),
    ({"messages": [{"role": "user", "content": []}]}, "non-empty content"),
], ids=["image", "server-tool", "bad-name", "unknown-named", "orphan-result", "user-tool-use", "max-tokens",
        "bad-schema", "empty-turn"])
def test_bad_input_is_a_400_in_anthropics_shape(server: LiveServer, change: dict, words: str) -> None:
    body = {"model": "m", "max_tokens": 4, "messages": MESSAGES, "tools": TOOLS, **change}
    response = server.http().post("/v1/messages", json=body)
    assert response.status_code == 400, response.text
    answer = response.json()
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error", answer
    assert words in answer["error"]["message"], answer
    with pytest.raises(anthropic.BadRequestError):
        client(server).messages.create(**body)


def test_a_final_assistant_message_is_continued(exact_server: LiveServer) -> None:
    prefill = "The weather in Paris is"
    message = ask(exact_server, tools=[], max_tokens=12,
                  messages=[*MESSAGES, {"role": "assistant", "content": prefill}])
    # The same prompt as text: SmolLM2's template, then the prefill the reply continues.
    prompt = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{MESSAGES[0]['content']}<|im_end|>\n"
              f"<|im_start|>assistant\n{prefill}")
    completion = exact_server.openai().completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0)
    assert message.content[0].text == completion.choices[0].text
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == completion.usage.prompt_tokens


def test_claude_codes_first_request_shape_is_answered_naming_what_is_ignored(exact_server: LiveServer) -> None:
    """What Claude Code 2.1 sends on its first request, cut down: harness context in a system
    message after the user turn, context_management, adaptive thinking, an effort hint, metadata
    whose user_id is a JSON string, a tool whose schema is only a description (any value) under
    auto, cache_control on the last user block. Answered; each ignored field named in a header and
    counted; and the next request, which appends turns, reuses everything before them."""
    user = {"role": "user", "content": [{"type": "text", "text": "Say hello.", "cache_control": {"type": "ephemeral"}}]}
    harness = {"role": "system", "content": "Available agents: general-purpose. Available skills: none."}
    body = {"model": "claude-sonnet-4-5", "max_tokens": 24, "temperature": 0, "system": SYSTEM,
            "messages": [user, harness],
            "tools": [*TOOLS, {"name": "Workflow", "description": "Run a workflow",
                               "input_schema": {"type": "object", "properties": {
                                   "spec": {"description": "Any JSON value describing the workflow"}}}}],
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
            "metadata": {"user_id": json.dumps({"device_id": "d1", "session_id": "s1"})},
            "cache_salt": "claude-code-shape"}
    with exact_server.http(timeout=120) as http:
        first = http.post("/v1/messages", json=body)
        assert first.status_code == 200, first.text
        assert first.headers["x-skippy-ignored"] == "context_management,metadata,thinking"
        assert first.json()["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
        reply = first.json()["content"]
        more = {**body, "messages": [user, harness, {"role": "assistant", "content": reply},
                                     {"role": "user", "content": "And once more."}]}
        second = http.post("/v1/messages", json=more).json()
        reused = second["usage"]["cache_read_input_tokens"]
        assert reused >= first.json()["usage"]["input_tokens"] + first.json()["usage"]["cache_read_input_tokens"], \
            second["usage"]
        metrics = http.get("/metrics").text
    assert 'skippy_ignored_fields_total{endpoint="/v1/messages",field="context_management"} 2.0' in metrics


def test_max_tokens_past_the_context_is_a_bound_not_a_400(exact_server: LiveServer) -> None:
    # Claude Code asks for 64,000 to 128,000 on every request: the reply may stop short of it.
    # (Over plain HTTP: the anthropic client refuses a non-streamed request with such a max_tokens.)
    body = {"model": "m", "max_tokens": 10**6, "temperature": 0, "messages": [{"role": "user", "content": "Say hi."}]}
    response = exact_server.http(timeout=300).post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["stop_reason"] in ("end_turn", "max_tokens") and response.json()["content"]
