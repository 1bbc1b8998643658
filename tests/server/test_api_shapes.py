"""The Messages and Responses bodies as chat jobs (server/anthropic.py, server/openai_responses.py),
with no model: one internal shape whichever API a request came through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_templates import SMOLLM2
from pydantic import ValidationError

from skippy_cache.runtime import SamplingParams, json_grammar
from skippy_cache.server.anthropic import GenerateRequest, rewrite_billing_line
from skippy_cache.server.anthropic import to_job as messages_job
from skippy_cache.server.chat import ChatFormatter, choose_chat_template
from skippy_cache.server.errors import APIError
from skippy_cache.server.generation import tool_sampling
from skippy_cache.server.jobs import ChatJob
from skippy_cache.server.openai_responses import ResponsesRequest
from skippy_cache.server.openai_responses import to_job as responses_job
from skippy_cache.server.schemas import ChatMessage, ToolSpec
from skippy_cache.server.tenants import Scope

#: A server without tenants: the jobs carry `cache_salt` as their namespace.
NO_TENANTS = Scope(None)

TOOL = {"name": "add", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}


def test_the_billing_lines_checksum_is_made_constant_and_nothing_else_changes() -> None:
    line = "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; cch=5a1f3;"
    assert rewrite_billing_line(line) == "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; cch=fffff;"
    assert rewrite_billing_line(line + "\nYou are Claude Code. cch=12345;").endswith("cch=12345;")
    assert rewrite_billing_line("You are helpful. cch=12345;") == "You are helpful. cch=12345;"


def test_a_messages_history_becomes_chat_messages_in_order() -> None:
    body = GenerateRequest.model_validate({
        "model": "m", "max_tokens": 8, "tools": [TOOL], "tool_choice": {"type": "any"},
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=00001;"}, {"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Add 1."},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "text", "text": "Sure."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "2"},
                                         {"type": "text", "text": "And again?"}]},
            {"role": "assistant", "content": "The answer is"},
        ]})
    job = messages_job(body, NO_TENANTS)
    assert [(m.role, m.content) for m in job.messages] == [
        ("system", "x-anthropic-billing-header: cch=fffff;\nBe brief."), ("user", "Add 1."), ("assistant", "Sure."),
        ("tool", "2"), ("user", "And again?")]
    call = job.messages[2].tool_calls[0]
    assert (call.id, call.function.name, call.function.arguments) == ("toolu_1", "add", '{"a": 1}')
    assert job.prefill == "The answer is" and job.tool_mode == "required" and not job.parallel
    assert job.max_tokens == 8 and job.sampling.temperature == 1.0


@pytest.mark.parametrize("choice, mode", [({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
                                          ({"type": "tool", "name": "add"}, "add"), (None, "auto")])
def test_anthropic_tool_choices_map_to_the_chat_ones(choice: dict | None, mode: str) -> None:
    body = {"model": "m", "max_tokens": 1, "tools": [TOOL], "messages": [{"role": "user", "content": "x"}]}
    request = GenerateRequest.model_validate({**body, "tool_choice": choice} if choice else body)
    job = messages_job(request, NO_TENANTS)
    assert job.tool_mode == mode and [t.function.name for t in job.tools] == ["add"]


def test_a_tool_result_must_answer_an_earlier_call() -> None:
    body = GenerateRequest.model_validate({"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "1"}]}]})
    with pytest.raises(APIError, match="toolu_9"):
        messages_job(body, NO_TENANTS)


def test_a_responses_input_becomes_chat_messages_with_one_reply_per_run_of_calls() -> None:
    body = ResponsesRequest.model_validate({
        "instructions": "Be brief.", "tools": [{"type": "function", "name": "add"}], "max_output_tokens": 9,
        "input": [
            {"role": "user", "content": "Add twice."},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
            {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": "{}"},
            {"type": "function_call", "call_id": "call_2", "name": "add", "arguments": "{}"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call_output", "call_id": "call_1", "output": "1"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "2"}]},
        ]})
    job = responses_job(body, NO_TENANTS)
    assert [(m.role, m.content) for m in job.messages] == [
        ("system", "Be brief."), ("user", "Add twice."), ("assistant", "Sure."), ("tool", "1"), ("tool", "2")]
    assert [c.id for c in job.messages[2].tool_calls] == ["call_1", "call_2"]
    assert job.tool_mode == "auto" and job.max_tokens == 9 and job.prompt_param == "input"


def test_responses_refuses_what_needs_a_stored_response() -> None:
    with pytest.raises(ValidationError, match="stores none"):
        ResponsesRequest.model_validate({"input": "x", "previous_response_id": "resp_1"})


def test_each_tool_choice_gets_its_grammar() -> None:
    tools = [ToolSpec.model_validate({"type": "function", "function": {"name": "add"}})]
    job = ChatJob(sampling=SamplingParams(), max_tokens=1, messages=[ChatMessage(role="user", content="x")],
                  tools=tools)
    required = tool_sampling(ChatJob(**{**job.__dict__, "tool_mode": "required"}))
    head = 'one: "<tool_call>\\n{\\"name\\": \\"add\\", \\"arguments\\": " value0'
    assert required.grammar_trigger is None and head in required.grammar
    # auto: a call once the reply opens one, from just after its opening tag.
    auto = tool_sampling(ChatJob(**{**job.__dict__, "tool_mode": "auto"}))
    assert auto.grammar_trigger == "<tool_call>" and head.replace("<tool_call>", "") in auto.grammar
    assert tool_sampling(ChatJob(**{**job.__dict__, "tool_mode": "none"})).grammar is None
    # A response_format grammar holds the whole reply already: auto adds none, required refuses.
    shaped = SamplingParams(grammar=json_grammar())
    assert tool_sampling(ChatJob(**{**job.__dict__, "tool_mode": "auto", "sampling": shaped})) == shaped
    with pytest.raises(APIError, match="response_format"):
        tool_sampling(ChatJob(**{**job.__dict__, "tool_mode": "required", "sampling": shaped}))


def test_claude_codes_first_request_as_captured_parses_renders_and_compiles() -> None:
    """The first request Claude Code 2.1.328 sent (`claude -p "Say hello."`, captured; ids zeroed):
    its harness context in a system turn after the user turn, an effort on that turn, a deferred
    tool, context_management, adaptive thinking. Accepted, each ignored field named; the system
    turn kept where it stands; every tool's schema compiles (one is a bare description)."""
    body = json.loads((Path(__file__).parent / "clients" / "claude-code-2.1.328-first-request.json").read_text())
    request = GenerateRequest.model_validate(body)
    assert request.ignored_fields() == ["context_management", "messages[].output_config", "metadata", "thinking",
                                        "tools[].defer_loading"]
    job = messages_job(request, Scope(tenant=None))
    assert [m.role for m in job.messages] == ["system", "user", "system"]
    assert job.max_tokens_bound and job.tool_mode == "auto"
    sampling = tool_sampling(job)
    assert sampling.grammar is not None and sampling.grammar_trigger == "<tool_call>"
    chat = ChatFormatter(choose_chat_template(None, SMOLLM2, "llama"), bos_token="", eos_token="")
    text = chat.render(job.messages, job.tools)
    assert text.index("Say hello.") < text.index("<|im_start|>system\n# Environment")


def test_claude_codes_bare_request_with_an_empty_system_turn_is_taken() -> None:
    """`claude -p --bare --tools "" --system-prompt ...` (2.1.328, captured): no tools, and the
    harness-context turn after the user turn sent with no content. Anthropic's API takes it; it
    renders as nothing, where an empty user turn is still a 400."""
    body = json.loads((Path(__file__).parent / "clients" / "claude-code-2.1.328-bare-request.json").read_text())
    request = GenerateRequest.model_validate(body)
    assert request.messages[-1].role == "system" and not request.messages[-1].content
    job = messages_job(request, NO_TENANTS)
    assert [m.role for m in job.messages] == ["system", "user"] and job.tool_mode == "none"
    assert job.messages[1].content == "Say hello."
    empty_user = {**body, "messages": [*body["messages"], {"role": "user", "content": []}]}
    with pytest.raises(APIError, match="non-empty content"):
        messages_job(GenerateRequest.model_validate(empty_user), NO_TENANTS)
    nothing_else = {**body, "messages": [{"role": "system", "content": []}]}
    with pytest.raises(APIError, match="at least one message must have content"):
        messages_job(GenerateRequest.model_validate(nothing_else), NO_TENANTS)


def test_codexs_first_request_as_captured_parses_with_its_namespace_flattened() -> None:
    """The first request Codex CLI 0.169.0 sent (`codex exec "Say hello."`, captured; ids zeroed):
    developer messages, a `namespace` tool holding five functions, a hosted web_search,
    client_metadata, prompt_cache_key, reasoning and include. Accepted, each ignored field named;
    the namespace's functions offered as NAMESPACE.NAME; every tool's schema compiles."""
    body = json.loads((Path(__file__).parent / "clients" / "codex-0.169.0-first-request.json").read_text())
    request = ResponsesRequest.model_validate(body)
    assert request.ignored_fields() == ["client_metadata", "include", "prompt_cache_key", "reasoning",
                                        "tools:web_search"]
    job = responses_job(request, NO_TENANTS)
    assert [m.role for m in job.messages] == ["developer", "developer", "user", "user"]
    names = [t.function.name for t in job.tools]
    assert "multi_agent_v1.spawn_agent" in names and "exec_command" in names and len(names) == 12
    sampling = tool_sampling(job)
    assert sampling.grammar is not None and '\\"multi_agent_v1.spawn_agent\\"' in sampling.grammar


def test_codexs_request_with_its_freeform_apply_patch_parses_and_its_grammar_compiles() -> None:
    """What Codex CLI 0.169.0 sends for a model whose catalog entry says `apply_patch_tool_type:
    freeform` (captured; ids zeroed): apply_patch as a custom tool whose input follows Codex's Lark
    patch grammar. The tool is offered; its grammar joins the call grammar, and a call of it
    under auto is text, split back out as a custom call."""
    body = json.loads((Path(__file__).parent / "clients" / "codex-0.169.0-freeform-request.json").read_text())
    job = responses_job(ResponsesRequest.model_validate(body), NO_TENANTS)
    patch = next(t for t in job.tools if t.is_custom)
    assert patch.name == "apply_patch" and patch.custom.format.grammar.syntax == "lark"
    assert job.custom_names == {"apply_patch"} and "exec_command" in (job.tool_names or set())
    sampling = tool_sampling(job)
    assert sampling.grammar_trigger == "<tool_call>" and "*** Begin Patch" in (sampling.grammar or "")


def test_a_namespaced_call_goes_back_into_the_prompt_under_its_qualified_name() -> None:
    namespace = {"type": "namespace", "name": "agents", "description": "Sub-agents.",
                 "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}}]}
    body = ResponsesRequest.model_validate({"tools": [namespace, {"type": "function", "name": "spawn"}], "input": [
        {"role": "user", "content": "Go."},
        {"type": "function_call", "call_id": "c1", "name": "spawn", "namespace": "agents", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]})
    job = responses_job(body, NO_TENANTS)
    assert [t.function.name for t in job.tools] == ["agents.spawn", "spawn"]
    assert job.messages[1].tool_calls[0].function.name == "agents.spawn"


@pytest.mark.parametrize("tools", [
    [{"type": "namespace", "name": "a", "tools": []}],
    [{"type": "namespace", "name": "a.b", "tools": [{"type": "function", "name": "f"}]}],
    [{"type": "namespace", "name": "a", "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}],
    [{"type": "namespace", "name": "a", "tools": [{"type": "custom", "name": "f"}]}],
    [{"type": "function", "name": "a.f"}],
], ids=["empty", "dotted-namespace", "same-name-twice", "non-function-inside", "dotted-function"])
def test_a_namespace_that_cannot_be_flattened_is_refused(tools: list) -> None:
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate({"tools": tools, "input": "x"})
