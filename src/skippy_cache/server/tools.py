"""Tool calls on /v1/chat/completions: tools rendered into the prompt, calls parsed out of the reply.

One syntax for every model, Hermes style (what Qwen 2.5/3 and the Hermes models are trained on):
the tools' JSON schemas in a `<tools>` block at the end of the system message; each call a
`<tool_call>` block holding `{"name": ..., "arguments": ...}`; each result a `<tool_response>`
block in a user turn (every chat template knows the user role; not every one knows `tool`).

The cache reuses a turn's prompt and reply only if the next turn renders them to the same
tokens. So a past call is re-rendered exactly as it was generated: the fixed text around it, and
its `arguments` string as the response returned it. `tool_choice` required or named constrains
the reply with a grammar whose fixed text is that same wrapping, so what is generated is what
will be re-rendered.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from skippy_cache.runtime import literal_json_grammar
from skippy_cache.server.schemas import ChatMessage, ToolSpec

OPEN = "<tool_call>\n"
CLOSE = "\n</tool_call>"
#: Between two calls of one reply (what the grammar puts there).
BETWEEN = "\n"
_OPEN_TAG = "<tool_call>"
_CLOSE_TAG = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

TOOLS_PREAMBLE = (
    "You may call one or more functions to answer. The functions, as JSON schemas:\n<tools>\n"
)
TOOLS_CALL_FORMAT = (
    "\n</tools>\nTo call a function, answer with a <tool_call></tool_call> block holding a JSON object "
    "with its name and arguments, one block per call:\n"
    '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>'
)


def _call_head(name: str) -> str:
    return f'{OPEN}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it, and as a later turn re-renders it."""
    return f"{_call_head(name)}{arguments}}}{CLOSE}"


def tools_block(tools: Sequence[ToolSpec]) -> str:
    """The system message's addition: every tool's schema, one JSON object a line, in the given order."""
    lines = [json.dumps({"type": "function", "function": t.function.model_dump(exclude_none=True)},
                        ensure_ascii=False) for t in tools]
    return TOOLS_PREAMBLE + "\n".join(lines) + TOOLS_CALL_FORMAT


def render_messages(messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]) -> list[ChatMessage]:
    """The messages as the chat template gets them: the tools block in the system message, past
    calls in their assistant message's text, results as user turns."""
    out: list[ChatMessage] = []
    for message in messages:
        if message.tool_calls:
            calls = BETWEEN.join(call_text(c.function.name, c.function.arguments) for c in message.tool_calls)
            text = f"{message.content}{BETWEEN}{calls}" if message.content else calls
            message = message.model_copy(update={"content": text, "tool_calls": None})
        elif message.role == "tool":
            text = f"<tool_response>\n{message.content or ''}\n</tool_response>"
            message = message.model_copy(update={"role": "user", "content": text, "tool_call_id": None})
        out.append(message)
    if tools:
        block = tools_block(tools)
        if out[0].role in ("system", "developer"):
            first = out[0]
            out[0] = first.model_copy(update={"content": f"{first.content}\n\n{block}" if first.content else block})
        else:
            out.insert(0, ChatMessage(role="system", content=block))
    return out


def call_grammar(tools: Sequence[ToolSpec], mode: str, parallel: bool) -> str | None:
    """GBNF for `tool_choice` required (any tool) or named (that one), one call or, with
    `parallel`, several; None for auto and none. ValueError names a tool whose schema the
    converter refuses."""
    if mode in ("none", "auto"):
        return None
    chosen = [t for t in tools if mode == "required" or t.function.name == mode]
    alternatives = [(f"the parameters of tool {t.function.name!r}", _call_head(t.function.name),
                     t.function.parameters or {"type": "object"}, "}" + CLOSE) for t in chosen]
    return literal_json_grammar(alternatives, repeat_with=BETWEEN if parallel else None)


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    #: The arguments' JSON text as generated (re-rendered as is by the next turn).
    arguments: str


def _parse_block(body: str, names: set[str]) -> Call | None:
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
    return Call(f"call_{uuid.uuid4().hex[:24]}", data["name"], arguments)


@dataclass
class Delta:
    """What a stream sends next: text, or one whole call."""

    text: str = ""
    call: Call | None = None


@dataclass
class CallSplitter:
    """Splits a reply, as it streams, into text and calls.

    Text that might begin a `<tool_call>` tag is held until it is known; whitespace next to a
    call is dropped. A block that does not parse as a call of a known tool stays text, never an
    error. The non-streamed response runs the same splitter over the whole reply, so the two agree.
    """

    names: set[str]
    _buffer: str = ""
    _held: str = ""
    _in_call: bool = False
    _after_call: bool = False
    _before_call: str = ""
    calls: list[Call] = field(default_factory=list)

    def feed(self, text: str) -> list[Delta]:
        self._buffer += text
        out: list[Delta] = []
        while True:
            if self._in_call:
                end = self._buffer.find(_CLOSE_TAG)
                if end < 0:
                    return out
                block = self._buffer[: end + len(_CLOSE_TAG)]
                self._buffer = self._buffer[end + len(_CLOSE_TAG):]
                self._in_call = False
                match = _BLOCK.fullmatch(block)
                call = _parse_block(match.group(1), self.names) if match else None
                before, self._before_call = self._before_call, ""
                if call is None:
                    self._held = before
                    out += self._text(block, hold_trailing=True)
                else:
                    self._after_call = True
                    self.calls.append(call)
                    out.append(Delta(call=call))
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
        """The end of the reply: an unfinished block, or held text, is text."""
        rest, self._buffer, self._in_call = self._buffer, "", False
        self._held, self._before_call = self._before_call + self._held, ""
        return self._text(rest)

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


def split_reply(text: str, names: set[str]) -> tuple[str, list[Call]]:
    """A whole reply's text (what is not a call) and its calls."""
    splitter = CallSplitter(names)
    deltas = splitter.feed(text) + splitter.finish()
    return "".join(d.text for d in deltas), splitter.calls
