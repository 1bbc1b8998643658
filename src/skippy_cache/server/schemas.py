"""Request bodies of /v1/completions and /v1/chat/completions.

Strict types (a string is not a number, 1 is not `true`), so a wrong type is a
400 naming the field rather than a silent coercion. A field is either done,
ignored because ignoring it cannot change the output (`user`, `metadata`,
`store`, ... each declared below and marked so), or a 400 naming it: an
unknown field (`unknown_parameter`), and a known OpenAI field this server
does not do (`suffix`, `audio`, ...: `unsupported_parameter`), unless it is
sent with its do-nothing value (`"suffix": ""`). A client that asks for
something must never get something else with a 200. Union fields are
normalised by `before` validators, so an error names the field (`prompt`),
not pydantic's union branch (`prompt.list[int][3]`).

The sampling fields are done by llama.cpp's sampler (runtime/native.py):
`frequency_penalty`, `presence_penalty` and `repeat_penalty` by its
penalties sampler, `logit_bias` by its logit-bias sampler, `response_format`
(`json_object`, `json_schema`) by a grammar, and `logprobs`/`top_logprobs`
from the raw logits; `n` runs the prompt n times (prefilled once, the cache
serves the rest) and `echo` prepends the prompt's text.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from skippy_cache.runtime import MAX_TOP_LOGPROBS, FreeText, SamplingParams, json_grammar
from skippy_cache.server.errors import branch_tag

#: The legacy completions API's default (OpenAI and vLLM).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: OpenAI's default; 0 is greedy.
DEFAULT_TEMPERATURE = 1.0
#: Most choices (`n`) one request may ask for: each is a request of its own on the engine.
MAX_CHOICES = 16
#: The legacy completions API's limit on `logprobs` (OpenAI's).
MAX_COMPLETION_LOGPROBS = 5
#: OpenAI's range of a logit bias: -100 bans a token, 100 forces it.
MAX_LOGIT_BIAS = 100.0


#: `cache_salt`: a namespace of the caller's own inside its tenant. No control characters: the
#: server joins a namespace's parts with one (tenants.Scope), so no salt can spell another's.
CacheSalt = Annotated[str, Field(min_length=1, pattern=r"^[^\x00-\x1f\x7f]*$")]


class Strict(BaseModel):
    # Unknown fields are refused, not dropped: a misspelt or unsupported
    # option silently ignored gives the client something it did not ask for.
    model_config = ConfigDict(extra="forbid", strict=True)
    #: Known fields accepted and ignored: they cannot change the tokens a request produces (client
    #: metadata, hints for a hosted service's caches and tiers). Clients add such fields with every
    #: release; refusing them breaks every agent on the next one. Each one a body sets is named in
    #: the answer's `x-skippy-ignored` header and counted (`skippy_ignored_fields`).
    IGNORED: ClassVar[frozenset[str]] = frozenset()

    def ignored_fields(self) -> list[str]:
        """The ignored fields this body sets, to anything but null."""
        return sorted(name for name in self.IGNORED & self.model_fields_set if getattr(self, name) is not None)


#: Error type of a known OpenAI field this server does not do (errors.py maps it to a 400).
UNSUPPORTED = "unsupported_parameter"


#: Besides null, the values of an unsupported field that ask for nothing.
_INERT: dict[str, tuple[Any, ...]] = {
    "suffix": ("",),
    "best_of": (1,),
    "annotations": ([],),
}


def refuse_unless_inert(value: Any, info: ValidationInfo) -> None:
    """Accept a field this server does not do only with a value that asks for nothing."""
    inert = _INERT.get(info.field_name or "", ())
    # `type(...) is`: `true == 1`, and `"best_of": true` is a wrong type, not 1.
    if value is None or any(type(value) is type(v) and value == v for v in inert):
        return
    raise PydanticCustomError(UNSUPPORTED, "{field!r} is not supported by this server",
                              {"field": info.field_name})


class StreamOptions(Strict):
    include_usage: bool = False
    #: Ignored: OpenAI pads chunks against a side channel; nothing here to pad.
    include_obfuscation: bool | None = None


class CacheControl(Strict):
    """Per-request cache control: `"cache": {"lookup": false, "store": false}` (`extra_body` with the openai client)."""

    #: Reuse cached prefixes for this request.
    lookup: bool = True
    #: Keep anything of this request in any tier (False: nothing is recorded or written).
    store: bool = True


class JsonSchemaSpec(Strict):
    """`response_format.json_schema`: OpenAI's structured output."""

    name: str | None = None
    description: str | None = None
    #: Aliased: `schema` shadows a pydantic BaseModel attribute. Absent: any JSON object.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    #: Either way the output follows the schema, as far as llguidance implements its keywords.
    strict: bool | None = None


class OutputGrammar(Strict):
    """A format every API spells its own way, holding the reply to JSON (any object, or a schema):
    its grammar is compiled as the body is validated, so a schema that does not compile is a 400
    naming the field. A subclass says which schema it asks for (`_schema`)."""

    _grammar: str | None = PrivateAttr(default=None)

    def _schema(self) -> tuple[bool, dict[str, Any] | None]:
        """Whether the reply is JSON, and its schema (None: any object); a ValueError for a format
        that contradicts itself."""
        raise NotImplementedError

    @model_validator(mode="after")
    def _make_grammar(self) -> OutputGrammar:
        wanted, schema = self._schema()
        if wanted:
            self._grammar = json_grammar(schema)  # ValueError: a 400 naming the field
        return self

    @property
    def grammar(self) -> str | None:
        """The output's grammar (`runtime.json_grammar`'s); None for text."""
        return self._grammar


class ResponseFormatSpec(OutputGrammar):
    """`response_format`: text, any JSON object, or JSON following a schema, enforced by a grammar
    compiled here by llguidance (a schema that does not compile is a 400)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None
    #: llama-cpp-python's spelling: `{"type": "json_object", "schema": {...}}`.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")

    def _schema(self) -> tuple[bool, dict[str, Any] | None]:
        if self.type == "text":
            if self.json_schema is not None or self.schema_ is not None:
                raise ValueError("type 'text' takes no schema")
            return False, None
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ValueError("type 'json_schema' needs a 'json_schema' object")
            return True, self.json_schema.schema_
        if self.json_schema is not None:
            raise ValueError("type 'json_object' takes no 'json_schema' (use type 'json_schema')")
        return True, self.schema_


#: OpenAI's rule for a function's name.
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionSpec(Strict):
    """A function the model may call: its name, what it does, and its arguments' JSON schema."""

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    #: A JSON schema of an object (None: any object).
    parameters: dict[str, Any] | None = None
    #: Either way the arguments follow the schema when a grammar constrains the call.
    strict: bool | None = None


def function_type_only(value: str) -> str:
    """A tool's `type` where only functions are taken (Anthropic's tools; Responses' function tools,
    whose other types have their own classes): web search and the like run on OpenAI's side."""
    if value != "function":
        raise ValueError(f"tool type {value!r} is not supported (only 'function')")
    return value


class CustomGrammar(Strict):
    """The grammar a custom tool's input follows: llguidance's Lark (close to OpenAI's, which is
    also Lark) or a Rust `regex` pattern (OpenAI's syntax for regex too)."""

    definition: str
    syntax: Literal["lark", "regex"]


class CustomFormat(Strict):
    """A custom tool's input: any text, or text a grammar allows."""

    type: Literal["text", "grammar"]
    grammar: CustomGrammar | None = None

    @model_validator(mode="after")
    def _grammar_given(self) -> CustomFormat:
        if (self.type == "grammar") != (self.grammar is not None):
            raise ValueError("a 'grammar' is given with format type 'grammar', and only then")
        return self

    @property
    def free_text(self) -> FreeText:
        if self.grammar is None:
            return FreeText("text")
        return FreeText(self.grammar.syntax, self.grammar.definition)


class CustomSpec(Strict):
    """A custom (freeform) tool: the model writes its input as plain text, not JSON arguments."""

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    #: None: any text.
    format: CustomFormat | None = None


class ToolSpec(Strict):
    """`tools[i]` of a chat completion: a function, or a custom tool."""

    type: str
    function: FunctionSpec | None = None
    custom: CustomSpec | None = None

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value not in ("function", "custom"):
            raise ValueError(f"tool type {value!r} is not supported (only 'function' and 'custom')")
        return value

    @model_validator(mode="after")
    def _spec_of_its_type(self) -> ToolSpec:
        if (self.function is None) == (self.custom is None) or (self.custom is not None) != self.is_custom:
            raise ValueError(f"a tool of type {self.type!r} has its spec under '{self.type}', and no other")
        return self

    @property
    def is_custom(self) -> bool:
        return self.type == "custom"

    @property
    def name(self) -> str:
        spec = self.custom if self.custom is not None else self.function
        assert spec is not None
        return spec.name


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    """`{"type": "function", "function": {"name": ...}}` or `{"type": "custom", "custom": {...}}`:
    this tool, and no text."""

    type: Literal["function", "custom"]
    function: NamedFunction | None = None
    custom: NamedFunction | None = None

    @model_validator(mode="after")
    def _named_under_its_type(self) -> NamedToolChoice:
        if (self.function if self.type == "function" else self.custom) is None:
            raise ValueError(f"a tool choice of type {self.type!r} names its tool under '{self.type}'")
        return self

    @property
    def name(self) -> str:
        named = self.function if self.type == "function" else self.custom
        assert named is not None
        return named.name


class CalledFunction(Strict):
    name: str
    #: The arguments as the JSON text the server returned: re-rendered as they were generated.
    arguments: str


class CalledCustom(Strict):
    name: str
    #: The input text as the server returned it.
    input: str


class FunctionToolCall(Strict):
    """An assistant message's `tool_calls[i]` of a function, as a response gave it."""

    id: str
    type: Literal["function"]
    function: CalledFunction

    is_custom: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return self.function.name

    @property
    def payload(self) -> str:
        """The arguments' JSON text."""
        return self.function.arguments


class CustomToolCall(Strict):
    """An assistant message's `tool_calls[i]` of a custom tool, as a response gave it."""

    id: str
    type: Literal["custom"]
    custom: CalledCustom

    is_custom: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return self.custom.name

    @property
    def payload(self) -> str:
        """The input text."""
        return self.custom.input


def _call_kind(call: Any) -> str:
    """Custom calls apart; every other type goes to the function call, whose error names the type."""
    custom = (call.get("type") if isinstance(call, dict) else getattr(call, "type", None)) == "custom"
    return branch_tag("custom" if custom else "function")


ToolCall = Annotated[Annotated[FunctionToolCall, Tag(branch_tag("function"))]
                     | Annotated[CustomToolCall, Tag(branch_tag("custom"))], Discriminator(_call_kind)]


class _GenerationFields(Strict):
    """Fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    #: 0 or -1: no top-k (-1 as vLLM spells it).
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    #: Choices: the same prompt run n times (prefilled once; the cache serves the rest).
    n: int | None = Field(default=1, ge=1, le=MAX_CHOICES)
    #: llama.cpp's penalties (its penalties sampler) over the last PENALTY_LAST_N tokens of prompt
    #: and output, as llama-server counts them: subtracted once per occurrence / once if present.
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    #: llama.cpp's (and llama-cpp-python's) multiplicative repeat penalty; 1 is off.
    repeat_penalty: float | None = Field(default=None, gt=0.0)
    #: {token id: bias}, added to the token's logit before sampling (greedy too).
    logit_bias: dict[str, float] | None = None
    #: Text, or JSON through a grammar the output must follow.
    response_format: ResponseFormatSpec | None = None
    #: Ignored: an end-user id for OpenAI's abuse monitoring; it cannot change the output.
    user: str | None = None
    #: Own cache namespace: requests with different salts never share cached state.
    cache_salt: CacheSalt | None = None
    cache: CacheControl = Field(default_factory=CacheControl)
    #: Keep this prompt's entry resident (bounded share of the pool; `POST /v1/cache/unpin` releases it).
    pin: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("must be a string or a list of strings")
        # How many and how long: the server's limits (limits.py), which an operator sets.
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            # isdigit alone takes "²" and any length, which int() then refuses.
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f"keys must be token ids, got {key[:20]!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"a bias must be within -{MAX_LOGIT_BIAS:g}..{MAX_LOGIT_BIAS:g}, got {bias}")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (the newer name) wins over max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def choices(self) -> int:
        return self.n or 1

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            top_k=max(self.top_k or 0, 0),
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            repeat_penalty=1.0 if self.repeat_penalty is None else self.repeat_penalty,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            logit_bias=tuple((int(token), bias) for token, bias in (self.logit_bias or {}).items()),
            grammar=self.response_format.grammar if self.response_format is not None else None,
        )

    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())


class CompletionRequest(_GenerationFields):
    IGNORED = frozenset({"user"})
    prompt: str | list[int]
    #: Each sampled token's logprob and those of this many most likely tokens (OpenAI's legacy shape).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    #: Return the prompt's text before the completion.
    echo: bool = False
    #: Not supported: text after the insertion point. Accepted only as null or "".
    suffix: Any = None
    #: Not supported: sample several and return the best. Accepted only as null or 1.
    best_of: Any = None

    @field_validator("suffix", "best_of", mode="before")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> None:
        refuse_unless_inert(value, info)
        return None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        return _prompt_shape(value)

    @field_validator("echo")
    @classmethod
    def _echo_without_logprobs(cls, value: bool, info: ValidationInfo) -> bool:
        # OpenAI then gives the prompt tokens' logprobs too: a logits row per prompt
        # token, which prefill (and a cache hit all the more) never computes.
        if value and info.data.get("logprobs") is not None:
            raise ValueError("echo together with logprobs is not supported (prompt tokens have no logprobs here)")
        return value

    def max_tokens_or_default(self) -> int:
        requested = self.requested_max_tokens
        return COMPLETIONS_DEFAULT_MAX_TOKENS if requested is None else requested

    @property
    def top_logprobs_wanted(self) -> int | None:
        """How many alternatives each token's logprobs carry; None: no logprobs."""
        return self.logprobs


class ChatMessage(Strict):
    #: "function": the legacy form of a tool result, named by its function (`name`).
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    #: A string, or a list of `{"type": "text", "text": ...}` parts (joined with newlines).
    content: str | None = None
    name: str | None = None
    #: A tool message's call: it must answer a call an earlier assistant message made.
    tool_call_id: str | None = None
    #: An assistant message's calls, as a response returned them.
    tool_calls: list[ToolCall] | None = None
    #: The legacy form of one call (`functions`); the request turns it into `tool_calls`.
    function_call: CalledFunction | None = None
    #: Accepted only empty (null): a refusal or audio cannot be replayed here.
    refusal: Any = None
    audio: Any = None
    annotations: Any = None

    @field_validator("refusal", "audio", "annotations", mode="before")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> None:
        refuse_unless_inert(value, info)
        return None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of content parts")
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"only text content parts are supported, got {kind!r}")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError("a text content part needs a string 'text'")
            texts.append(text)
        return "\n".join(texts)


class ChatCompletionRequest(_GenerationFields):
    IGNORED = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                         "prompt_cache_retention", "prompt_cache_options"})
    messages: list[ChatMessage] = Field(min_length=1)
    #: Functions the model may call (server/tools.py renders them and parses the calls).
    tools: list[ToolSpec] | None = None
    #: none, auto (the default with tools), required (at least one call), or one named tool.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    #: With `required` or a named tool: one call or several (default one, as llama-server's).
    parallel_tool_calls: bool | None = None

    @field_validator("messages")
    @classmethod
    def _results_answer_calls(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        called: set[str] = set()
        for k, message in enumerate(messages):
            called.update(call.id for call in message.tool_calls or ())
            if message.role == "tool" and message.tool_call_id not in called:
                raise ValueError(f"messages[{k}] is a tool result for {message.tool_call_id!r}, "
                                 "which no earlier assistant message called")
        return messages

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[ToolSpec] | None) -> list[ToolSpec] | None:
        names = [tool.name for tool in tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("two tools have the same name")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if choice == "required" or isinstance(choice, NamedToolChoice):
            if not tools:
                raise ValueError("a tool choice other than 'none' or 'auto' needs 'tools'")
        if isinstance(choice, NamedToolChoice) and (choice.name, choice.type) not in {(t.name, t.type) for t in tools}:
            raise ValueError(f"the {choice.type} tool {choice.name!r} is not among 'tools'")
        return choice

    @property
    def tool_mode(self) -> str:
        """none, auto, required, or the named tool's name."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.name
        return self.tool_choice or ("auto" if self.tools else "none")
    #: Each output token's logprob (`choices[].logprobs.content`), with `top_logprobs` alternatives.
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def top_logprobs_wanted(self) -> int | None:
        """How many alternatives each token's logprobs carry; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    # Ignored: what the official client sends that cannot change the output.
    #: Key-value tags of a stored completion (nothing is stored).
    metadata: dict[str, str] | None = None
    #: Whether OpenAI keeps the completion for its evals; nothing is kept here.
    store: bool | None = None
    #: OpenAI's processing tier; there is one tier here.
    service_tier: str | None = None
    #: An end-user id for abuse monitoring, like `user`.
    safety_identifier: str | None = None
    #: Hints for OpenAI's prompt cache; this server's reuse is exact and needs none (see `cache_salt`).
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    #: Text is what this server produces; any other modality is refused.
    modalities: list[Literal["text"]] | None = None

    #: The legacy form of `tools` and `tool_choice` (one call at most); the response answers in
    #: kind, with `message.function_call` and finish_reason `function_call`.
    functions: list[FunctionSpec] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    _legacy: bool = PrivateAttr(default=False)

    # Not supported; accepted only with a value that asks for nothing.
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    moderation: Any = None

    @field_validator("audio", "prediction", "web_search_options", "reasoning_effort", "verbosity", "moderation",
                     mode="before")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> None:
        refuse_unless_inert(value, info)
        return None

    @field_validator("function_call")
    @classmethod
    def _function_among_functions(cls, choice: Any, info: ValidationInfo) -> Any:
        names = {f.name for f in info.data.get("functions") or ()}
        if isinstance(choice, NamedFunction) and choice.name not in names:
            raise ValueError(f"the function {choice.name!r} is not among 'functions'")
        return choice

    @model_validator(mode="after")
    def _legacy_functions_as_tools(self) -> ChatCompletionRequest:
        """`functions`, `function_call` and `role: "function"` messages as the tools they stand for."""
        legacy_history = any(m.function_call is not None or m.role == "function" for m in self.messages)
        if not self.functions and self.function_call is None and not legacy_history:
            return self
        if self.tools or self.tool_choice is not None:
            raise ValueError("give either tools and tool_choice or the legacy functions and function_call")
        choice = self.function_call
        self.tools = [ToolSpec(type="function", function=f) for f in self.functions or ()] or None
        if isinstance(choice, NamedFunction):
            self.tool_choice = NamedToolChoice(type="function", function=choice)
        else:
            self.tool_choice = choice
        self.messages = _legacy_history(self.messages)
        self._legacy = True
        return self

    @property
    def legacy_functions(self) -> bool:
        """The request spoke of `functions`: the response speaks of `function_call`."""
        return self._legacy


def _legacy_history(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Legacy calls and results as tool calls and tool messages: a call gets the id `call_<k>` of
    its message's index, and a result answers the last call made (the legacy form has one at a time)."""
    out: list[ChatMessage] = []
    last_call: str | None = None
    for k, message in enumerate(messages):
        if message.function_call is not None:
            last_call = f"call_{k}"
            call = FunctionToolCall(id=last_call, type="function", function=message.function_call)
            message = message.model_copy(update={"function_call": None, "tool_calls": [call]})
        elif message.role == "function":
            if last_call is None:
                raise ValueError(f"messages[{k}] is a function result, but no earlier assistant message "
                                 "called a function")
            message = message.model_copy(update={"role": "tool", "tool_call_id": last_call, "name": None})
        out.append(message)
    return out


class CacheQuery(Strict):
    """POST /v1/cache/explain and /v1/cache/unpin: a prompt as a request would send it, not run."""

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    #: The tools a chat request would send: they are rendered into its prompt.
    tools: list[ToolSpec] | None = None
    cache_salt: CacheSalt | None = None
    cache: CacheControl = Field(default_factory=CacheControl)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        return None if value is None else _prompt_shape(value)

    @model_validator(mode="after")
    def _one_prompt(self) -> CacheQuery:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class UnpinRequest(CacheQuery):
    """With `all`, every pin is released and no prompt is needed."""

    all: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> UnpinRequest:
        if not self.all and (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages', or 'all': true")
        return self


def _prompt_shape(value: Any) -> Any:
    """A prompt as a string or token ids; errors name the field, not pydantic's union branch."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str | list) and len(value) == 0:
        raise ValueError("the prompt is empty")
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(type(t) is int for t in value):
        return value
    raise ValueError("must be a string or a list of token ids (batches of prompts are not supported)")
