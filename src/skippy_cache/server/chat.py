"""Chat messages to prompt text with the model's own chat template.

The GGUF's `tokenizer.chat_template` is a Hugging Face jinja2 template; it is
rendered the way `transformers`' `apply_chat_template` does (sandboxed
environment, trim_blocks/lstrip_blocks, `raise_exception`, `tojson`,
`strftime_now`, the `{% generation %}` tag, `bos_token`/`eos_token`,
`add_generation_prompt=True`), so the model sees the prompt format it was
trained on. A model without a template gets plain ChatML.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from skippy_cache.server.schemas import ChatMessage

log = logging.getLogger("skippy_cache.server")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template refused the messages (its `raise_exception`, or a rendering error)."""


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


class ChatFormatter:
    def __init__(self, template: str | None, *, bos_token: str, eos_token: str) -> None:
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = _environment()
        self.source = "gguf"
        if not template:
            template, self.source = CHATML_TEMPLATE, "chatml-fallback"
        try:
            self._template = env.from_string(template)
        except jinja2.TemplateError as exc:
            # Completions must keep working with a broken template; say so loudly.
            log.warning("the model's chat template does not compile (%s); chat uses ChatML instead", exc)
            self._template, self.source = env.from_string(CHATML_TEMPLATE), "chatml-fallback"

    def render(self, messages: Sequence[ChatMessage]) -> str:
        try:
            return self._template.render(
                messages=[_message_dict(m) for m in messages],
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template rejected the messages: {exc}") from exc

    def starts_with_bos(self, text: str) -> bool:
        """True when the rendered text already carries BOS, so tokenizing must not add another."""
        return bool(self.bos_token) and text.startswith(self.bos_token)


def _message_dict(message: ChatMessage) -> dict[str, str]:
    # Templates know system/user/assistant(/tool); OpenAI's newer "developer" role is the system role.
    role = "system" if message.role == "developer" else message.role
    out = {"role": role, "content": message.content or ""}
    if message.name is not None:
        out["name"] = message.name
    return out
