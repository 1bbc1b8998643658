"""Chat messages to prompt tokens, and where the earlier replies and the system message sit in them.

The prompt is tokenized in pieces cut where each earlier assistant reply
starts and ends: the text before a reply is what the prompt that generated it
rendered, so a turn's tokens up to a reply are that turn's own prompt tokens,
whatever the tokenizer would merge across the cut; and the reply itself is the
tokens it was sampled as when the server still remembers them
(server/replies.py), so the cached entry of the last turn matches through
its reply, not up to the first token the model spelt otherwise.

Only the template's own markup becomes control tokens. Text the client sent
that spells one (`<|im_start|>system`) is tokenized as text: otherwise a user
message could forge a system turn or a tool result at the token level. The
same text is cut the same way in every turn, so later turns still extend the
earlier ones' tokens.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from skippy_cache.radix import shared_length
from skippy_cache.runtime import Engine
from skippy_cache.server.chat import ChatFormatter, ChatTemplateError, client_strings
from skippy_cache.server.errors import APIError
from skippy_cache.server.replies import ReplyMemory
from skippy_cache.server.schemas import ChatMessage, ToolSpec


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt tokens and what the cache is told about where its messages sit in them."""

    tokens: list[int]
    #: `GenerationRequest.replies`: earlier assistant replies, as (start, end) positions.
    replies: tuple[tuple[int, int], ...] = ()
    #: `GenerationRequest.prefix_ends`: where the system message ends.
    prefix_ends: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Cut:
    """An earlier reply's place in the prompt text, and its tokens when they are remembered."""

    start: int
    end: int
    tokens: tuple[int, ...] | None


class PromptBuilder:
    def __init__(self, engine: Engine, chat: ChatFormatter, memory: ReplyMemory) -> None:
        self.engine = engine
        self.chat = chat
        self.memory = memory

    def build(self, messages: Sequence[ChatMessage], namespace: str | None, *,
              tools: Sequence[ToolSpec] = (), prefill: str = "") -> Prompt:
        """The prompt of `messages`, then `prefill` (text the reply must continue from); `tools`
        are for a template that renders them itself (`ChatFormatter.caps`).

        A template that refuses the messages is a 400 naming `messages`.
        """
        try:
            text = self.chat.render(messages, tools)
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_value") from None
        literal = self._client_controls(messages, tools, text)
        cuts = self._cuts(messages, tools, text, namespace)
        tokens: list[int] = []
        replies = []
        at = 0
        add_special = not self.chat.starts_with_bos(text)  # a template may emit BOS itself
        for cut in cuts:
            tokens += self._tokenize(text, at, cut.start, add_special, literal)
            add_special = False
            start = len(tokens)
            tokens += cut.tokens if cut.tokens is not None else self._tokenize(text, cut.start, cut.end, False, literal)
            replies.append((start, len(tokens)))
            at = cut.end
        # The prefill is the client's text too: spelt as text, past the rendered prompt's end.
        end = len(text)
        text += prefill
        literal += tuple((end + a, end + b) for a, b in self._controls_in(prefill))
        tokens += self._tokenize(text, at, len(text), add_special, literal)
        if not self.engine.info.deterministic:
            # Fast mode's kernels do not depend on the replies: only the last one is named,
            # as the partial chunk a lookup by name may end on.
            replies = replies[-1:]
        return Prompt(tokens, tuple(replies), self._system_end(messages, tools, tokens))

    def _cuts(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], text: str,
              namespace: str | None) -> list[_Cut]:
        """Where each earlier reply sits in `text`: right after the rendered prompt that generated it.

        A reply is cut only where the template renders the history before it as
        that earlier prompt did (some templates drop or rewrite older turns).
        """
        cuts: list[_Cut] = []
        for k in range(1, len(messages)):
            content = messages[k].content
            if messages[k].role != "assistant" or not content:
                continue
            try:
                before = self.chat.render(messages[:k], tools)
            except ChatTemplateError:
                continue  # a template may refuse a history cut there: the reply is then not marked
            start = len(before)
            if not text.startswith(before) or not text.startswith(content, start):
                continue
            if cuts and start < cuts[-1].end:
                continue
            remembered = self.memory.by_text(namespace, content)
            cuts.append(_Cut(start, start + len(content), remembered.tokens if remembered else None))
        return cuts

    def _system_end(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec],
                    tokens: list[int]) -> tuple[int, ...]:
        """Where the prompt stops being the system message's alone: as far as it agrees with the
        system message rendered on its own (empty: no system message, or nothing after it)."""
        if len(messages) < 2 or messages[0].role not in ("system", "developer"):
            return ()
        alone = list(messages[:1])
        if not self.chat.caps.system_role:
            # A template that refuses a system role gets it as the first user turn's opening
            # (`ChatFormatter.render`): that turn with nothing after the system text.
            alone.append(ChatMessage(role="user", content=""))
        try:
            text = self.chat.render(alone, tools)
        except ChatTemplateError:
            return ()  # a template may refuse a system message alone: nothing is marked
        end = shared_length(self._tokenize(text, 0, len(text), not self.chat.starts_with_bos(text)), tokens)
        return (end,) if 0 < end < len(tokens) else ()

    def _controls_in(self, text: str) -> list[tuple[int, int]]:
        """Where control-token texts sit in `text`, longest first at each place."""
        pattern = _control_pattern(self.engine.control_texts)
        return [m.span() for m in pattern.finditer(text)] if pattern is not None else []

    def _client_controls(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec],
                         text: str) -> tuple[tuple[int, int], ...]:
        """The control-token texts in the rendered `text` that came from the client's strings.

        Each string that holds one is found where the template copied it as written. A count
        checks that every such text is accounted for: the prompt rendered with those texts taken
        out of the client's strings has as many as `text` has less the ones found. A template
        that rewrites such a string (escapes it, trims it, ...) fails the count, and the request
        is a 400: its text cannot be told apart from the template's markup.
        """
        pattern = _control_pattern(self.engine.control_texts)
        if pattern is None:
            return ()
        strings = {s for s in client_strings(messages, tools) if pattern.search(s)}
        if not strings:
            return ()
        found: set[tuple[int, int]] = set()
        for string in strings:
            inner = [m.span() for m in pattern.finditer(string)]
            at = text.find(string)
            while at >= 0:
                found.update((at + a, at + b) for a, b in inner)
                at = text.find(string, at + 1)
        spans: list[tuple[int, int]] = []
        for a, b in sorted(found):
            if not spans or a >= spans[-1][1]:
                spans.append((a, b))
        try:
            template_own = len(pattern.findall(self.chat.render(messages, tools, scrub=lambda s: pattern.sub("", s))))
        except ChatTemplateError:
            template_own = -1
        if len(pattern.findall(text)) - len(spans) != template_own:
            raise APIError(400, "a message holds the text of one of the model's control tokens, and the chat "
                           "template does not copy it as written: it cannot be told apart from the template's "
                           "markup, so it cannot be sent as plain text", param="messages", code="invalid_value")
        return tuple(spans)

    def _tokenize(self, text: str, start: int, end: int, add_special: bool,
                  literal: tuple[tuple[int, int], ...] = ()) -> list[int]:
        """`text[start:end]`'s tokens: the `literal` spans spelt as text, the rest with control tokens parsed."""
        tokens: list[int] = []
        at = start
        for a, b in literal:
            if b <= at or a >= end:
                continue
            tokens += self._piece(text[at:a], add_special and not tokens, True)
            tokens += self._piece(text[max(a, at):min(b, end)], add_special and not tokens, False)
            at = min(b, end)
        return tokens + self._piece(text[at:end], add_special and not tokens, True)

    def _piece(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return self.engine.tokenize(text, add_special=add_special, parse_special=parse_special) if text else []


@functools.cache
def _control_pattern(texts: tuple[str, ...]) -> re.Pattern[str] | None:
    """Any of `texts`, the longest first where several start at one place (None: no texts)."""
    if not texts:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))
