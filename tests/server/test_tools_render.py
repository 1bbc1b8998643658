"""Tool calls' rendering and parsing (server/tools.py), with no model: what the prompt holds,
that a turn's prompt and reply are a prefix of the next turn's, and that a reply splits into text
and calls the same way however it streams."""

from __future__ import annotations

import json

from chat_templates import SMOLLM2
from hypothesis import given
from hypothesis import strategies as st

from skippy_cache.server.chat import ChatFormatter, choose_chat_template
from skippy_cache.server.schemas import ChatCompletionRequest
from skippy_cache.server.tools import CallSplitter, call_text, render_messages, split_reply

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def render(messages: list[dict], tools: list[dict]) -> str:
    body = ChatCompletionRequest.model_validate({"messages": messages, "tools": tools})
    chat = ChatFormatter(choose_chat_template(None, SMOLLM2, "llama"), bos_token="", eos_token="")
    return chat.render(render_messages(body.messages, body.tools or []))


def test_tools_calls_and_results_render_in_the_fallback_syntax() -> None:
    text = render([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
    ], [WEATHER])
    assert text == (
        "<|im_start|>system\nBe brief.\n\n"
        "You may call one or more functions to answer. The functions, as JSON schemas:\n<tools>\n"
        + json.dumps(WEATHER) + "\n</tools>\n"
        "To call a function, answer with a <tool_call></tool_call> block holding a JSON object with its name "
        "and arguments, one block per call:\n"
        '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp": 18}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


def test_a_turns_prompt_and_reply_are_a_prefix_of_the_next_turns_prompt() -> None:
    # Without a system message the tools block becomes one; the call is re-rendered as generated.
    first = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = render(first, [WEATHER])
    reply = call_text("get_weather", '{"city": "Paris"}')
    second = render([*first, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}], [WEATHER])
    assert second.startswith(prompt + reply)
    assert "You are a helpful AI assistant named SmolLM" not in prompt  # the tools block is the system message


NAMES = {"get_weather", "add"}
PIECES = st.sampled_from([
    "Sure.", " ", "\n", "text <b>", "<tool_", "call>", "</tool_call>",
    call_text("get_weather", '{"city": "Paris"}'), call_text("add", '{ "a": 1, "b": 2 } '),
    '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', "<tool_call>\n{broken\n</tool_call>",
])


@given(st.lists(PIECES, max_size=8), st.data())
def test_a_reply_splits_the_same_however_it_streams(pieces: list[str], data: st.DataObject) -> None:
    text = "".join(pieces)
    whole_text, whole_calls = split_reply(text, NAMES)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12))) if len(text) > 1 else []
    splitter = CallSplitter(NAMES)
    deltas = []
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        deltas += splitter.feed(text[start:end])
    deltas += splitter.finish()
    assert "".join(d.text for d in deltas) == whole_text
    assert [(c.name, c.arguments) for c in splitter.calls] == [(c.name, c.arguments) for c in whole_calls]


def test_calls_keep_their_arguments_as_generated_and_unknown_or_broken_blocks_stay_text() -> None:
    text, calls = split_reply("Sure.\n" + call_text("add", '{ "a": 1, "b": 2 } '), NAMES)
    assert text == "Sure." and [(c.name, c.arguments) for c in calls] == [("add", '{ "a": 1, "b": 2 } ')]
    odd = '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    assert split_reply(odd, NAMES) == (odd, [])
    # Another spelling of a known tool's call is a call; its arguments are re-serialised.
    _, [call] = split_reply('<tool_call>{"arguments": {"a": 1, "b": 2}, "name": "add"}</tool_call>', NAMES)
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 1, "b": 2})
