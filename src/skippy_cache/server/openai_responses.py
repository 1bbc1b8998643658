"""POST /v1/responses: OpenAI's Responses API, stateless, over the chat path.

`instructions` becomes the system message, `input` items chat messages
(`function_call` and `custom_tool_call` items an assistant message's calls,
their `..._output` items tool messages), function and custom tools and
`tool_choice` the chat API's, and
`text.format` a grammar as chat's `response_format`. A `namespace` tool's
functions are offered as `NAMESPACE.NAME` and their calls come back as that
name under `namespace`, as Codex CLI reads them. Nothing is stored: a
request carries its whole history, `previous_response_id` is a 400 saying
so, and every response says `"store": false`. The cache makes that cheap:
the history a stored response would stand for is reused from the cache.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, PrivateAttr, Tag, ValidationInfo, field_validator, model_validator
from starlette.requests import Request
from starlette.responses import Response

from skippy_cache.runtime import (
    DoneEvent,
    FinishReason,
    RequestStats,
    SamplingParams,
)
from skippy_cache.server.bridge import EngineRuns
from skippy_cache.server.errors import APIError, branch_tag, error_body
from skippy_cache.server.generation import Generation, reply_deltas
from skippy_cache.server.http import parse_body, sse_event
from skippy_cache.server.jobs import ChatJob, scoped
from skippy_cache.server.responses import cache_answer
from skippy_cache.server.schemas import (
    FUNCTION_NAME,
    CacheControl,
    CacheSalt,
    CalledCustom,
    CalledFunction,
    ChatMessage,
    CustomFormat,
    CustomGrammar,
    CustomSpec,
    CustomToolCall,
    FunctionSpec,
    FunctionToolCall,
    OutputGrammar,
    Strict,
    ToolCall,
    ToolSpec,
    function_type_only,
    refuse_unless_inert,
)
from skippy_cache.server.tenants import Scope, scope_of
from skippy_cache.server.tools import Call, CallSplitter, Delta, split_reply


class TextPart(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    #: What an output message sent back as input carries: accepted, not used.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _parts(value: Any) -> Any:
    """Content as a list of parts (a string is one text part); other part types named in the error."""
    if isinstance(value, str):
        return [{"type": "input_text", "text": value}]
    if isinstance(value, list):
        for k, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text"):
                raise ValueError(f"part {k} has type {kind!r}, which is not supported (only text)")
    return value


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[TextPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        return _parts(value)

    @property
    def text(self) -> str:
        return "\n".join(part.text for part in self.content)


class _CallItem(Strict):
    """A past call, as a response returned it."""

    call_id: str = Field(min_length=1)
    name: str
    id: str | None = None
    status: str | None = None
    #: What the `openai` client's items carry when sent back: accepted only empty.
    caller: None = None
    async_: None = Field(default=None, alias="async")


class FunctionCallItem(_CallItem):
    type: Literal["function_call"]
    arguments: str
    #: The namespace tool this function belongs to, as this server's calls name it.
    namespace: str | None = Field(default=None, pattern=FUNCTION_NAME)

    @property
    def qualified_name(self) -> str:
        return qualified(self.namespace, self.name)


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(part.text for part in self.output)


class ReasoningItem(Strict):
    """Reasoning another model returned; dropped from the prompt (this server's models return none)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] | None = None
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class CustomToolCallItem(_CallItem):
    type: Literal["custom_tool_call"]
    input: str


class CustomToolCallOutputItem(FunctionCallOutputItem):
    type: Literal["custom_tool_call_output"]  # type: ignore[assignment]


_ITEM_TYPES = ("message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output",
               "reasoning")
InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | CustomToolCallItem
                      | CustomToolCallOutputItem | ReasoningItem, Field(discriminator="type")]


class _FunctionTyped(Strict):
    type: str

    _function_only = field_validator("type")(function_type_only)


#: Tool types OpenAI runs on its side. Sent with a request, each is left out of the prompt.
HOSTED_TOOLS = frozenset({"web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation",
                          "computer_use_preview"})


def _hosted(tool: object) -> bool:
    """A tool OpenAI runs on its side; looked at before validation, so anything may come here."""
    return isinstance(tool, dict) and isinstance(kind := tool.get("type"), str) and kind in HOSTED_TOOLS


class FunctionTool(FunctionSpec, _FunctionTyped):
    """`tools[i]`: a function, its fields beside `type` rather than under `function`. OpenAI's
    hosted tools are left out before this (`HOSTED_TOOLS`); other types (custom, MCP, ...) are
    refused by type, which is checked first (such a tool may have no name)."""


def qualified(namespace: str | None, name: str) -> str:
    """A function's name as the model sees it. Plain names cannot hold a dot, so `NAMESPACE.NAME`
    never collides with one and splits back unambiguously (`split_qualified`)."""
    return name if namespace is None else f"{namespace}.{name}"


def split_qualified(name: str) -> tuple[str | None, str]:
    namespace, dot, bare = name.partition(".")
    return (namespace, bare) if dot else (None, name)


class NamespaceTool(Strict):
    """A group of functions (Codex CLI sends its sub-agent and MCP tools so). Each is offered to
    the model as `NAMESPACE.NAME`; the namespace's own description is not rendered (the chat
    templates have no place for a group)."""

    type: Literal["namespace"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    tools: list[FunctionTool] = Field(min_length=1)


class CustomToolFormat(Strict):
    """A custom tool's `format`: any text, or text a grammar allows (`syntax`, `definition`)."""

    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None

    @model_validator(mode="after")
    def _grammar_given(self) -> CustomToolFormat:
        if (self.type == "grammar") != (self.syntax is not None and self.definition is not None):
            raise ValueError("'syntax' and 'definition' are given with format type 'grammar', and only then")
        return self

    def as_chat(self) -> CustomFormat:
        if self.syntax is None or self.definition is None:
            return CustomFormat(type="text")
        return CustomFormat(type="grammar", grammar=CustomGrammar(definition=self.definition, syntax=self.syntax))


class CustomTool(Strict):
    """`tools[i]` of type custom: the model writes the tool's input as text (server/tools.py)."""

    type: Literal["custom"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    format: CustomToolFormat | None = None

    def as_chat(self) -> ToolSpec:
        fmt = self.format.as_chat() if self.format is not None else None
        return ToolSpec(type="custom", custom=CustomSpec(name=self.name, description=self.description, format=fmt))


def _tool_kind(tool: Any) -> str:
    """Namespaces and custom tools apart; every other type goes to FunctionTool, whose error names the type."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    return branch_tag(kind if kind in ("namespace", "custom") else "function")


AnyTool = FunctionTool | NamespaceTool | CustomTool
Tool = Annotated[Annotated[FunctionTool, Tag(branch_tag("function"))]
                 | Annotated[NamespaceTool, Tag(branch_tag("namespace"))]
                 | Annotated[CustomTool, Tag(branch_tag("custom"))], Discriminator(_tool_kind)]


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class NamedCustom(Strict):
    type: Literal["custom"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OutputGrammar):
    """`text`: the reply as text, any JSON object, or JSON following a schema (a grammar)."""

    format: TextFormat | None = None
    #: Not supported: accepted only null.
    verbosity: Any = None

    @field_validator("verbosity", mode="before")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> None:
        refuse_unless_inert(value, info)

    def _schema(self) -> tuple[bool, dict[str, Any] | None]:
        fmt = self.format
        if fmt is None or fmt.type == "text":
            return False, None
        if fmt.type == "json_schema" and fmt.schema_ is None:
            raise ValueError("format type 'json_schema' needs a 'schema'")
        return True, fmt.schema_


class ResponsesRequest(Strict):
    IGNORED = frozenset({"reasoning", "include", "user", "safety_identifier", "prompt_cache_key",
                         "prompt_cache_retention", "service_tier", "client_metadata"})
    model: str | None = None
    input: list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | NamedCustom | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    #: Accepted, but nothing is stored: every response says `"store": false`.
    store: bool | None = None
    #: Returned as given.
    metadata: dict[str, str] | None = None
    #: Accepted: reasoning models' settings; this server's models return no reasoning.
    reasoning: dict[str, Any] | None = None
    #: Accepted only for what this server can return: `reasoning.encrypted_content` (there is none).
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    truncation: Literal["disabled"] | None = None
    # Ignored: they cannot change the output (ids for abuse monitoring, OpenAI's cache and tiers).
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    #: Codex CLI's: its own ids and versions.
    client_metadata: dict[str, Any] | None = None
    # Not supported; accepted only with a value that asks for nothing.
    previous_response_id: Any = None
    conversation: Any = None
    prompt: Any = None
    background: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    context_management: Any = None
    # This server's own.
    cache_salt: CacheSalt | None = None
    cache: CacheControl = Field(default_factory=CacheControl)
    pin: bool = False
    _hosted: list[str] = PrivateAttr(default_factory=list)

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        """A string is one user message; an item with a role and no type is a message."""
        if isinstance(value, str):
            return [{"type": "message", "role": "user", "content": value}]
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of input items")
        items = []
        for k, item in enumerate(value):
            if isinstance(item, dict) and "type" not in item and "role" in item:
                item = {**item, "type": "message"}
            kind = item.get("type") if isinstance(item, dict) else None
            if kind not in _ITEM_TYPES:
                raise ValueError(f"item {k} has type {kind!r}, which is not supported "
                                 f"(only {', '.join(_ITEM_TYPES)})")
            items.append(item)
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _hosted_tools_left_out(cls, value: Any) -> Any:
        """Tools OpenAI runs on its side (web search and the like): a local server has none to run,
        and an agent sends them on every request, so they are left out of the prompt, not refused
        (named as ignored, `tools:TYPE`)."""
        if not isinstance(value, list):
            return value
        return [tool for tool in value if not _hosted(tool)]

    def ignored_fields(self) -> list[str]:
        return sorted([*super().ignored_fields(), *self._hosted])

    @model_validator(mode="wrap")
    @classmethod
    def _note_hosted(cls, data: Any, handler: Any) -> ResponsesRequest:
        tools = data.get("tools") if isinstance(data, dict) else None
        # Whatever `tools` holds: its own validation reports a value that is not a list.
        hosted = sorted({f"tools:{t['type']}" for t in tools if _hosted(t)}) if isinstance(tools, list) else []
        body = handler(data)
        body._hosted = hosted
        return body

    @field_validator("previous_response_id", "conversation", mode="before")
    @classmethod
    def _stateless(cls, value: Any, info: ValidationInfo) -> None:
        if value is not None:
            raise ValueError(f"{info.field_name} needs a stored response or conversation; this server "
                             "stores none: send the whole history in 'input'")

    @field_validator("prompt", "background", "max_tool_calls", "top_logprobs", "context_management", mode="before")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> None:
        refuse_unless_inert(value, info)

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[AnyTool] | None) -> list[AnyTool] | None:
        names = [name for name, _ in _functions(tools)] + [t.name for t in _customs(tools)]
        if len(set(names)) != len(names):
            raise ValueError("two tools have the same name")
        return tools

    @property
    def functions(self) -> list[tuple[str, FunctionTool]]:
        """Every function offered, namespaces flattened: (the name the model sees, the function)."""
        return _functions(self.tools)

    @property
    def customs(self) -> list[CustomTool]:
        return _customs(self.tools)

    @model_validator(mode="after")
    def _choice_among_tools(self) -> ResponsesRequest:
        functions = {name for name, _ in self.functions}
        customs = {t.name for t in self.customs}
        choice = self.tool_choice
        if (choice == "required" or isinstance(choice, NamedFunction | NamedCustom)) and not functions | customs:
            raise ValueError("tool_choice: a choice other than 'none' or 'auto' needs 'tools'")
        named = functions if isinstance(choice, NamedFunction) else customs
        if isinstance(choice, NamedFunction | NamedCustom) and choice.name not in named:
            raise ValueError(f"tool_choice: the {choice.type} tool {choice.name!r} is not among 'tools'")
        return self

    @property
    def tool_mode(self) -> str:
        if isinstance(self.tool_choice, NamedFunction | NamedCustom):
            return self.tool_choice.name
        return self.tool_choice or ("auto" if self.tools else "none")


def _functions(tools: list[AnyTool] | None) -> list[tuple[str, FunctionTool]]:
    out = []
    for tool in tools or ():
        if isinstance(tool, NamespaceTool):
            out += [(qualified(tool.name, f.name), f) for f in tool.tools]
        elif isinstance(tool, FunctionTool):
            out.append((tool.name, tool))
    return out


def _chat_tools(tools: list[AnyTool] | None) -> list[ToolSpec]:
    """The tools as the chat job offers them, in the order given (a namespace's functions in its
    place). The qualified name is set after validation: a name with a dot is this server's own,
    not a client's."""
    out = []
    for tool in tools or ():
        if isinstance(tool, CustomTool):
            out.append(tool.as_chat())
            continue
        for name, function in _functions([tool]):
            spec = FunctionSpec.model_validate(function.model_dump(exclude={"type"}))
            out.append(ToolSpec(type="function", function=spec.model_copy(update={"name": name})))
    return out


def _customs(tools: list[AnyTool] | None) -> list[CustomTool]:
    return [tool for tool in tools or () if isinstance(tool, CustomTool)]


def to_job(body: ResponsesRequest, scope: Scope) -> ChatJob:
    messages: list[ChatMessage] = []
    if body.instructions:
        messages.append(ChatMessage(role="system", content=body.instructions))
    called: set[str] = set()
    for k, item in enumerate(body.input):
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=item.role, content=item.text))
        elif isinstance(item, FunctionCallItem | CustomToolCallItem):
            called.add(item.call_id)
            call: ToolCall = CustomToolCall(id=item.call_id, type="custom",
                                            custom=CalledCustom(name=item.name, input=item.input)) \
                if isinstance(item, CustomToolCallItem) else \
                FunctionToolCall(id=item.call_id, type="function",
                                 function=CalledFunction(name=item.qualified_name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                # The calls of one reply come as consecutive items, after its text if it had any.
                messages[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []), call]})
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in called:
                raise APIError(400, f"input[{k}] is the output of call {item.call_id!r}, which no earlier "
                               "function_call or custom_tool_call item made", param=f"input[{k}].call_id",
                               code="invalid_value")
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.text))
    sampling = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        grammar=body.text.grammar if body.text is not None else None,
    )
    tools = _chat_tools(body.tools)
    return ChatJob(sampling=sampling, temperature_given=body.temperature is not None,
                   max_tokens=body.max_output_tokens, max_tokens_bound=True,
                   **scoped(scope, body.cache_salt),
                   lookup=body.cache.lookup, record=body.cache.store, pin=body.pin, messages=messages,
                   tools=tools, tool_mode=body.tool_mode,
                   # One call unless asked for more: small models asked for "one or more" tend to
                   # repeat a call until max_tokens.
                   parallel=body.parallel_tool_calls is True, prompt_param="input")


# -- responses ---------------------------------------------------------------------


def usage(stats: RequestStats) -> dict:
    return {
        "input_tokens": stats.prompt_tokens,
        "input_tokens_details": {"cached_tokens": stats.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": stats.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
    }


class ResponseObjectFormat:
    """One response object, whole or as its stream of events (each with its `sequence_number`)."""

    def __init__(self, model: str, body: ResponsesRequest, tool_names: set[str] | None,
                 incremental: bool, default_temperature: float, custom_names: frozenset[str] = frozenset()) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.incremental = incremental
        self.created = int(time.time())
        self.model = model
        self.body = body
        self.tool_names = tool_names
        self.custom_names = custom_names
        self.temperature = default_temperature if body.temperature is None else body.temperature
        self.calls: list[Call] = []
        self._sequence = 0

    def call_ids(self) -> tuple[str, ...]:
        return tuple(call.id for call in self.calls)

    def whole(self, done: DoneEvent) -> dict:
        text = done.text
        if self.tool_names is not None:
            text, self.calls = split_reply(done.text, self.tool_names, incremental=self.incremental,
                                           custom=self.custom_names)
        output = []
        if text or not self.calls:
            output.append(_message_item(f"msg_{uuid.uuid4().hex}", text, _status(done)))
        output += [_call_item(call, "completed") for call in self.calls]
        return self._object(_status(done), output, done)

    def _object(self, status: str, output: list[dict], done: DoneEvent | None) -> dict:
        body = self.body
        choice = body.tool_choice
        out = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "metadata": body.metadata or {},
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is True,
            "temperature": self.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "tool_choice": choice.model_dump() if isinstance(choice, NamedFunction | NamedCustom) else body.tool_mode,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                     if body.text is not None and body.text.format is not None else {"type": "text"}},
            "truncation": "disabled", "store": False, "previous_response_id": None,
            "usage": usage(done.stats) if done is not None else None,
        }
        if done is not None:
            out["completed_at"] = int(time.time())
            out["skippy_cache"] = cache_answer(done.stats)
        return out

    async def events(self, runs: EngineRuns) -> AsyncIterator[str]:
        """response.created and .in_progress; per output item its added / deltas / done events;
        then response.completed (or .incomplete at max_output_tokens)."""
        splitter = CallSplitter(self.tool_names or set(), incremental=self.incremental, custom=self.custom_names)
        items = _Items(self._event)
        head = self._object("in_progress", [], None)
        yield self._event("response.created", response=head)
        yield self._event("response.in_progress", response=head)
        async for event in reply_deltas(runs, splitter if self.tool_names is not None else None):
            if isinstance(event, list):
                for text in items.emit(event):
                    yield text
                continue
            if event.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
                message = event.error or f"the request was {event.finish_reason.value}"
                yield self._event("error", **error_body(message, "server_error", code=event.finish_reason.value)["error"])
                return
            status = _status(event)
            for text in items.close(status, force_message=not splitter.calls):
                yield text
            self.calls = splitter.calls
            final = self._object(status, items.done, event)
            yield self._event("response.completed" if status == "completed" else "response.incomplete",
                              response=final)

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse_event(payload, kind)


def _status(done: DoneEvent) -> str:
    return "incomplete" if done.finish_reason is FinishReason.LENGTH else "completed"


def _message_item(item_id: str, text: str, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def _item_id(call: Call) -> str:
    """A call item's id: its call's, prefixed as OpenAI's are."""
    return f"{'ctc' if call.custom else 'fc'}_{call.id.removeprefix('call_')}"


def _call_item(call: Call, status: str, arguments: str | None = None) -> dict:
    if call.custom:
        # OpenAI's custom_tool_call items carry no status.
        return {"type": "custom_tool_call", "id": _item_id(call), "call_id": call.id, "name": call.name,
                "input": call.arguments if arguments is None else arguments}
    namespace, name = split_qualified(call.name)
    item = {"type": "function_call", "id": _item_id(call), "call_id": call.id, "name": name,
            "arguments": call.arguments if arguments is None else arguments, "status": status}
    return item if namespace is None else {**item, "namespace": namespace}


class _Items:
    """Output items as the Responses stream sends them: a message item open while text comes
    (added, content part added, text deltas), a function call from its start (added) through
    its arguments' deltas to its end (arguments done, item done); each item done before the next
    is added."""

    def __init__(self, event: Any) -> None:
        self._event = event
        self.done: list[dict] = []
        self._text: str | None = None
        self._message_id = ""
        #: The call whose arguments are streaming.
        self._call: Call | None = None

    def emit(self, deltas: list[Delta]) -> list[str]:
        out: list[str] = []
        for delta in deltas:
            index = len(self.done)
            if delta.text:
                out += self._open_message()
                self._text = (self._text or "") + delta.text
                out.append(self._event("response.output_text.delta", item_id=self._message_id,
                                       output_index=index, content_index=0, delta=delta.text, logprobs=[]))
            elif delta.call is not None:
                out += self._close_message("completed")
                self._call = delta.call
                item = _call_item(delta.call, "in_progress", arguments="")
                out.append(self._event("response.output_item.added", output_index=len(self.done), item=item))
            elif delta.arguments and self._call is not None:
                if self._call.custom:
                    out.append(self._event("response.custom_tool_call_input.delta", item_id=_item_id(self._call),
                                           output_index=index, delta=delta.arguments))
                else:
                    out.append(self._event("response.function_call_arguments.delta", item_id=_item_id(self._call),
                                           output_index=index, delta=delta.arguments))
            elif delta.done is not None:
                call = delta.done
                if call.custom:
                    out.append(self._event("response.custom_tool_call_input.done", item_id=_item_id(call),
                                           output_index=index, input=call.arguments))
                else:
                    out.append(self._event("response.function_call_arguments.done", item_id=_item_id(call),
                                           output_index=index, arguments=call.arguments))
                whole = _call_item(call, "completed")
                out.append(self._event("response.output_item.done", output_index=index, item=whole))
                self.done.append(whole)
        return out

    def close(self, status: str, *, force_message: bool) -> list[str]:
        """The end of the reply: the open message item done (an empty one if nothing else came)."""
        out = []
        if force_message and self._text is None and not self.done:
            out += self._open_message()
            self._text = ""
        return out + self._close_message(status)

    def _open_message(self) -> list[str]:
        if self._text is not None:
            return []
        self._text = ""
        self._message_id = f"msg_{uuid.uuid4().hex}"
        index = len(self.done)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.output_item.added", output_index=index,
                            item={**_message_item(self._message_id, "", "in_progress"), "content": []}),
                self._event("response.content_part.added", item_id=self._message_id, output_index=index,
                            content_index=0, part=part)]

    def _close_message(self, status: str) -> list[str]:
        if self._text is None:
            return []
        text, self._text = self._text, None
        index = len(self.done)
        item = _message_item(self._message_id, text, status)
        self.done.append(item)
        return [self._event("response.output_text.done", item_id=self._message_id, output_index=index,
                            content_index=0, text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=self._message_id, output_index=index,
                            content_index=0, part=item["content"][0]),
                self._event("response.output_item.done", output_index=index, item=item)]


class ResponsesAPI:
    """POST /v1/responses over the chat path of `generation`."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation

    async def create(self, request: Request) -> Response:
        body = await parse_body(request, ResponsesRequest)
        self.generation.models.check(body.model)
        job = to_job(body, scope_of(request))
        runs, _ = await self.generation.start_chat(job)
        fmt = ResponseObjectFormat(self.generation.model_id, body, job.tool_names, job.constrained,
                                   self.generation.settings.default_temperature, job.custom_names)
        return await self.generation.respond_one(request, runs, job, fmt, body.stream)
