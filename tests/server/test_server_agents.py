"""Agent loops through all three APIs on a template that renders tools itself (Qwen 2.5's, served
by the real SmolLM2 model: both use ChatML's tokens), in exact mode.

Each step sends the whole history back: the system prompt and tools, every call and every
result. Step k+1 must find all of step k, its prompt and its reply, in the cache, whichever API
the agent speaks. With SmolLM2's own template (the fallback syntax) the same is checked per API
in test_server_tools.py, test_server_anthropic.py and test_server_responses.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest
from chat_templates import QWEN25, QWEN25_FILE
from live_server import LiveServer, run_own_server
from test_server_anthropic import TOOLS as ANTHROPIC_TOOLS
from test_server_responses import TOOLS as RESPONSES_TOOLS
from test_server_tools import TOOLS as CHAT_TOOLS
from test_server_tools import check_arguments
from test_tools_render import render

from skippy_cache.server import ServerSettings

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

SYSTEM = "You are a helpful assistant with tools."
QUESTION = "What is the weather in Paris?"
STEPS = 3


@pytest.fixture(scope="module")
def qwen_server() -> Iterator[LiveServer]:
    yield from run_own_server(ServerSettings(ctx_size=2048, lanes=2, queue_size=8, chat_template=QWEN25_FILE))


def test_the_template_renders_the_tools_itself(qwen_server: LiveServer) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    out = qwen_server.openai().chat.completions.create(model="m", messages=messages, tools=CHAT_TOOLS,
                                                       max_tokens=1, temperature=0)
    # The prompt is Qwen's own rendering: its "# Tools" section, not the fallback's block.
    text = render(messages, CHAT_TOOLS, QWEN25)
    assert "# Tools" in text and out.usage.prompt_tokens == len(qwen_server.engine.tokenize(text))


def test_chat_completions_agent(qwen_server: LiveServer) -> None:
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    before = None
    for _ in range(STEPS):
        out = qwen_server.openai().chat.completions.create(
            model="m", messages=messages, tools=CHAT_TOOLS, tool_choice="required", temperature=0, max_tokens=64,
            extra_body={"cache_salt": "chat-agent"})
        usage = out.usage
        if before is not None:
            assert usage.prompt_tokens_details.cached_tokens >= before, usage
        before = usage.prompt_tokens + usage.completion_tokens
        call = out.choices[0].message.tool_calls[0]
        check_arguments(call.function.name, call.function.arguments)
        messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]


def test_messages_agent(qwen_server: LiveServer) -> None:
    client = anthropic.Anthropic(base_url=qwen_server.url, api_key="unused")
    messages: list[dict] = [{"role": "user", "content": QUESTION}]
    before = None
    for _ in range(STEPS):
        out = client.messages.create(model="m", system=SYSTEM, messages=messages, tools=ANTHROPIC_TOOLS,
                                     tool_choice={"type": "any"}, max_tokens=64,
                                     extra_body={"temperature": 0, "cache_salt": "messages-agent"})
        usage = out.usage
        if before is not None:
            assert usage.cache_read_input_tokens >= before, usage
        before = usage.input_tokens + usage.cache_read_input_tokens + usage.output_tokens
        assert out.stop_reason == "tool_use"
        call = next(b for b in out.content if b.type == "tool_use")
        messages += [{"role": "assistant", "content": [b.model_dump() for b in out.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C"}]}]


def test_responses_agent(qwen_server: LiveServer) -> None:
    items: list = [{"role": "user", "content": QUESTION}]
    before = None
    for _ in range(STEPS):
        out = qwen_server.openai().responses.create(
            model="m", instructions=SYSTEM, input=items, tools=RESPONSES_TOOLS, tool_choice="required",
            temperature=0, max_output_tokens=64, extra_body={"cache_salt": "responses-agent"})
        usage = out.usage
        if before is not None:
            assert usage.input_tokens_details.cached_tokens >= before, usage
        before = usage.input_tokens + usage.output_tokens
        call = next(item for item in out.output if item.type == "function_call")
        items += [*out.output, {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}]
