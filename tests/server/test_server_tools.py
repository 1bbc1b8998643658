"""Tool calls on /v1/chat/completions through the official openai client, on the real model.

The 135M model's choices are not judged, only structure and constraints: with `required` or a
named tool the grammar makes the reply a call of a known tool whose arguments follow its schema;
streamed equals non-streamed (exact mode); `none` returns no call; a short `max_tokens` ends
cleanly; an agent's next step reuses the system prompt and tools; bad tools are 400s.
"""

from __future__ import annotations

import json

import openai
import pytest
from live_server import LiveServer

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]
MESSAGES = [{"role": "system", "content": "You are a helpful assistant with tools."},
            {"role": "user", "content": "What is the weather in Paris?"}]


def check_arguments(name: str, arguments: str) -> dict:
    """The arguments are a JSON object that follows the tool's schema (required keys, types, enums)."""
    args = json.loads(arguments)
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    assert set(schema["required"]) <= set(args) <= set(schema["properties"]), args
    for key, value in args.items():
        spec = schema["properties"][key]
        assert isinstance(value, {"string": str, "integer": int}[spec["type"]]), (key, value)
        assert value in spec.get("enum", [value]), (key, value)
    return args


def ask(server: LiveServer, **kwargs: object):
    return server.openai().chat.completions.create(
        model="skippy-cache", messages=kwargs.pop("messages", MESSAGES), tools=TOOLS, temperature=0,
        max_tokens=kwargs.pop("max_tokens", 64), **kwargs)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_required_and_named_choices_return_one_valid_call(exact_server: LiveServer, choice: object) -> None:
    out = ask(exact_server, tool_choice=choice)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == ("add" if isinstance(choice, dict) else call.function.name)
    assert call.function.name in {"get_weather", "add"}
    check_arguments(call.function.name, call.function.arguments)


def test_a_streamed_call_is_the_non_streamed_call(exact_server: LiveServer) -> None:
    whole = ask(exact_server, tool_choice="required").choices[0]
    stream = ask(exact_server, tool_choice="required", stream=True)
    calls: dict[int, dict] = {}
    finish = None
    content = ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
            if part.id:
                assert entry["id"] is None, "id and name come once per call"
                entry["id"], entry["name"] = part.id, part.function.name
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_none_returns_text_and_auto_returns_text_or_valid_calls(exact_server: LiveServer) -> None:
    none = ask(exact_server, tool_choice="none").choices[0]
    assert none.message.tool_calls is None and none.message.content
    auto = ask(exact_server).choices[0]  # tools given, no choice: auto
    for call in auto.message.tool_calls or []:
        check_arguments(call.function.name, call.function.arguments)
    assert auto.finish_reason in ("stop", "length", "tool_calls")


def test_a_call_cut_short_by_max_tokens_ends_cleanly(exact_server: LiveServer) -> None:
    out = ask(exact_server, tool_choice="required", max_tokens=5).choices[0]
    assert out.finish_reason == "length"
    assert out.message.tool_calls is None and out.message.content.startswith("<tool_call>")


def test_an_agents_next_step_reuses_its_whole_previous_step(exact_server: LiveServer) -> None:
    first = ask(exact_server, tool_choice="required")
    call = first.choices[0].message.tool_calls[0]
    step = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": 18})}]
    second = ask(exact_server, messages=step, tool_choice="none", max_tokens=8)
    # The whole first step comes from the cache, its call as the tokens the model sampled
    # (which the call's text, tokenized again, need not be: server/replies.py).
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.model_extra["skippy_cache"]["source"] == "resident"


@pytest.mark.parametrize("change, param", [
    ({"tools": [{"type": "mcp", "function": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "custom", "custom": {"name": "x", "format": {"type": "grammar", "grammar": {
        "syntax": "lark", "definition": "start: ("}}}}]}, "tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"$ref": "#/nowhere"}}}]}, "tools"),
    ({"messages": [*MESSAGES, {"role": "tool", "tool_call_id": "call_missing", "content": "1"}]}, "messages"),
], ids=["other-type", "bad-custom-grammar", "unknown-named", "bad-name", "bad-schema", "orphan-result"])
def test_bad_tools_are_400s_naming_the_field(server: LiveServer, change: dict, param: str) -> None:
    body = {"model": "skippy-cache", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **change}
    response = server.http().post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    with pytest.raises(openai.BadRequestError):
        server.openai().chat.completions.create(**body)


def test_the_legacy_functions_are_answered_in_kind(exact_server: LiveServer) -> None:
    functions = [tool["function"] for tool in TOOLS]
    client = exact_server.openai()
    whole = client.chat.completions.create(model="m", messages=MESSAGES, functions=functions,
                                           function_call={"name": "get_weather"}, temperature=0, max_tokens=64)
    choice = whole.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    call = choice.message.function_call
    assert call.name == "get_weather"
    check_arguments(call.name, call.arguments)
    streamed = {"name": "", "arguments": ""}
    for chunk in client.chat.completions.create(model="m", messages=MESSAGES, functions=functions,
                                                function_call={"name": "get_weather"}, temperature=0, max_tokens=64,
                                                stream=True):
        part = chunk.choices[0].delta.function_call if chunk.choices else None
        if part is not None:
            streamed["name"] += part.name or ""
            streamed["arguments"] += part.arguments or ""
        finish = chunk.choices[0].finish_reason if chunk.choices else None
    assert streamed == {"name": call.name, "arguments": call.arguments} and finish == "function_call"
    # The result goes back as a `function` message; the next step reuses the whole first one.
    step = [*MESSAGES, {"role": "assistant", "content": None, "function_call": call.model_dump()},
            {"role": "function", "name": call.name, "content": "18 C"}]
    second = client.chat.completions.create(model="m", messages=step, functions=functions, function_call="none",
                                            temperature=0, max_tokens=8)
    assert second.choices[0].message.function_call is None
    assert second.usage.prompt_tokens_details.cached_tokens >= whole.usage.prompt_tokens + whole.usage.completion_tokens
