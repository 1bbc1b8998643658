"""Custom (freeform) tools on /v1/chat/completions and /v1/responses through the official openai
client, on the real model: a named custom tool's call is text its grammar allows (Lark or regex),
in each API's shape; streamed equals non-streamed (exact mode) with each API's events; the next
step, sending the call and its output back, reuses the whole previous step."""

from __future__ import annotations

import json
import re

import pytest
from live_server import LiveServer

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

DATE = r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"
#: Lark as OpenAI's and llguidance's grammars both take it: a tiny patch language.
PATCH_LARK = '''start: "*** Begin Patch" LF line~1..3 "*** End Patch"
line: ("+" | "-") /[a-z ]{1,20}/ LF
LF: "\\n"
'''
PATCH_SHAPE = re.compile(r"\*\*\* Begin Patch\n([+-][a-z ]{1,20}\n){1,3}\*\*\* End Patch")
CHAT_TOOLS = [
    {"type": "custom", "custom": {"name": "set_date", "description": "Set the date",
                                  "format": {"type": "grammar", "grammar": {"syntax": "regex", "definition": DATE}}}},
    {"type": "custom", "custom": {"name": "apply_patch", "description": "Edit the file with a patch",
                                  "format": {"type": "grammar", "grammar": {"syntax": "lark",
                                                                            "definition": PATCH_LARK}}}},
    {"type": "custom", "custom": {"name": "note", "description": "Write a note"}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
RESPONSES_TOOLS = [
    {"type": "custom", "name": "set_date", "description": "Set the date",
     "format": {"type": "grammar", "syntax": "regex", "definition": DATE}},
    {"type": "custom", "name": "apply_patch", "description": "Edit the file with a patch",
     "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_LARK}},
    {"type": "function", "name": "get_time", "parameters": {"type": "object"}},
]
MESSAGES = [{"role": "system", "content": "You are a coding assistant with tools."},
            {"role": "user", "content": "Add a line saying hello to the file."}]


def chat(server: LiveServer, name: str, **kwargs: object):
    return server.openai().chat.completions.create(
        model="skippy-cache", messages=kwargs.pop("messages", MESSAGES), tools=CHAT_TOOLS, temperature=0,
        max_tokens=kwargs.pop("max_tokens", 48), tool_choice={"type": "custom", "custom": {"name": name}}, **kwargs)


@pytest.mark.parametrize(("name", "shape"), [("set_date", re.compile(DATE)), ("apply_patch", PATCH_SHAPE)],
                         ids=["regex", "lark"])
def test_a_named_custom_tool_is_called_with_input_its_grammar_allows(exact_server: LiveServer, name: str,
                                                                      shape: re.Pattern) -> None:
    out = chat(exact_server, name, max_tokens=160)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "custom" and call.id.startswith("call_") and call.custom.name == name
    assert shape.fullmatch(call.custom.input), call.custom.input


def test_a_free_text_custom_call_ends_at_its_closing_tag(exact_server: LiveServer) -> None:
    out = chat(exact_server, "note", max_tokens=200)
    choice = out.choices[0]
    call = choice.message.tool_calls[0]
    assert call.type == "custom" and call.custom.name == "note"
    if choice.finish_reason == "tool_calls":
        assert "</tool_call>" not in call.custom.input
    else:  # the model wrote past max_tokens: the call stays a call with the input it got
        assert choice.finish_reason == "length"


def test_a_streamed_custom_call_is_the_non_streamed_call(exact_server: LiveServer) -> None:
    whole = chat(exact_server, "apply_patch", max_tokens=160).choices[0].message.tool_calls[0]
    heads, pieces = [], []
    with exact_server.http(timeout=120) as http, http.stream("POST", "/v1/chat/completions", json={
            "model": "m", "messages": MESSAGES, "tools": CHAT_TOOLS, "temperature": 0, "max_tokens": 160,
            "stream": True, "tool_choice": {"type": "custom", "custom": {"name": "apply_patch"}}}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for part in (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("tool_calls", []):
                if "id" in part:
                    heads.append(part)
                pieces.append(part["custom"]["input"])
    assert len(heads) == 1 and heads[0]["type"] == "custom" and heads[0]["custom"]["name"] == "apply_patch"
    assert "".join(pieces) == whole.custom.input
    assert len(pieces) > 2, "the input streams as it is generated"


def test_a_chat_agents_next_step_reuses_the_custom_call(exact_server: LiveServer) -> None:
    first = chat(exact_server, "apply_patch", extra_body={"cache_salt": "custom-agent"}, max_tokens=160)
    call = first.choices[0].message.tool_calls[0]
    messages = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "Patched."}]
    second = chat(exact_server, "set_date", messages=messages, extra_body={"cache_salt": "custom-agent"})
    assert second.choices[0].message.tool_calls[0].type == "custom"
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + first.usage.completion_tokens


def responses(server: LiveServer, name: str, **kwargs: object):
    return server.openai().responses.create(
        model="skippy-cache", instructions=MESSAGES[0]["content"], input=kwargs.pop("input", MESSAGES[1:]),
        tools=RESPONSES_TOOLS, temperature=0, max_output_tokens=160, tool_choice={"type": "custom", "name": name},
        **kwargs)


def test_responses_custom_call_streams_as_it_comes_whole_and_is_reused_next_step(exact_server: LiveServer) -> None:
    whole = responses(exact_server, "apply_patch", extra_body={"cache_salt": "custom-responses"})
    assert whole.status == "completed"
    calls = [item for item in whole.output if item.type == "custom_tool_call"]
    assert len(calls) == 1 and calls[0].name == "apply_patch" and calls[0].call_id.startswith("call_")
    assert calls[0].id.startswith("ctc_") and PATCH_SHAPE.fullmatch(calls[0].input), calls[0].input
    with exact_server.openai().responses.stream(
            model="skippy-cache", instructions=MESSAGES[0]["content"], input=MESSAGES[1:], tools=RESPONSES_TOOLS,
            temperature=0, max_output_tokens=160, tool_choice={"type": "custom", "name": "apply_patch"}) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    kinds = [event.type for event in events]
    assert "response.custom_tool_call_input.delta" in kinds and "response.custom_tool_call_input.done" in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
    assert deltas == calls[0].input
    assert [(i.type, i.name, i.input) for i in streamed.output] == [(i.type, i.name, i.input) for i in whole.output]
    # The call and its output go back as items; the next step reuses all of the first.
    items = [*MESSAGES[1:], *whole.output,
             {"type": "custom_tool_call_output", "call_id": calls[0].call_id, "output": "Patched."}]
    second = responses(exact_server, "set_date", input=items, extra_body={"cache_salt": "custom-responses"})
    assert re.fullmatch(DATE, next(i for i in second.output if i.type == "custom_tool_call").input)
    before = whole.usage.input_tokens + whole.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= before, second.usage
