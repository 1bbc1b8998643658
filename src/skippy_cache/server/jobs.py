"""The one internal request shape the front ends feed: what a request asks of the engine.

Chat completions, Anthropic Messages and OpenAI Responses each parse their own
body and turn it into a `ChatJob`; from there one path renders the prompt,
builds the tool grammar, submits the engine requests and splits the replies,
so the three behave alike and share one cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from skippy_cache.runtime import Keep, SamplingParams
from skippy_cache.server.schemas import ChatMessage, ToolSpec
from skippy_cache.server.tenants import Scope


def scoped(scope: Scope, cache_salt: str | None) -> dict:
    """The `Job` fields a request's scope (its caller) and `cache_salt` decide."""
    return {"namespace": scope.namespace(cache_salt), "tenant": scope.tenant, "keep": scope.keep}


@dataclass(frozen=True, kw_only=True)
class Job:
    """A request's generation settings, its prompt aside."""

    sampling: SamplingParams
    #: False: the request set no temperature, and the server's --default-temperature replaces
    #: the one in `sampling`.
    temperature_given: bool = True
    #: None: as many as the context has left, capped by --default-max-tokens.
    max_tokens: int | None
    stop: tuple[str, ...] = ()
    #: The cache namespace: `cache_salt` inside the caller's tenant or shared namespace (tenants.Scope).
    namespace: str | None = None
    #: The caller's tenant (None: the server has no tenants).
    tenant: str | None = None
    #: Where the tenant's entries may go when they leave the pool.
    keep: Keep = Keep.ALL
    lookup: bool = True
    record: bool = True
    pin: bool = False
    #: Choices (`n`): the same prompt run this many times.
    choices: int = 1
    #: Each token's logprob and this many alternatives (None: no logprobs).
    top_logprobs: int | None = None


@dataclass(frozen=True, kw_only=True)
class ChatJob(Job):
    """A chat request, whichever API it came through."""

    messages: list[ChatMessage]
    tools: list[ToolSpec] = field(default_factory=list)
    #: none, auto, required, or the name of the one tool to call.
    tool_mode: str = "none"
    #: With required or named: one call, or one or more.
    parallel: bool = False
    #: Text the reply continues (Anthropic's prefill: a last assistant message); not part of the reply.
    prefill: str = ""
    #: The request field a bad prompt is reported under.
    prompt_param: str = "messages"
    #: `max_tokens` is an upper bound the reply may stop short of (Anthropic's `max_tokens`, the
    #: Responses API's `max_output_tokens`), not a length the context must hold: past what the
    #: context has left it is cut to that. Claude Code asks for 64,000 to 128,000 on every request.
    max_tokens_bound: bool = False

    @property
    def constrained(self) -> bool:
        """A grammar holds the reply to calls (required or named): calls may stream as generated."""
        return bool(self.tools) and self.tool_mode not in ("none", "auto")

    @property
    def tool_names(self) -> set[str] | None:
        """The function tools a reply may call (None: calls are not looked for)."""
        if self.tool_mode == "none" or not self.tools:
            return None
        return {t.name for t in self.tools if not t.is_custom}

    @property
    def custom_names(self) -> frozenset[str]:
        """The custom tools a reply may call: their calls are text, not JSON arguments."""
        if self.tool_mode == "none":
            return frozenset()
        return frozenset(t.name for t in self.tools if t.is_custom)
