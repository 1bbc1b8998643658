"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

The body becomes a `ChatJob` (jobs.py): the system prompt a system message,
`tool_use` blocks an assistant message's calls, `tool_result` blocks tool
messages, `tools[].input_schema` a function's parameters, `tool_choice` any /
tool / none / auto the chat API's required / named / none / auto. From there it
is rendered, constrained and split exactly as a chat completion is, so the
three APIs share one cache. Errors are Anthropic's shape (errors.py).

Claude Code puts a billing line in its first system block whose `cch=` value
changes on every request; left alone it would part every prompt from the
cached one a few tokens in. Its value is rewritten to a constant, as
llama-server does, so an agent's steps share their whole system prompt.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from skippy_cache.runtime import (
    DoneEvent,
    FinishReason,
    RequestStats,
    SamplingParams,
)
from skippy_cache.server.bridge import EngineRuns
from skippy_cache.server.errors import APIError, anthropic_error_body
from skippy_cache.server.generation import Generation, reply_deltas
from skippy_cache.server.http import parse_body, sse_event
from skippy_cache.server.jobs import ChatJob, scoped
from skippy_cache.server.responses import cache_answer
from skippy_cache.server.schemas import (
    CacheControl,
    CacheSalt,
    CalledFunction,
    ChatMessage,
    FunctionSpec,
    FunctionToolCall,
    OutputGrammar,
    Strict,
    ToolCall,
    ToolSpec,
)
from skippy_cache.server.tenants import Scope, scope_of
from skippy_cache.server.tools import Call, CallSplitter, Delta, split_reply

BILLING_LINE = "x-anthropic-billing-header:"
_BILLING_CHECKSUM = re.compile(r"cch=[^;\s]*")
#: Anthropic's rule for a tool's name (longer than OpenAI's: MCP tools are `mcp__server__tool`).
_TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"


class _Block(Strict):
    #: Accepted and ignored: this server caches every prefix, marked or not.
    cache_control: dict[str, Any] | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    #: Accepted only empty: citations come from documents, which are not supported.
    citations: list[Any] | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]
    #: What the `anthropic` client's blocks carry when sent back: accepted only empty.
    caller: None = None
    toolset_name: None = None


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    @property
    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content or ())
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(Strict):
    """Reasoning a model returned earlier; Anthropic drops it from later turns' prompts, and so does this."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


def _known_blocks(value: Any) -> Any:
    """Content as a list of blocks (a string is one text block), with a clear error for a block
    type this server does not take (images, documents, ...)."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if isinstance(value, list):
        for k, block in enumerate(value):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in _BLOCK_TYPES:
                raise ValueError(f"block {k} has type {kind!r}, which is not supported "
                                 f"(only {', '.join(_BLOCK_TYPES)})")
    return value


class MessageOutputConfig(Strict):
    effort: str | None = None


class AnthropicMessage(Strict):
    #: "system": instructions in the middle of a conversation (Claude Code sends its harness
    #: context so, after the first user turn), rendered as a system turn there (chat.py).
    role: Literal["user", "assistant", "system"]
    #: A string is one text block.
    content: list[ContentBlock]
    #: Claude Code sets the effort on its system turn; this server's models do not think (ignored).
    output_config: MessageOutputConfig | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _known_types(cls, value: Any) -> Any:
        return _known_blocks(value)

    @model_validator(mode="after")
    def _blocks_fit_role(self) -> AnthropicMessage:
        wrong = {"assistant": ToolResultBlock, "user": (ToolUseBlock, ThinkingBlock)}.get(
            self.role, (ToolUseBlock, ThinkingBlock, ToolResultBlock))
        for block in self.content:
            if isinstance(block, wrong):
                raise ValueError(f"a {self.role} message cannot hold a {block.type!r} block")
        return self


class AnthropicTool(Strict):
    """A client tool. Anthropic's server tools (web search, code execution, ...) run on
    Anthropic's side and are refused by type."""

    name: str = Field(pattern=_TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None
    cache_control: dict[str, Any] | None = None
    #: Tool search's: the tool's definition is loaded when searched for. Here every tool is in the
    #: prompt from the start, as it would be without it (ignored).
    defer_loading: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, value: Any) -> Any:
        # Before the fields: a server tool has no input_schema, and its type is what to report.
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"tool type {kind!r} is not supported (only client tools: 'custom')")
        return value


class AnthropicToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> AnthropicToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("'name' goes with type 'tool', and only with it")
        return self


class Metadata(Strict):
    user_id: str | None = None


class JsonOutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(OutputGrammar):
    """`output_config`: `format` is a grammar over the reply, as chat's `response_format`."""

    #: Accepted: how long a reasoning model thinks; this server's models return no thinking.
    effort: str | None = None
    format: JsonOutputFormat | None = None

    def _schema(self) -> tuple[bool, dict[str, Any] | None]:
        return (True, self.format.schema_) if self.format is not None else (False, None)


class MessagesRequest(Strict):
    IGNORED = frozenset({"metadata", "service_tier", "thinking", "cache_control", "speed", "inference_geo",
                         "context_management"})
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    #: Ignored: an end-user id, which cannot change the output.
    metadata: Metadata | None = None
    #: Anthropic's processing tier; there is one tier here.
    service_tier: str | None = None
    #: Accepted; this server's models return no thinking blocks (see docs/serving/agents.md).
    thinking: dict[str, Any] | None = None
    #: Accepted and ignored: every prefix is cached here, marked or not.
    cache_control: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    #: Anthropic's fast mode and where it runs inference: one speed and one place here.
    speed: str | None = None
    inference_geo: str | None = None
    #: Claude Code's: what the API may clear from a long context; nothing is cleared here.
    context_management: dict[str, Any] | None = None
    # The fields a generation shares with the chat API, and this server's own.
    cache_salt: CacheSalt | None = None
    cache: CacheControl = Field(default_factory=CacheControl)
    pin: bool = False

    def ignored_fields(self) -> list[str]:
        nested = [name for name, used in (
            ("messages[].output_config", any(m.output_config is not None for m in self.messages)),
            ("tools[].defer_loading", any(t.defer_loading is not None for t in self.tools or ())),
        ) if used]
        return sorted([*super().ignored_fields(), *nested])

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[AnthropicTool] | None) -> list[AnthropicTool] | None:
        names = [tool.name for tool in tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("two tools have the same name")
        return tools

    @model_validator(mode="after")
    def _choice_among_tools(self) -> MessagesRequest:
        choice = self.tool_choice
        names = {t.name for t in self.tools or ()}
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError("tool_choice: type 'any' or 'tool' needs 'tools'")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice: the tool {choice.name!r} is not among 'tools'")
        return self


class GenerateRequest(MessagesRequest):
    """POST /v1/messages: a count_tokens body plus how to generate."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    #: Sampling as older versions of the API had it (the current SDK sends them as `extra_body`).
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)


def rewrite_billing_line(text: str) -> str:
    """Claude Code's per-request billing line with its checksum made constant (`cch=fffff`)."""
    if not text.startswith(BILLING_LINE):
        return text
    line, newline, rest = text.partition("\n")
    return _BILLING_CHECKSUM.sub("cch=fffff", line) + newline + rest


def to_job(body: MessagesRequest, scope: Scope) -> ChatJob:
    """The chat job a Messages body asks for (400 for a history the chat path cannot replay)."""
    messages: list[ChatMessage] = []
    if body.system:
        blocks = [body.system] if isinstance(body.system, str) else [b.text for b in body.system]
        blocks[0] = rewrite_billing_line(blocks[0])
        messages.append(ChatMessage(role="system", content="\n".join(blocks)))
    if all(m.role == "system" and not m.content for m in body.messages):
        # Empty system turns render as nothing (below): with nothing else the request is the
        # empty `messages` Anthropic's API refuses.
        raise APIError(400, "messages: at least one message must have content", param="messages",
                       code="invalid_value")
    prefill = ""
    called: set[str] = set()
    for k, message in enumerate(body.messages):
        last = k == len(body.messages) - 1
        if message.role == "system" and not message.content:
            # Claude Code sends its harness-context turn empty when it has none (`--bare`);
            # Anthropic's API takes it, and it renders as nothing.
            continue
        if not message.content and not (message.role == "assistant" and last):
            # As Anthropic's API answers it; an empty turn would otherwise vanish from the prompt.
            raise APIError(400, f"messages[{k}]: all messages must have non-empty content except for the "
                           "optional final assistant message", param=f"messages[{k}].content", code="invalid_value")
        if message.role == "assistant" and last:
            prefill = _prefill(message, k)
            break
        messages += _chat_messages(message, k, called)
    if isinstance(body, GenerateRequest):
        sampling = SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                                  top_k=body.top_k or 0, top_p=1.0 if body.top_p is None else body.top_p,
                                  grammar=body.output_config.grammar if body.output_config else None)
        settings: dict[str, Any] = {"sampling": sampling, "temperature_given": body.temperature is not None,
                                    "max_tokens": body.max_tokens, "max_tokens_bound": True,
                                    "stop": tuple(body.stop_sequences or ())}
    else:
        settings = {"sampling": SamplingParams(), "max_tokens": 1}
    choice = body.tool_choice or AnthropicToolChoice(type="auto")
    mode = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or choice.name
    return ChatJob(
        **settings, **scoped(scope, body.cache_salt), lookup=body.cache.lookup, record=body.cache.store,
        pin=body.pin,
        messages=messages, tools=[_tool_spec(t) for t in body.tools or ()], tool_mode=mode if body.tools else "none",
        # One call unless the client allows several: small models asked for "one or more" tend
        # to repeat a call until max_tokens.
        parallel=choice.disable_parallel_tool_use is False, prefill=prefill,
    )


def _prefill(message: AnthropicMessage, k: int) -> str:
    """A last assistant message: text the reply continues (Anthropic's prefill)."""
    if any(not isinstance(b, TextBlock | ThinkingBlock) for b in message.content):
        raise APIError(400, f"messages[{k}]: a final assistant message (a prefill) may hold only text",
                       param=f"messages[{k}].content", code="invalid_value")
    return "".join(b.text for b in message.content if isinstance(b, TextBlock))


def _chat_messages(message: AnthropicMessage, k: int, called: set[str]) -> list[ChatMessage]:
    """One Messages turn as chat messages: text, calls, and one tool message per result, in order."""
    out: list[ChatMessage] = []
    texts: list[str] = []
    calls: list[ToolCall] = []

    def flush_text() -> None:
        if texts and message.role == "user":
            out.append(ChatMessage(role="user", content="\n".join(texts)))
            texts.clear()

    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            called.add(block.id)
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(FunctionToolCall(id=block.id, type="function", function=CalledFunction(name=block.name,
                                                                                        arguments=arguments)))
        elif isinstance(block, ToolResultBlock):
            if block.tool_use_id not in called:
                raise APIError(400, f"messages[{k}].content[{j}]: a tool_result for {block.tool_use_id!r}, "
                               "which no earlier tool_use block called", param=f"messages[{k}].content[{j}]",
                               code="invalid_value")
            flush_text()
            out.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=block.text))
    if message.role == "system":
        out.append(ChatMessage(role="system", content="\n".join(texts)))
    elif message.role == "user":
        flush_text()
    elif texts or calls:
        out.append(ChatMessage(role="assistant", content="\n".join(texts) or None, tool_calls=calls or None))
    return out


def _tool_spec(tool: AnthropicTool) -> ToolSpec:
    # model_construct: Anthropic's names may be longer than OpenAI's rule allows; checked above.
    function = FunctionSpec.model_construct(name=tool.name, description=tool.description,
                                            parameters=tool.input_schema, strict=None)
    return ToolSpec.model_construct(type="function", function=function)


# -- responses ---------------------------------------------------------------------


def usage(stats: RequestStats, output_tokens: int | None = None) -> dict:
    """Anthropic's usage: `input_tokens` is what was not read from the cache."""
    return {
        "input_tokens": stats.prompt_tokens - stats.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": stats.cached_tokens,
        "output_tokens": stats.completion_tokens if output_tokens is None else output_tokens,
    }


def _tool_use(call: Call) -> dict:
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = {}  # a call cut short by max_tokens: its input is not whole (the stream had what came)
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments}


def stop_reason(done: DoneEvent, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished reply."""
    if done.finish_reason is FinishReason.LENGTH:
        return "max_tokens", None
    if done.stop_sequence is not None:
        return "stop_sequence", done.stop_sequence
    return ("tool_use" if called else "end_turn"), None


class MessageFormat:
    """One Messages response: the whole message, or its stream of events."""

    def __init__(self, model: str, tool_names: set[str] | None, incremental: bool, prompt_tokens: int) -> None:
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = model
        self.tool_names = tool_names
        self.incremental = incremental
        #: What message_start says the input is, before the cache's share of it is known.
        self.prompt_tokens = prompt_tokens
        self.calls: list[Call] = []

    def call_ids(self) -> tuple[str, ...]:
        return tuple(call.id for call in self.calls)

    def whole(self, done: DoneEvent) -> dict:
        content: list[dict] = []
        text = done.text
        if self.tool_names is not None:
            text, self.calls = split_reply(done.text, self.tool_names, "toolu_", self.incremental)
        if text:
            content.append({"type": "text", "text": text})
        content += [_tool_use(call) for call in self.calls]
        reason, sequence = stop_reason(done, bool(self.calls))
        return {**self._head(content), "stop_reason": reason, "stop_sequence": sequence,
                "usage": usage(done.stats), "skippy_cache": cache_answer(done.stats)}

    def _head(self, content: list[dict]) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content}

    async def events(self, runs: EngineRuns) -> AsyncIterator[str]:
        """message_start, a ping, each content block's start / deltas / stop, message_delta, message_stop."""
        splitter = CallSplitter(self.tool_names or set(), "toolu_", self.incremental)
        blocks = _Blocks()
        start = {**self._head([]), "stop_reason": None, "stop_sequence": None,
                 # Known at the end (message_delta): how much of the prompt the cache served.
                 "usage": {"input_tokens": self.prompt_tokens, "cache_creation_input_tokens": 0,
                           "cache_read_input_tokens": 0, "output_tokens": 0}}
        yield _sse("message_start", {"type": "message_start", "message": start})
        yield _sse("ping", {"type": "ping"})
        async for event in reply_deltas(runs, splitter if self.tool_names is not None else None):
            if isinstance(event, list):
                for text in blocks.emit(event):
                    yield text
                continue
            if event.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
                message = event.error or f"the request was {event.finish_reason.value}"
                yield _sse("error", anthropic_error_body(500, message))
                return
            for text in blocks.close():
                yield text
            self.calls = splitter.calls
            reason, sequence = stop_reason(event, bool(self.calls))
            yield _sse("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                         "usage": usage(event.stats), "skippy_cache": cache_answer(event.stats)})
            yield _sse("message_stop", {"type": "message_stop"})


class _Blocks:
    """Content blocks as Anthropic streams them: a text block open while text comes, a tool_use
    block from its start (id and name) through its input's `input_json_delta` pieces to its end;
    each closed before the next opens."""

    def __init__(self) -> None:
        self.index = -1
        self.open_text = False

    def emit(self, deltas: Sequence[Delta]) -> list[str]:
        out: list[str] = []
        for delta in deltas:
            if delta.text:
                if not self.open_text:
                    self.index += 1
                    self.open_text = True
                    out.append(_sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                            "content_block": {"type": "text", "text": ""}}))
                out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                        "delta": {"type": "text_delta", "text": delta.text}}))
            elif delta.call is not None:
                out += self.close()
                self.index += 1
                call = delta.call
                out.append(_sse("content_block_start", {
                    "type": "content_block_start", "index": self.index,
                    "content_block": {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}}))
            elif delta.arguments:
                out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                        "delta": {"type": "input_json_delta",
                                                                  "partial_json": delta.arguments}}))
            elif delta.done is not None:
                out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        return out

    def close(self) -> list[str]:
        if not self.open_text:
            return []
        self.open_text = False
        return [_sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]


def _sse(event: str, payload: dict) -> str:
    """Anthropic names every event: the name first, as the stream reads."""
    return sse_event(payload, event)


# -- handlers ------------------------------------------------------------------------


class MessagesAPI:
    """The two routes, over the chat path of `generation`."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation

    async def messages(self, request: Request) -> Response:
        body = await parse_body(request, GenerateRequest)
        self.generation.models.check(body.model)
        job = to_job(body, scope_of(request))
        runs, prompt_tokens = await self.generation.start_chat(job)
        fmt = MessageFormat(self.generation.model_id, job.tool_names, job.constrained, prompt_tokens)
        return await self.generation.respond_one(request, runs, job, fmt, body.stream)

    async def count_tokens(self, request: Request) -> Response:
        """The prompt's size as /v1/messages would render it (tools, system and history)."""
        body = await parse_body(request, MessagesRequest)
        self.generation.models.check(body.model)
        tokens = await self.generation.prompt_size(to_job(body, scope_of(request)))
        return JSONResponse({"input_tokens": tokens})
