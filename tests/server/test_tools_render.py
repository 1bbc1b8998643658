"""Tool calls' rendering and parsing (server/tools.py), with no model: what the prompt holds,
that a turn's prompt and reply are a prefix of the next turn's, and that a reply splits into text
and calls the same way however it streams."""

from __future__ import annotations

import json

from chat_templates import QWEN25, SMOLLM2
from hypothesis import given
from hypothesis import strategies as st

from skippy_cache.server.chat import ChatFormatter, choose_chat_template
from skippy_cache.server.schemas import ChatCompletionRequest
from skippy_cache.server.tools import CallSplitter, call_text, render_messages, split_reply

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def render(messages: list[dict], tools: list[dict], template: str = SMOLLM2,
           recall: dict[str, str] | None = None) -> str:
    """The prompt as the server renders it: natively where the template renders tools itself."""
    body = ChatCompletionRequest.model_validate({"messages": messages, "tools": tools})
    chat = ChatFormatter(choose_chat_template(None, template, "llama"), bos_token="", eos_token="")
    native = chat.caps.tools
    rendered = render_messages(body.messages, body.tools or [], (recall or {}).get, native=native)
    return chat.render(rendered, body.tools or [] if native else [])


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


def test_smollm2s_template_gets_the_fallback_and_qwens_renders_tools_itself() -> None:
    smollm2 = ChatFormatter(choose_chat_template(None, SMOLLM2, "llama"), bos_token="", eos_token="")
    qwen = ChatFormatter(choose_chat_template(None, QWEN25, "qwen2"), bos_token="", eos_token="")
    assert (smollm2.caps.tools, smollm2.caps.system_role) == (False, True)
    assert (qwen.caps.tools, qwen.caps.system_role) == (True, True)


def test_a_native_template_renders_tools_calls_and_results_as_it_intends() -> None:
    text = render([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
        {"role": "tool", "tool_call_id": "call_1", "content": "again"},
    ], [WEATHER], QWEN25)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the "
        "user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(WEATHER) + "\n</tools>\n\nFor each function call, return a json object with function name "
        "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
        "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        # Qwen's template puts consecutive results in one user turn.
        '<|im_start|>user\n<tool_response>\n{"temp": 18}\n</tool_response>\n<tool_response>\nagain\n'
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_a_native_templates_next_turn_starts_with_the_turn_and_its_reply_as_generated() -> None:
    first = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = render(first, [WEATHER], QWEN25)
    # As the model wrote it (the grammar lets it space the JSON its own way).
    reply = call_text("get_weather", '{ "city":"Paris" }')
    call = {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*first, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    # The server remembers the reply it returned for call_1, and renders it as it was.
    assert render(history, [WEATHER], QWEN25, recall={"call_1": reply}).startswith(prompt + reply)
    # Forgotten (another replica, a restart), the template's own spelling: only the cache misses.
    assert not render(history, [WEATHER], QWEN25).startswith(prompt + reply)
    # A remembered reply that says something else is not used.
    other = call_text("get_weather", '{"city": "Rome"}')
    assert not render(history, [WEATHER], QWEN25, recall={"call_1": other}).startswith(prompt + other)


def test_a_template_without_a_system_role_gets_it_in_the_first_user_turn() -> None:
    template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
                "{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    chat = ChatFormatter(choose_chat_template(None, template, "gemma2"), bos_token="", eos_token="")
    assert not chat.caps.system_role
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": "Hi"}]})
    assert chat.render(body.messages) == "[user] Be brief.\n\nHi\n"


NAMES = {"get_weather", "add"}
PIECES = st.sampled_from([
    "Sure.", " ", "\n", "text <b>", "<tool_", "call>", "</tool_call>",
    call_text("get_weather", '{"city": "Paris"}'), call_text("add", '{ "a": 1, "b": 2 } '),
    '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', "<tool_call>\n{broken\n</tool_call>",
])


@given(st.lists(PIECES, max_size=8), st.data())
def test_a_reply_splits_the_same_however_it_streams(pieces: list[str], data: st.DataObject) -> None:
    text = "".join(pieces)
    check_streams_alike(text, data, incremental=False)


#: What a grammar lets a required / named reply be: calls, whitespace between, maybe cut short.
CALLS = st.sampled_from([call_text("get_weather", '{"city": "Pa}ris"}'), call_text("add", '{ "a": 1, "b": {"c": 2} } '),
                         "\n", call_text("add", "{}")])


@given(st.lists(CALLS, min_size=1, max_size=4), st.integers(0, 200), st.data())
def test_calls_stream_as_generated_and_split_the_same_however_they_stream(pieces: list[str], cut: int,
                                                                         data: st.DataObject) -> None:
    text = "".join(pieces)
    check_streams_alike(text[: max(1, len(text) - cut)], data, incremental=True)


def check_streams_alike(text: str, data: st.DataObject, *, incremental: bool) -> None:
    """Fed in any pieces, the splitter gives what it gives the whole text: the same text and
    calls, and each call's argument fragments concatenate to its arguments."""
    whole_text, whole_calls = split_reply(text, NAMES, incremental=incremental)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12))) if len(text) > 1 else []
    splitter = CallSplitter(NAMES, incremental=incremental)
    deltas = []
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        deltas += splitter.feed(text[start:end])
    deltas += splitter.finish()
    assert "".join(d.text for d in deltas) == whole_text
    assert [(c.name, c.arguments) for c in splitter.calls] == [(c.name, c.arguments) for c in whole_calls]
    streamed: list[str] = []
    for delta in deltas:
        if delta.call is not None:
            streamed.append("")
        streamed[-1:] = [streamed[-1] + delta.arguments] if streamed else []
        if delta.done is not None:
            assert streamed[-1] == delta.done.arguments
    assert streamed == [c.arguments for c in splitter.calls]


def test_calls_keep_their_arguments_as_generated_and_unknown_or_broken_blocks_stay_text() -> None:
    text, calls = split_reply("Sure.\n" + call_text("add", '{ "a": 1, "b": 2 } '), NAMES)
    assert text == "Sure." and [(c.name, c.arguments) for c in calls] == [("add", '{ "a": 1, "b": 2 } ')]
    odd = '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    assert split_reply(odd, NAMES) == (odd, [])
    # Another spelling of a known tool's call is a call; its arguments are re-serialised.
    _, [call] = split_reply('<tool_call>{"arguments": {"a": 1, "b": 2}, "name": "add"}</tool_call>', NAMES)
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 1, "b": 2})


def test_tools_alone_render_as_a_system_message_when_no_message_is_left() -> None:
    # An Anthropic body of only a prefill leaves no chat message before it; the tools still go first.
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]})
    rendered = render_messages([], body.tools or [])
    assert [m.role for m in rendered] == ["system"] and "get_weather" in (rendered[0].content or "")
