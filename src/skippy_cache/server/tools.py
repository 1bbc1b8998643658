"""Tool calls for all three chat APIs: tools, past calls and results for the chat template, the
grammar of a call, and a reply split into text and calls.

One call syntax, Hermes style (what Qwen 2.5/3 and the Hermes models are trained on): each call a
`<tool_call>` block holding `{"name": ..., "arguments": ...}`. A custom (freeform) tool's call is
its name alone, `{"name": ...}`, on the block's first line, then its input as plain text up to
the closing tag: text a user's grammar may allow (a patch, say) is written as it is, not escaped
into a JSON string that grammar could not hold. A template that renders tools in that syntax
itself (`ChatFormatter.caps`) gets the messages as they are, unless custom tools are involved
(no template knows them). Every other request gets the fallback: the tools' JSON schemas in a
`<tools>` block at the end of the system message, past calls as their assistant message's text,
and each result a `<tool_response>` block in a user turn (every chat template knows the user
role; not every one knows `tool`).

The cache reuses a turn's prompt and reply only if the next turn renders them to the same
tokens. So a past call is re-rendered exactly as it was generated: the fixed text around it, and
its `arguments` string as the response returned it (or the reply itself, when the server still
remembers it). `tool_choice` required or named constrains the reply with a grammar whose fixed
text is that same wrapping, so what is generated is what will be re-rendered.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from skippy_cache.runtime import FreeText, literal_json_grammar
from skippy_cache.server.schemas import ChatMessage, ToolCall, ToolSpec

OPEN = "<tool_call>\n"
CLOSE = "\n</tool_call>"
#: Between two calls of one reply (what the grammar puts there).
BETWEEN = "\n"
_OPEN_TAG = "<tool_call>"
_CLOSE_TAG = "</tool_call>"
#: What switches `auto`'s grammar on: a call's opening tag (`SamplingParams.grammar_trigger`).
TRIGGER = _OPEN_TAG
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

TOOLS_PREAMBLE = (
    "You may call one or more functions to answer. The functions, as JSON schemas:\n<tools>\n"
)
TOOLS_CALL_FORMAT = (
    "\n</tools>\nTo call a function, answer with a <tool_call></tool_call> block holding a JSON object "
    "with its name and arguments, one block per call:\n"
    '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>'
)
#: Added to `TOOLS_CALL_FORMAT` when custom tools are offered (and only then: the prompts of
#: requests without them stay what they were).
CUSTOM_CALL_FORMAT = (
    "\nTo call a custom tool, write its name, then its input as plain text (in the format the tool "
    'gives, if any), not as JSON:\n<tool_call>\n{"name": <custom tool name>}\n<input>\n</tool_call>'
)


def _call_head(name: str) -> str:
    return f'{OPEN}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


def _custom_head(name: str) -> str:
    return f'{OPEN}{{"name": {json.dumps(name, ensure_ascii=False)}}}\n'


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it, and as a later turn re-renders it."""
    return f"{_call_head(name)}{arguments}}}{CLOSE}"


def custom_call_text(name: str, text: str) -> str:
    """One custom tool's call, its input `text` as it is."""
    return f"{_custom_head(name)}{text}{CLOSE}"


def _written(call: ToolCall) -> str:
    return custom_call_text(call.name, call.payload) if call.is_custom else call_text(call.name, call.payload)


def uses_custom(messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]) -> bool:
    """Custom tools are offered, or were called: the tools are rendered by the fallback then."""
    return any(t.is_custom for t in tools) or any(c.is_custom for m in messages for c in m.tool_calls or ())


def tools_block(tools: Sequence[ToolSpec]) -> str:
    """The system message's addition: every tool's schema (a custom tool's spec), one JSON object a
    line, in the given order."""
    lines = [json.dumps(_spec(t), ensure_ascii=False) for t in tools]
    custom = CUSTOM_CALL_FORMAT if any(t.is_custom for t in tools) else ""
    return TOOLS_PREAMBLE + "\n".join(lines) + TOOLS_CALL_FORMAT + custom


def _spec(tool: ToolSpec) -> dict:
    if tool.function is not None:
        return {"type": "function", "function": tool.function.model_dump(exclude_none=True)}
    return tool.model_dump(exclude_none=True)


def render_messages(messages: Sequence[ChatMessage], tools: Sequence[ToolSpec],
                    recall: Callable[[str], str | None] = lambda _call_id: None,
                    *, native: bool = False) -> list[ChatMessage]:
    """The messages as the chat template gets them. With `native` (a template that renders tools,
    calls and results itself, in this syntax), as they are; otherwise the tools block goes into
    the system message, past calls into their assistant message's text, results into user turns.

    Either way `recall` gives the text of the reply a call id was returned in, if the server
    remembers it (server/replies.py): a message that says what that reply said is rendered as
    that very text, spacing and all, whatever JSON spacing the client used for its arguments."""
    out: list[ChatMessage] = []
    for message in messages:
        if message.tool_calls:
            text = _replayed(message, recall(message.tool_calls[0].id))
            if text is None and native:
                out.append(message)
                continue
            if text is None:
                calls = BETWEEN.join(_written(c) for c in message.tool_calls)
                text = f"{message.content}{BETWEEN}{calls}" if message.content else calls
            message = message.model_copy(update={"content": text, "tool_calls": None})
        elif message.role == "tool" and not native:
            text = f"<tool_response>\n{message.content or ''}\n</tool_response>"
            message = message.model_copy(update={"role": "user", "content": text, "tool_call_id": None})
        out.append(message)
    if tools and not native:
        block = tools_block(tools)
        if out and out[0].role in ("system", "developer"):
            first = out[0]
            out[0] = first.model_copy(update={"content": f"{first.content}\n\n{block}" if first.content else block})
        else:
            out.insert(0, ChatMessage(role="system", content=block))
    return out


def _replayed(message: ChatMessage, reply: str | None) -> str | None:
    """`reply` if it holds what `message` says (its text, and the same calls with equal arguments)."""
    if reply is None:
        return None
    calls = message.tool_calls or []
    text, parsed = split_reply(reply, {c.name for c in calls if not c.is_custom},
                               custom=frozenset(c.name for c in calls if c.is_custom))
    if text.strip() != (message.content or "").strip() or len(parsed) != len(calls):
        return None
    for said, made in zip(calls, parsed, strict=True):
        if said.name != made.name or said.is_custom != made.custom:
            return None
        try:
            same = said.payload == made.arguments if made.custom else \
                json.loads(said.payload) == json.loads(made.arguments)
        except json.JSONDecodeError:
            return None
        if not same:
            return None
    return reply


def call_grammar(tools: Sequence[ToolSpec], mode: str, parallel: bool) -> str:
    """The grammar for `tool_choice` required (any tool) or named (that one), one call or, with
    `parallel`, several; for auto, one call of any tool from just after its opening tag (a lazy
    grammar, switched on by `TRIGGER`). ValueError names a tool whose schema does not
    compile."""
    chosen = [t for t in tools if mode in ("required", "auto") or t.name == mode]
    # Under auto the opening tag is already out when the grammar starts.
    cut = len(TRIGGER) if mode == "auto" else 0
    alternatives = [_alternative(t, cut) for t in chosen]
    return literal_json_grammar(alternatives, repeat_with=BETWEEN if parallel and mode != "auto" else None)


def _alternative(tool: ToolSpec, cut: int) -> tuple[str, str, dict | FreeText, str]:
    if tool.custom is not None:
        fmt = tool.custom.format
        return (f"the format of custom tool {tool.name!r}", _custom_head(tool.name)[cut:],
                fmt.free_text if fmt is not None else FreeText("text"), CLOSE)
    assert tool.function is not None
    return (f"the parameters of tool {tool.name!r}", _call_head(tool.name)[cut:],
            tool.function.parameters or {"type": "object"}, "}" + CLOSE)


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    #: The arguments' JSON text as generated (re-rendered as is by the next turn); a custom
    #: tool's input text.
    arguments: str
    custom: bool = False


def _parse_block(body: str, names: set[str], id_prefix: str) -> Call | None:
    """One `<tool_call>` block's call, or None where it is not a call of a known tool."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names or not isinstance(data.get("arguments"), dict):
        return None
    head = _call_head(data["name"]).removeprefix(OPEN)
    if body.startswith(head) and body.endswith("}"):
        arguments = body[len(head):-1]  # as generated, so the next turn re-renders these very tokens
    else:
        arguments = json.dumps(data["arguments"], ensure_ascii=False)
    return Call(f"{id_prefix}{uuid.uuid4().hex[:24]}", data["name"], arguments)


@dataclass
class Delta:
    """What a stream sends next: text; a call's start (`call`, its id and name, arguments to
    follow); a fragment of the started call's arguments; or the end of that call (`done`, the
    whole call). The fragments of a call concatenate to its `arguments`."""

    text: str = ""
    call: Call | None = None
    arguments: str = ""
    done: Call | None = None


#: After a call's opening tag: `{"name": "<name>", "arguments": ` as the grammar writes it.
_HEAD = re.compile(r'\s*\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')
#: After a custom call's opening tag: `{"name": "<name>"}` and a line break.
_CUSTOM_HEAD = re.compile(r'\s*\{"name": ("(?:[^"\\]|\\.)*")\}\n')
#: What may follow a call's arguments: the object's closing brace, then the closing tag.
_TAIL = re.compile(r"\}\s*$")


@dataclass
class CallSplitter:
    """Splits a reply, as it streams, into text and calls.

    Text that might begin a `<tool_call>` tag is held until it is known; whitespace next to a
    call is dropped. A block that does not parse as a call of a known tool stays text, never an
    error. The non-streamed response runs the same splitter over the whole reply, so the two agree.

    With `incremental`, a call is sent as it is generated: its start once its name is known,
    then its arguments piece by piece. Only for a reply a grammar holds to the call syntax
    (tool_choice required or named): a call already started cannot turn back into text. A call
    cut short (max_tokens) then stays a call with the arguments it got, streamed or not.
    """

    names: set[str]
    #: How the calls' ids start (`call_` for OpenAI, `toolu_` for Anthropic).
    id_prefix: str = "call_"
    incremental: bool = False
    #: Custom tools: a call's input is the text between its name and the closing tag.
    custom: frozenset[str] = frozenset()
    _buffer: str = ""
    _held: str = ""
    _in_call: bool = False
    _after_call: bool = False
    _before_call: str = ""
    #: Incremental: the call being streamed, where its arguments start in the block, and how
    #: many of their characters were sent.
    _open: Call | None = None
    _args_at: int = 0
    _sent: int = 0
    calls: list[Call] = field(default_factory=list)

    def feed(self, text: str) -> list[Delta]:
        self._buffer += text
        out: list[Delta] = []
        while True:
            if self._in_call:
                end = self._buffer.find(_CLOSE_TAG)
                if self.incremental:
                    out += self._stream_call(self._buffer if end < 0 else self._buffer[:end], final=end >= 0)
                if end < 0:
                    return out
                block = self._buffer[: end + len(_CLOSE_TAG)]
                self._buffer = self._buffer[end + len(_CLOSE_TAG):]
                self._in_call = False
                before, self._before_call = self._before_call, ""
                if self._open is not None:
                    out.append(self._close_call())
                    continue
                match = _BLOCK.fullmatch(block)
                call = self._parse_custom(block) or (
                    _parse_block(match.group(1), self.names, self.id_prefix) if match else None)
                if call is None:
                    self._held = before
                    out += self._text(block, hold_trailing=True)
                else:
                    self._after_call = True
                    self.calls.append(call)
                    out += [Delta(call=call), Delta(arguments=call.arguments), Delta(done=call)]
                continue
            start = self._buffer.find(_OPEN_TAG)
            if start >= 0:
                out += self._text(self._buffer[:start], hold_trailing=True)
                # Whitespace before a call is not content; back to text if no call comes of it.
                self._held, self._before_call = "", self._held
                self._buffer = self._buffer[start:]
                self._in_call = True
                continue
            # Keep what could be the start of the tag; the rest is text.
            keep = next((k for k in range(min(len(_OPEN_TAG) - 1, len(self._buffer)), 0, -1)
                         if _OPEN_TAG.startswith(self._buffer[-k:])), 0)
            ready, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
            return out + self._text(ready, hold_trailing=True)

    def finish(self) -> list[Delta]:
        """The end of the reply: an unfinished block, or held text, is text (an unfinished call
        already streamed stays a call)."""
        if self._open is not None:
            out = self._stream_call(self._buffer, final=True)
            self._buffer, self._in_call, self._before_call = "", False, ""
            return [*out, self._close_call()]
        rest, self._buffer, self._in_call = self._buffer, "", False
        self._held, self._before_call = self._before_call + self._held, ""
        return self._text(rest)

    def _stream_call(self, block: str, *, final: bool) -> list[Delta]:
        """The started call's arguments so far in `block` (from its opening tag, without the
        closing one); its start first, once the name is there. Held back: what may yet turn
        out to be the closing brace and whitespace; with `final`, the arguments end there."""
        out: list[Delta] = []
        if self._open is None:
            self._open, self._args_at = self._head(block)
            if self._open is None:
                return out
            self._sent = 0
            out.append(Delta(call=self._open))
        region = block[self._args_at:]
        tail = _TAIL.search(region)
        if self._open.custom:
            # The input ends before the line break that precedes the closing tag; until the tag
            # is out, what may be its start is held.
            ready = region.removesuffix("\n") if final else region[: len(region) - _tag_start(region)]
        elif final:
            ready = region[: tail.start()] if tail else region
        else:
            # From the last brace on, what may be the object's end and the start of the closing
            # tag is held: it may not be the arguments' content.
            last = region.rfind("}")
            ready = region if last < 0 or not _CLOSE_TAG.startswith(region[last + 1:].lstrip()) else region[:last]
        if len(ready) > self._sent:
            out.append(Delta(arguments=ready[self._sent:]))
            self._open = replace(self._open, arguments=ready)
            self._sent = len(ready)
        return out

    def _head(self, block: str) -> tuple[Call | None, int]:
        """The call a block (from its opening tag) starts, once its name is out, and where its
        arguments (a custom call's input) start."""
        for pattern, names, custom in ((_HEAD, self.names, False), (_CUSTOM_HEAD, self.custom, True)):
            head = pattern.match(block, len(_OPEN_TAG))
            if head is None:
                continue
            try:
                name = json.loads(head.group(1))
            except json.JSONDecodeError:
                continue
            if name in names:
                return Call(f"{self.id_prefix}{uuid.uuid4().hex[:24]}", name, "", custom), head.end()
        return None, 0

    def _parse_custom(self, block: str) -> Call | None:
        """A whole block's custom call: its input as written, but for the line break before the tag."""
        if not self.custom:
            return None
        call, at = self._head(block)
        if call is None or not call.custom:
            return None
        body = block[at: len(block) - len(_CLOSE_TAG)]
        return replace(call, arguments=body.removesuffix("\n"))

    def _close_call(self) -> Delta:
        assert self._open is not None
        call, self._open = self._open, None
        self.calls.append(call)
        self._after_call = True
        return Delta(done=call)

    def _text(self, text: str, hold_trailing: bool = False) -> list[Delta]:
        """Text to send, but for whitespace right after a call (dropped) and, with
        `hold_trailing`, trailing whitespace (held: a call may follow, and it is not content)."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        pending = self._held + text
        body = pending.rstrip() if hold_trailing else pending
        self._held = pending[len(body):]
        return [Delta(text=body)] if body else []


def _tag_start(text: str) -> int:
    """How long the end of `text` is that may begin the closing tag, with its line break."""
    return next((k for k in range(min(len(CLOSE) - 1, len(text)), 0, -1) if CLOSE.startswith(text[-k:])), 0)


def split_reply(text: str, names: set[str], id_prefix: str = "call_", incremental: bool = False, *,
                custom: frozenset[str] = frozenset()) -> tuple[str, list[Call]]:
    """A whole reply's text (what is not a call) and its calls, as `CallSplitter` streams them."""
    splitter = CallSplitter(names, id_prefix, incremental, custom)
    deltas = splitter.feed(text) + splitter.finish()
    return "".join(d.text for d in deltas), splitter.calls
