"""Chat messages to prompt text with the model's own chat template.

The GGUF's `tokenizer.chat_template` is a Hugging Face jinja2 template; it is
rendered the way `transformers`' `apply_chat_template` does (sandboxed
environment, trim_blocks/lstrip_blocks, `raise_exception`, `tojson`,
`strftime_now`, the `{% generation %}` tag, `bos_token`/`eos_token`,
`add_generation_prompt=True`), so the model sees the prompt format it was
trained on. `--chat-template` overrides it with a Jinja file or one of llama.cpp's
built-in templates by name; a GGUF without a template gets the built-in its
architecture was trained on where one is known, else plain ChatML. Which one
renders is said in the start-up block, since a wrong one degrades every answer
without any error.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from skippy_cache.runtime import apply_builtin_chat_template
from skippy_cache.server.schemas import ChatMessage, ToolSpec
from skippy_cache.server.tools import call_text

log = logging.getLogger("skippy_cache.server")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


#: llama.cpp's built-in template for a GGUF that carries none, by its `general.architecture`:
#: only where the architecture names one prompt format (a "llama" GGUF may be Llama 2, 3 or
#: Mistral, so it gets none and falls back to ChatML).
BUILTIN_BY_ARCHITECTURE = {
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "gemma3n": "gemma",
    "phi3": "phi3",
    "qwen2": "chatml",
    "qwen3": "chatml",
    "command-r": "command-r",
    "cohere2": "command-r",
    "deepseek2": "deepseek2",
    "chatglm": "chatglm4",
    "exaone": "exaone3",
    "granite": "granite",
    "minicpm": "minicpm",
    "orion": "orion",
    "rwkv6": "rwkv-world",
    "rwkv7": "rwkv-world",
}


#: The made-up tool and call the load-time probe renders (`ChatFormatter._probe`).
PROBE_TOOL = {"type": "function", "function": {
    "name": "skippy_probe_tool", "description": "skippy-probe-description",
    "parameters": {"type": "object", "properties": {"skippy_probe_arg": {"type": "integer"}}}}}
PROBE_CALL_TEXT = call_text("skippy_probe_tool", '{"skippy_probe_arg": 7}')


@dataclass(frozen=True)
class TemplateCaps:
    """What a chat template renders, probed at load."""

    #: A system message (Gemma's templates refuse one: it then opens the first user turn).
    system_role: bool
    #: Tools, calls and tool results, calls in the syntax server/tools.py parses; otherwise the
    #: tools go into the system message and calls and results into text (tools.py's fallback).
    tools: bool
    #: A system message after the conversation's start, where it stands (ChatML's, Qwen's and
    #: Llama 3's templates take one; Gemma's refuse it: it then ends the user turn before it).
    late_system: bool = True

    def describe(self) -> str:
        tools = "rendered by the template" if self.tools else "fallback block in the system message"
        system = "" if self.system_role else "; no system role (it opens the first user turn)"
        late = "" if self.late_system or not self.system_role else "; a later system message ends the user turn before it"
        return f"tools {tools}{system}{late}"


class ChatTemplateError(ValueError):
    """The template refused the messages (its `raise_exception`, or a rendering error)."""


@dataclass(frozen=True)
class ChatTemplate:
    """What renders chat messages: a Jinja source, or one of llama.cpp's built-in templates."""

    #: Where it came from, for the start-up block ("GGUF tokenizer.chat_template", ...).
    origin: str
    jinja: str | None = None
    builtin: str | None = None


def choose_chat_template(setting: Path | str | None, gguf_template: str | None, architecture: str) -> ChatTemplate:
    """`--chat-template` (a Jinja file or a built-in's name) over the GGUF's template, over the
    built-in for the GGUF's architecture, over ChatML."""
    if isinstance(setting, Path):
        return ChatTemplate(f"file {setting} (--chat-template)", jinja=setting.read_text())
    if setting is not None:
        return ChatTemplate(f"llama.cpp built-in {setting!r} (--chat-template)", builtin=setting)
    if gguf_template:
        return ChatTemplate("GGUF tokenizer.chat_template", jinja=gguf_template)
    if architecture in BUILTIN_BY_ARCHITECTURE:
        name = BUILTIN_BY_ARCHITECTURE[architecture]
        return ChatTemplate(f"none in the GGUF: llama.cpp built-in {name!r} for architecture {architecture} "
                            "(--chat-template to choose another)", builtin=name)
    return ChatTemplate(f"none in the GGUF and no built-in for architecture {architecture}: ChatML "
                        "(--chat-template to choose another)", jinja=CHATML_TEMPLATE)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' version: jinja2's own `tojson` escapes HTML, which changes the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`: marks assistant text for training masks; renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_template(source: str) -> jinja2.Template:
    """A Jinja chat template compiled as transformers compiles it (jinja2.TemplateError if it cannot)."""
    return _environment().from_string(source)


class ChatFormatter:
    """Renders chat messages to prompt text with the template `choose_chat_template` picked."""

    def __init__(self, template: ChatTemplate, *, bos_token: str, eos_token: str) -> None:
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.template = template
        self._template = None
        if template.jinja is not None:
            try:
                self._template = compile_template(template.jinja)
            except jinja2.TemplateError as exc:
                if template.origin.startswith("file "):
                    raise ChatTemplateError(f"--chat-template: {template.origin} does not compile: {exc}") from None
                # Completions must keep working with a broken template; say so loudly.
                log.warning("the model's chat template does not compile (%s); chat uses ChatML instead", exc)
                self._template = _environment().from_string(CHATML_TEMPLATE)
                self.template = ChatTemplate(f"{template.origin} does not compile: ChatML", jinja=CHATML_TEMPLATE)

        self.caps = self._probe()

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = (),
               scrub: Callable[[str], str] | None = None) -> str:
        """The prompt text of `messages`; `tools` go to a template that renders them (`caps.tools`).
        `scrub` rewrites every string the client sent (all but the roles) before rendering."""
        dicts = [_message_dict(m) for m in messages]
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools]
        if scrub is not None:
            dicts = [_scrubbed(d, scrub) for d in dicts]
            tool_dicts = [_scrubbed(t, scrub) for t in tool_dicts]
        if not (self.caps.system_role and self.caps.late_system):
            dicts = _late_system_folded(dicts)
        if not self.caps.system_role and len(dicts) > 1 and dicts[0]["role"] == "system":
            # A template that refuses the system role (Gemma's) gets it as the first user turn's opening.
            system, first = dicts[0], dicts[1]
            dicts = [{**first, "content": f"{system['content']}\n\n{first['content']}"}, *dicts[2:]]
        return self._render(dicts, tool_dicts)

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
        if self._template is None:
            turns = [(m["role"], m["content"]) for m in messages]
            try:
                return apply_builtin_chat_template(self.template.builtin or "", turns)
            except ValueError as exc:
                raise ChatTemplateError(str(exc)) from exc
        try:
            return self._template.render(
                messages=messages,
                tools=tools or None,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except Exception as exc:  # a template is a program: any failure of it is its refusal
            raise ChatTemplateError(f"the model's chat template rejected the messages: {exc}") from exc

    def _probe(self) -> TemplateCaps:
        """What the template renders, from a few renders of made-up messages at load.

        Tools count as native only where the template renders all three (the tools, a call and a
        result) and writes the call in the syntax server/tools.py parses and constrains
        (Hermes', as Qwen 2.5 and 3 and the Hermes models do): the reply the model is steered to
        write is then the call the template re-renders on the next turn.
        """
        def renders(messages: list[dict[str, Any]], tools: list[dict[str, Any]], *needles: str) -> bool:
            try:
                text = self._render(messages, tools)
            except ChatTemplateError:
                return False
            return all(needle in text for needle in needles)

        if self._template is None:
            return TemplateCaps(system_role=True, tools=False)
        user = {"role": "user", "content": "skippy-probe-user"}
        system = renders([{"role": "system", "content": "skippy-probe-system"}, user], [],
                         "skippy-probe-system", "skippy-probe-user")
        call = {"id": "call_probe", "type": "function",
                "function": {"name": PROBE_TOOL["function"]["name"], "arguments": {"skippy_probe_arg": 7}}}
        history = [user, {"role": "assistant", "content": "", "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_probe", "content": "skippy-probe-result"}]
        tools = renders(history, [PROBE_TOOL], PROBE_TOOL["function"]["description"], PROBE_CALL_TEXT,
                        "skippy-probe-result")
        late = renders([user, {"role": "system", "content": "skippy-probe-late"}], [], "skippy-probe-user",
                       "skippy-probe-late")
        return TemplateCaps(system_role=system, tools=tools, late_system=late)

    def starts_with_bos(self, text: str) -> bool:
        """True when the rendered text already carries BOS, so tokenizing must not add another."""
        return bool(self.bos_token) and text.startswith(self.bos_token)


def _late_system_folded(dicts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every system message past the first message, for a template that takes none there: its text
    ends the user turn before it (opens the next one when no user turn precedes it). The turn
    before, not the next: a conversation that grows appends after the system message, so the
    rendered text up to it stays what it was and the cache's prefix still holds."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    for i, message in enumerate(dicts):
        if i > 0 and message["role"] == "system":
            last = next((j for j in range(len(out) - 1, -1, -1) if out[j]["role"] == "user"), None)
            if last is None:
                pending.append(message["content"])
            else:
                out[last] = {**out[last], "content": f"{out[last]['content']}\n\n{message['content']}"}
        elif pending and message["role"] == "user":
            out.append({**message, "content": "\n\n".join([*pending, message["content"]])})
            pending = []
        else:
            out.append(message)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    """A message as Hugging Face templates take it: a call's arguments as an object (templates
    write them with `tojson`), a tool result with its call's id."""
    # Templates know system/user/assistant(/tool); OpenAI's newer "developer" role is the system role.
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": message.content or ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "custom", "custom": {"name": c.name, "input": c.payload}}
                             if c.is_custom else
                             {"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": _arguments(c.payload)}}
                             for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def client_strings(messages: Sequence[ChatMessage], tools: Sequence[ToolSpec] = ()) -> list[str]:
    """Every string the client sent in `messages` and `tools` (all but the roles), as rendered."""
    out: list[str] = []
    stack: list[Any] = [_message_dict(m) for m in messages] + [t.model_dump(exclude_none=True) for t in tools]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, dict):
            stack.extend(v for k, v in node.items() if k != "role")
            stack.extend(k for k in node if isinstance(k, str) and k != "role")
        elif isinstance(node, list):
            stack.extend(node)
    return out


def _scrubbed(node: Any, scrub: Callable[[str], str], key: str = "") -> Any:
    if isinstance(node, str):
        return node if key == "role" else scrub(node)
    if isinstance(node, dict):
        return {(scrub(k) if k != "role" else k): _scrubbed(v, scrub, k) for k, v in node.items()}
    if isinstance(node, list):
        return [_scrubbed(v, scrub) for v in node]
    return node


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # as sent: the template writes what it was given
