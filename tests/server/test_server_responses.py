"""POST /v1/responses through the official openai client, on the real model.

Stateless: the whole history goes in `input` every time, and the cache makes that cheap. Checked:
`required` and a named function make the output one valid function_call; streamed equals
non-streamed (exact mode) with the Responses event sequence; `none` returns a message; a small
`max_output_tokens` ends the response `incomplete`; an agent's next step reuses the whole previous
step; `text.format` constrains the reply; bad input is a 400 naming the field.
"""

from __future__ import annotations

import json

import openai
import pytest
from live_server import LiveServer
from test_server_tools import check_arguments

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "unit": {"type": "string", "enum": ["c", "f"]}},
                    "required": ["city"], "additionalProperties": False}},
    {"type": "function", "name": "add", "description": "Add two integers",
     "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"], "additionalProperties": False}},
]
INSTRUCTIONS = "You are a helpful assistant with tools."
INPUT = [{"role": "user", "content": "What is the weather in Paris?"}]


def ask(server: LiveServer, **kwargs: object):
    return server.openai().responses.create(
        model="skippy-cache", instructions=INSTRUCTIONS, input=kwargs.pop("input", INPUT),
        tools=kwargs.pop("tools", TOOLS), temperature=0, max_output_tokens=kwargs.pop("max_output_tokens", 64),
        **kwargs)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "add"}], ids=["required", "named"])
def test_required_and_named_return_one_valid_function_call(exact_server: LiveServer, choice: object) -> None:
    response = ask(exact_server, tool_choice=choice)
    assert response.status == "completed" and response.store is False
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].call_id.startswith("call_") and calls[0].status == "completed"
    assert calls[0].name == (choice["name"] if isinstance(choice, dict) else calls[0].name)
    check_arguments(calls[0].name, calls[0].arguments)
    usage = response.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.model_extra["skippy_cache"]["prompt_tokens"] == usage.input_tokens


def test_a_streamed_response_is_the_non_streamed_response(exact_server: LiveServer) -> None:
    whole = ask(exact_server, tool_choice="required")
    with exact_server.openai().responses.stream(
            model="skippy-cache", instructions=INSTRUCTIONS, input=INPUT, tools=TOOLS, temperature=0,
            max_output_tokens=64, tool_choice="required") as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.function_call_arguments.done" in kinds
    assert [(i.type, i.name, i.arguments) for i in streamed.output] == [
        (i.type, i.name, i.arguments) for i in whole.output]
    assert streamed.usage.input_tokens_details.cached_tokens > 0


def test_text_streams_and_max_output_tokens_ends_it_incomplete(exact_server: LiveServer) -> None:
    whole = ask(exact_server, tools=[], input="Count from one to ten.", max_output_tokens=8)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 8 and whole.output_text
    stream = exact_server.openai().responses.create(
        model="m", instructions=INSTRUCTIONS, input="Count from one to ten.", temperature=0, max_output_tokens=8,
        stream=True)
    events = list(stream)
    # OpenAI ends a cut response with response.incomplete (the client's stream helper wants
    # response.completed, so the raw events are read here).
    assert events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output[0].content[0].text == whole.output_text


def test_none_returns_a_message(exact_server: LiveServer) -> None:
    response = ask(exact_server, tool_choice="none")
    assert [item.type for item in response.output] == ["message"] and response.output_text


def test_text_format_constrains_the_reply(exact_server: LiveServer) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    response = ask(exact_server, tools=[], text={"format": {"type": "json_schema", "name": "place", "schema": schema}})
    if response.status == "completed":
        assert set(json.loads(response.output_text)) == {"city"}
    else:
        assert response.output_text.startswith("{")


def test_an_agents_steps_reuse_the_whole_previous_step(exact_server: LiveServer) -> None:
    items = list(INPUT)
    before = None
    for _ in range(3):
        response = ask(exact_server, input=items, tool_choice="required", extra_body={"cache_salt": "responses-agent"})
        usage = response.usage
        if before is not None:
            assert usage.input_tokens_details.cached_tokens >= before, usage
        before = usage.input_tokens + usage.output_tokens
        call = next(item for item in response.output if item.type == "function_call")
        # The output items go back as they came (the SDK's objects), then the call's output.
        items += [*response.output, {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}]


@pytest.mark.parametrize("change, param", [
    ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0].type"),
    ({"tools": [{"type": "custom", "name": "x", "format": {"type": "grammar", "syntax": "regex",
                                                          "definition": "(unclosed"}}]}, "tools"),
    ({"tool_choice": {"type": "function", "name": "nope"}}, None),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].message.content"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "function", "name": "x", "parameters": {"$ref": "#/nowhere"}}]}, "tools"),
], ids=["other-type", "bad-custom-grammar", "unknown-named", "previous-response", "orphan-output", "image", "item-type",
        "background", "bad-schema"])
def test_bad_input_is_a_400_naming_the_field(server: LiveServer, change: dict, param: str | None) -> None:
    body = {"model": "m", "input": INPUT, "tools": TOOLS, "max_output_tokens": 4, **change}
    response = server.http().post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error", error
    if param is not None:
        assert error["param"] == param, error
    with pytest.raises(openai.BadRequestError):
        server.openai().responses.create(**body)


def test_codexs_request_shape_is_answered_naming_what_is_ignored(exact_server: LiveServer) -> None:
    """What Codex CLI sends besides its function tools: a hosted web_search tool (left out of the
    prompt), client_metadata, reasoning summaries, include, store false, prompt_cache_key, and a
    developer message. Answered, and each ignored field named in a header."""
    body = {"model": "gpt-5-codex", "instructions": INSTRUCTIONS, "max_output_tokens": 8, "temperature": 0,
            "input": [{"type": "message", "role": "developer", "content": "Work in /repo."}, *INPUT],
            "tools": [*TOOLS, {"type": "web_search", "external_web_access": False}],
            "client_metadata": {"originator": "codex_exec"}, "reasoning": {"summary": "auto"},
            "include": ["reasoning.encrypted_content"], "store": False, "prompt_cache_key": "session-1"}
    response = exact_server.http().post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["x-skippy-ignored"] == (
        "client_metadata,include,prompt_cache_key,reasoning,tools:web_search")
    assert response.json()["status"] in ("completed", "incomplete")


def test_a_namespaced_function_is_called_back_under_its_namespace(exact_server: LiveServer) -> None:
    """Codex CLI's `namespace` tool: its functions are offered, a call to one comes back as the
    bare name with `namespace` beside it (whole and streamed alike), and sent back so it is the
    next step's history."""
    spaced = [{"type": "namespace", "name": "weather", "description": "Weather tools.",
               "tools": [{**TOOLS[0], "name": "lookup"}]}]
    body = {"model": "m", "instructions": INSTRUCTIONS, "input": INPUT, "tools": spaced, "temperature": 0,
            "tool_choice": "required", "max_output_tokens": 64}
    with exact_server.http(timeout=120) as http:
        whole = http.post("/v1/responses", json=body)
        assert whole.status_code == 200, whole.text
        call = whole.json()["output"][-1]
        assert (call["type"], call["name"], call["namespace"]) == ("function_call", "lookup", "weather"), call
        check_arguments("get_weather", call["arguments"])
        streamed = http.post("/v1/responses", json={**body, "stream": True})
        done = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
        added = next(e["item"] for e in done if e["type"] == "response.output_item.added"
                     and e["item"]["type"] == "function_call")
        assert (added["name"], added["namespace"]) == ("lookup", "weather")
        assert done[-1]["response"]["output"][-1]["arguments"] == call["arguments"]
        step = {**body, "tool_choice": "none", "max_output_tokens": 4,
                "input": [*INPUT, call, {"type": "function_call_output", "call_id": call["call_id"], "output": "18 C"}]}
        again = http.post("/v1/responses", json=step)
        assert again.status_code == 200, again.text
        assert again.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0


def test_max_output_tokens_past_the_context_is_a_bound_not_a_400(exact_server: LiveServer) -> None:
    response = ask(exact_server, tools=[], input=[{"role": "user", "content": "Say hi."}], max_output_tokens=10**6)
    assert response.status in ("completed", "incomplete") and response.output
