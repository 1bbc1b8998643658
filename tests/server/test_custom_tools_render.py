"""Custom (freeform) tools with no model: how the tools, a call and its result render, that a
turn's prompt and reply are a prefix of the next turn's, how a reply splits into calls however it
streams, and which tool and choice shapes each API takes."""

from __future__ import annotations

import pytest
from chat_templates import QWEN25, SMOLLM2
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from skippy_cache.server.chat import ChatFormatter, choose_chat_template
from skippy_cache.server.openai_responses import ResponsesRequest, to_job
from skippy_cache.server.schemas import ChatCompletionRequest
from skippy_cache.server.tenants import Scope
from skippy_cache.server.tools import (
    CallSplitter,
    call_grammar,
    custom_call_text,
    render_messages,
    split_reply,
    uses_custom,
)

PATCH = {"type": "custom", "custom": {"name": "apply_patch", "description": "Apply a patch",
                                      "format": {"type": "grammar", "grammar": {
                                          "syntax": "lark", "definition": 'start: "*** Begin Patch\\n" /[^*]*/ '
                                                                          '"*** End Patch"'}}}}
NOTE = {"type": "custom", "custom": {"name": "note"}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
INPUT = "*** Begin Patch\n+ {\"a\": 1}\n</tool>\n*** End Patch"
CALL = {"id": "call_1", "type": "custom", "custom": {"name": "apply_patch", "input": INPUT}}


def render(messages: list[dict], tools: list[dict], template: str = SMOLLM2) -> str:
    body = ChatCompletionRequest.model_validate({"messages": messages, "tools": tools})
    chat = ChatFormatter(choose_chat_template(None, template, "llama"), bos_token="", eos_token="")
    # As generation.py decides: a template's own tool rendering knows no custom tools.
    native = chat.caps.tools and not uses_custom(body.messages, body.tools or [])
    rendered = render_messages(body.messages, body.tools or [], lambda _call_id: None, native=native)
    return chat.render(rendered, (body.tools or []) if native else [])


@pytest.mark.parametrize("template", [SMOLLM2, QWEN25], ids=["fallback", "native-template"])
def test_a_custom_call_and_its_result_render_as_text_in_the_fallback(template: str) -> None:
    text = render([{"role": "user", "content": "Fix it."},
                   {"role": "assistant", "content": None, "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "Done."}], [PATCH, WEATHER], template)
    assert '{"type": "custom", "custom": {"name": "apply_patch"' in text
    assert "To call a custom tool, write its name, then its input as plain text" in text
    # The input is written as it is: not escaped into a JSON string.
    assert f'<tool_call>\n{{"name": "apply_patch"}}\n{INPUT}\n</tool_call>' in text
    assert "<tool_response>\nDone.\n</tool_response>" in text


def test_the_custom_sentence_is_only_there_with_custom_tools() -> None:
    text = render([{"role": "user", "content": "Hi."}], [WEATHER])
    assert "custom tool" not in text


def test_a_custom_turns_prompt_and_reply_are_a_prefix_of_the_next_turns_prompt() -> None:
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Fix it."}]
    prompt = render(first, [PATCH, NOTE])
    reply = custom_call_text("apply_patch", INPUT)
    second = render([*first, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "Done."}], [PATCH, NOTE])
    assert second.startswith(prompt + reply)


@given(st.text(alphabet=st.sampled_from('ab {}"\\\n<>/*_'), max_size=40),
       st.lists(st.integers(min_value=1, max_value=60), max_size=8), st.booleans())
def test_a_custom_call_splits_the_same_however_it_streams(body: str, cuts: list[int], incremental: bool) -> None:
    # Whatever the input holds (braces, quotes, line breaks, the start of a tag), short of the
    # closing tag itself, it comes back as written, in one piece or in many.
    body = body.replace("</tool_call>", "")
    reply = "Sure." + "\n" + custom_call_text("note", body)
    whole_text, whole_calls = split_reply(reply, set(), incremental=incremental, custom=frozenset({"note"}))
    assert whole_text == "Sure."
    assert [(c.name, c.arguments, c.custom) for c in whole_calls] == [("note", body, True)]
    splitter = CallSplitter(set(), incremental=incremental, custom=frozenset({"note"}))
    deltas = []
    at = 0
    for cut in cuts:
        deltas += splitter.feed(reply[at: at + cut])
        at += cut
    deltas += splitter.feed(reply[at:]) + splitter.finish()
    assert "".join(d.text for d in deltas) == "Sure."
    assert "".join(d.arguments for d in deltas) == body
    assert [(c.name, c.arguments) for c in splitter.calls] == [("note", body)]


def test_a_function_and_a_custom_call_in_one_reply_both_come_back() -> None:
    reply = custom_call_text("note", "x = {1}") + "\n" + '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    _, calls = split_reply(reply, {"get_weather"}, custom=frozenset({"note"}))
    assert [(c.name, c.arguments, c.custom) for c in calls] == [("note", "x = {1}", True), ("get_weather", "{}", False)]


def test_a_custom_name_written_as_a_function_call_stays_text() -> None:
    reply = '<tool_call>\n{"name": "note", "arguments": {}}\n</tool_call>'
    text, calls = split_reply(reply, {"get_weather"}, custom=frozenset({"note"}))
    assert calls == [] and text == reply


def test_the_call_grammar_takes_custom_tools_and_names_a_bad_grammar() -> None:
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "tools": [PATCH, NOTE, WEATHER]})
    for mode in ("required", "auto", "apply_patch", "note"):
        assert call_grammar(body.tools or [], mode, parallel=False)
    bad = {"type": "custom", "custom": {"name": "bad", "format": {"type": "grammar", "grammar": {
        "syntax": "regex", "definition": "(unclosed"}}}}
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [bad]})
    with pytest.raises(ValueError, match="custom tool 'bad'.*regex grammar cannot be used"):
        call_grammar(body.tools or [], "required", parallel=False)


@pytest.mark.parametrize(("tool", "message"), [
    ({"type": "custom"}, "has its spec under 'custom'"),
    ({"type": "custom", "function": {"name": "f"}}, "has its spec under 'custom'"),
    ({"type": "custom", "custom": {"name": "a b"}}, "String should match pattern"),
    ({"type": "custom", "custom": {"name": "n", "format": {"type": "grammar"}}}, "'grammar' is given"),
    ({"type": "custom", "custom": {"name": "n", "format": {"type": "grammar", "grammar": {
        "syntax": "ebnf", "definition": "x"}}}}, "'lark' or 'regex'"),
    ({"type": "mcp", "server_label": "x"}, "tool type 'mcp' is not supported"),
], ids=["no-spec", "wrong-spec", "bad-name", "grammar-missing", "bad-syntax", "other-type"])
def test_a_bad_chat_custom_tool_is_refused_by_name(tool: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [tool]})


def test_a_chat_custom_tool_choice_names_a_custom_tool() -> None:
    messages = [{"role": "user", "content": "x"}]
    body = ChatCompletionRequest.model_validate({"messages": messages, "tools": [NOTE, WEATHER],
                                                 "tool_choice": {"type": "custom", "custom": {"name": "note"}}})
    assert body.tool_mode == "note"
    with pytest.raises(ValidationError, match="the custom tool 'get_weather' is not among 'tools'"):
        ChatCompletionRequest.model_validate({"messages": messages, "tools": [NOTE, WEATHER], "tool_choice": {
            "type": "custom", "custom": {"name": "get_weather"}}})


def test_responses_custom_tools_items_and_choice_become_the_chat_job() -> None:
    body = ResponsesRequest.model_validate({
        "input": [{"role": "user", "content": "Fix it."},
                  {"type": "custom_tool_call", "call_id": "call_9", "name": "apply_patch", "input": INPUT},
                  {"type": "custom_tool_call_output", "call_id": "call_9", "output": "Done."}],
        "tools": [{"type": "custom", "name": "apply_patch", "format": {
            "type": "grammar", "syntax": "regex", "definition": "[a-z]+"}},
                  {"type": "custom", "name": "note"}, {"type": "function", "name": "f"}],
        "tool_choice": {"type": "custom", "name": "apply_patch"}})
    job = to_job(body, Scope(None))
    assert job.tool_mode == "apply_patch" and job.custom_names == {"apply_patch", "note"}
    assert job.tool_names == {"f"}
    call = job.messages[1].tool_calls[0]
    assert call.is_custom and call.payload == INPUT and job.messages[2].role == "tool"
    with pytest.raises(ValidationError, match="the custom tool 'f' is not among 'tools'"):
        ResponsesRequest.model_validate({"input": "x", "tools": [{"type": "function", "name": "f"}],
                                         "tool_choice": {"type": "custom", "name": "f"}})
    with pytest.raises(ValidationError, match="two tools have the same name"):
        ResponsesRequest.model_validate({"input": "x", "tools": [{"type": "function", "name": "f"},
                                                                 {"type": "custom", "name": "f"}]})
