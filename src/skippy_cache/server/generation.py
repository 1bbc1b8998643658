"""POST /v1/completions and /v1/chat/completions: body -> tokens -> engine -> response or SSE stream;
and the prompts of /v1/cache/explain and /v1/cache/unpin, tokenized the same way."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from skippy_cache.radix import shared_length
from skippy_cache.runtime import (
    DoneEvent,
    Engine,
    EngineClosedError,
    FinishReason,
    GenerationRequest,
    QueueFullError,
    RequestError,
    SamplingParams,
    TokenEvent,
    TokenLogprobs,
)
from skippy_cache.server.bridge import EngineRun, EngineRuns, cancel_on_disconnect
from skippy_cache.server.chat import ChatFormatter, ChatTemplateError
from skippy_cache.server.errors import APIError, error_body, from_engine_error, from_validation_errors
from skippy_cache.server.limits import RequestLimits
from skippy_cache.server.metrics import ServerMetrics
from skippy_cache.server.modelnames import ModelNames
from skippy_cache.server.responses import ChatFormat, Choice, CompletionFormat, ResponseFormat
from skippy_cache.server.responses import explanation_answer
from skippy_cache.server.schemas import (
    CacheQuery,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    UnpinRequest,
)
from skippy_cache.server.settings import ServerSettings
from skippy_cache.server.tools import call_grammar, render_messages

T = TypeVar("T", bound=BaseModel)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt tokens and what the cache is told about where its messages sit in them."""

    tokens: list[int]
    #: `GenerationRequest.replies`: earlier assistant replies, as (start, end) positions.
    replies: tuple[tuple[int, int], ...] = ()
    #: `GenerationRequest.prefix_ends`: where the system message ends.
    prefix_ends: tuple[int, ...] = ()


@dataclass(frozen=True)
class Generation:
    engine: Engine
    settings: ServerSettings
    chat: ChatFormatter
    metrics: ServerMetrics
    models: ModelNames
    limits: RequestLimits
    system_fingerprint: str

    @property
    def model_id(self) -> str:
        return self.models.served

    async def completions(self, request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        self.models.check(body.model)
        self.limits.check_stop(body.stop)
        tokens = await self._prompt_tokens(body.prompt)
        self.limits.check_prompt(len(tokens), param="prompt")
        max_tokens = body.max_tokens_or_default()
        echo = ""
        if body.echo:
            prompt = body.prompt
            echo = prompt if isinstance(prompt, str) else await asyncio.to_thread(self.engine.detokenize, tokens)
        run = self._submit(body, Prompt(tokens), max_tokens, prompt_param="prompt")
        fmt = CompletionFormat(self.model_id, self.system_fingerprint, echo=echo,
                               logprobs=body.logprobs is not None)
        return await self._respond(request, run, body, fmt)

    async def chat_completions(self, request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest)
        self.models.check(body.model)
        self.limits.check_stop(body.stop)
        self.limits.check_messages(len(body.messages))
        grammar = _tool_grammar(body)
        messages = render_messages(body.messages, body.tools or [])
        prompt = await asyncio.to_thread(self._chat_prompt, messages)
        tokens = prompt.tokens
        self.limits.check_prompt(len(tokens), param="messages")
        max_tokens = body.requested_max_tokens
        if max_tokens is None:
            # Up to what the context has left, capped (settings.DEFAULT_CHAT_MAX_TOKENS says why);
            # at least 1 so a prompt that fills the context gets the engine's context error.
            max_tokens = max(min(self.settings.default_max_tokens, self.engine.info.n_ctx - len(tokens)), 1)
        run = self._submit(body, prompt, max_tokens, prompt_param="messages", grammar=grammar)
        names = {t.function.name for t in body.tools or ()} if body.tool_mode != "none" else None
        fmt = ChatFormat(self.model_id, self.system_fingerprint, logprobs=bool(body.logprobs),
                         tool_names=names or None)
        return await self._respond(request, run, body, fmt)

    async def explain(self, request: Request) -> Response:
        """What a request with this prompt would reuse right now, from where, and why not more."""
        body = await _parse(request, CacheQuery)
        query = await self._query(body)
        try:
            explanation = await asyncio.to_thread(self.engine.explain, query)
        except (RequestError, EngineClosedError) as exc:
            raise from_engine_error(exc, prompt_param="prompt" if body.prompt is not None else "messages") from None
        return JSONResponse({"object": "cache.explanation", "skippy_cache": explanation_answer(explanation)})

    async def unpin(self, request: Request) -> Response:
        """Release the pin on a prompt's entry, or (`all`) every pin."""
        body = await _parse(request, UnpinRequest)
        query = None if body.all else await self._query(body)
        try:
            released = await asyncio.to_thread(self.engine.unpin, query)
        except (RequestError, EngineClosedError) as exc:
            raise from_engine_error(exc, prompt_param="prompt" if body.prompt is not None else "messages") from None
        return JSONResponse({"object": "cache.unpin", "released": released})

    async def _query(self, body: CacheQuery) -> GenerationRequest:
        self.models.check(body.model)
        if body.messages is not None:
            self.limits.check_messages(len(body.messages))
            prompt = await asyncio.to_thread(self._chat_prompt, render_messages(body.messages, body.tools or []))
        else:
            assert body.prompt is not None  # CacheQuery holds exactly one of the two
            prompt = Prompt(await self._prompt_tokens(body.prompt))
        return GenerationRequest(tokens=prompt.tokens, max_tokens=1, namespace=body.cache_salt,
                                 lookup=body.cache.lookup, replies=prompt.replies, prefix_ends=prompt.prefix_ends)

    # -- steps -----------------------------------------------------------------

    async def _prompt_tokens(self, prompt: str | list[int]) -> list[int]:
        """A completions-style prompt as tokens: text is tokenized (off the event loop), ids taken as given."""
        if isinstance(prompt, str):
            return await asyncio.to_thread(self.engine.tokenize, prompt)
        return list(prompt)

    def _chat_prompt(self, messages: list[ChatMessage]) -> Prompt:
        """The messages' prompt tokens; where earlier assistant replies sit in them
        (`GenerationRequest.replies`): every one in deterministic mode, whose kernels depend on
        them, the last one in fast mode, where they only name the partial chunk a lookup by name
        may end on (one render more per request, not one per turn); and where the system message
        ends (`GenerationRequest.prefix_ends`): the prefix every user of one system prompt shares."""
        try:
            tokens = self._chat_tokens(messages)
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_value") from None
        replies = []
        for k in reversed(range(1, len(messages))):
            message = messages[k]
            if message.role != "assistant" or not message.content:
                continue
            try:
                # The reply was generated after the prompt of the messages before it.
                start = len(self._chat_tokens(messages[:k]))
            except ChatTemplateError:
                continue  # a template may refuse a history cut there: the reply is then not reused
            replies.append((start, start + len(self.engine.tokenize(message.content, add_special=False))))
            if not self.engine.info.deterministic:
                break
        return Prompt(tokens, tuple(reversed(replies)), self._system_end(messages, tokens))

    def _system_end(self, messages: list[ChatMessage], tokens: list[int]) -> tuple[int, ...]:
        """Where the prompt stops being the system message's alone: as far as it agrees with the
        system message rendered on its own (empty: no system message, or nothing after it)."""
        if len(messages) < 2 or messages[0].role not in ("system", "developer"):
            return ()
        try:
            alone = self._chat_tokens(messages[:1])
        except ChatTemplateError:
            return ()  # a template may refuse a system message alone: nothing is marked
        end = shared_length(alone, tokens)
        return (end,) if 0 < end < len(tokens) else ()

    def _chat_tokens(self, messages: list[ChatMessage]) -> list[int]:
        text = self.chat.render(messages)
        # The template may already emit BOS; the tokenizer would add a second one.
        return self.engine.tokenize(text, add_special=not self.chat.starts_with_bos(text))

    def _submit(self, body: CompletionRequest | ChatCompletionRequest, prompt: Prompt, max_tokens: int,
                *, prompt_param: str, grammar: str | None = None) -> EngineRuns:
        """One engine request per choice (`n`), all with the same prompt: the first prefills it, the
        others share its cells in flight or reuse its entry, so a choice costs about its decode.
        `grammar`: the tool calls' (the request's own, from `response_format`, otherwise)."""
        sampling = body.sampling()
        if grammar is not None:
            sampling = replace(sampling, grammar=grammar)
        runs: list[EngineRun] = []
        try:
            for index in range(body.choices):
                request = GenerationRequest(
                    tokens=prompt.tokens,
                    max_tokens=max_tokens,
                    sampling=_choice_sampling(sampling, index),
                    stop=body.stop_strings(),
                    namespace=body.cache_salt,
                    lookup=body.cache.lookup,
                    record=body.cache.store,
                    pin=body.pin,
                    top_logprobs=body.top_logprobs_wanted,
                    replies=prompt.replies,
                    prefix_ends=prompt.prefix_ends,
                )
                runs.append(EngineRun(self.engine, request, on_done=self.metrics.observe_done))
        except (RequestError, QueueFullError, EngineClosedError) as exc:
            for run in runs:
                run.cancel()
            raise from_engine_error(exc, prompt_param=prompt_param) from None
        return EngineRuns(runs)

    async def _respond(self, request: Request, runs: EngineRuns,
                       body: CompletionRequest | ChatCompletionRequest, fmt: ResponseFormat) -> Response:
        # Cancels the engine requests if the client goes away; ends by itself
        # once the response is complete (the server then reports a disconnect).
        watcher = asyncio.create_task(cancel_on_disconnect(request, runs))
        if body.stream:
            events = _sse(runs, fmt, body.include_usage, watcher)
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            choices = await _collect(runs)
        finally:
            # A watcher that ended by itself saw the client go (no response was sent yet).
            client_left = watcher.done() and not watcher.cancelled()
            watcher.cancel()
            runs.cancel()
        for choice in choices:
            done = choice.done
            if done.finish_reason is FinishReason.ERROR:
                raise APIError(500, done.error or "generation failed", type="server_error")
            if done.finish_reason is FinishReason.CANCELLED:
                raise _cancelled(client_left)
        return JSONResponse(fmt.response(choices))


def _tool_grammar(body: ChatCompletionRequest) -> str | None:
    """The grammar `tool_choice` asks for (required, or a named tool); None for auto and none.

    Every tool's schema is converted whatever the choice, so a schema the converter refuses is a
    400 on the request that sends it, not on a later one that asks for a call."""
    if not body.tools:
        return None
    mode = body.tool_mode
    # One call unless asked for more, as llama-server does: small models asked for "one or more"
    # tend to repeat a call until max_tokens.
    parallel = body.parallel_tool_calls is True
    try:
        grammar = call_grammar(body.tools, "required" if mode in ("none", "auto") else mode, parallel)
    except ValueError as exc:
        raise APIError(400, str(exc), param="tools", code="invalid_value") from None
    if mode in ("none", "auto"):
        return None
    if body.response_format is not None and body.response_format.grammar is not None:
        raise APIError(400, "response_format cannot constrain a reply that tool_choice makes a tool call",
                       param="response_format", code="invalid_value")
    return grammar


def _choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` draws with seed + index, so seeded choices differ and each is reproducible
    (choice i of a seeded request is what n=1 with seed + i gives)."""
    if index == 0 or sampling.seed is None:
        return sampling
    return replace(sampling, seed=sampling.seed + index)


async def _collect(runs: EngineRuns) -> list[Choice]:
    """Every choice's DoneEvent and, when the request asked, its tokens' logprobs."""
    logprobs: list[list[TokenLogprobs]] = [[] for _ in range(len(runs))]
    dones: list[DoneEvent | None] = [None] * len(runs)
    async for index, event in runs.events():
        if isinstance(event, TokenEvent):
            if event.logprobs is not None:
                logprobs[index].append(event.logprobs)
        else:
            dones[index] = event
    return [Choice(i, done, logprobs[i]) for i, done in enumerate(dones) if done is not None]


def _cancelled(client_left: bool) -> APIError:
    if client_left:
        # Nobody reads this answer; 499 (nginx's "client closed request") keeps a client
        # that went away out of the server's 5xx count, where it would look like a failure.
        return APIError(499, "the client closed the request", code="client_closed_request")
    # The server is shutting down without draining.
    return APIError(503, "the request was cancelled", type="server_error", code="cancelled")


async def _parse(request: Request, model: type[T]) -> T:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _sse(runs: EngineRuns, fmt: ResponseFormat, include_usage: bool,
               watcher: asyncio.Task[None]) -> AsyncIterator[str]:
    """OpenAI's server-sent events: chunks (each naming its choice's `index`), then `data: [DONE]`.

    However the stream ends (finished, client gone and this generator
    cancelled or closed), `finally` cancels the engine requests, so an
    abandoned request frees its lanes at the engine's next step.
    """
    try:
        for chunk in fmt.opening_chunks(len(runs)):
            yield _event(chunk)
        stats = []
        async for index, event in runs.events():
            if isinstance(event, TokenEvent):
                # A token with logprobs gets its chunk even while its text is held back.
                if event.text or event.logprobs is not None:
                    for chunk in fmt.delta_chunks(index, event.text, event.logprobs):
                        yield _event(chunk)
                continue
            if event.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                for chunk in fmt.final_chunks(index, event.finish_reason):
                    yield _event(chunk)
                stats.append((index, event.stats))
            else:
                # Headers are gone already; OpenAI reports mid-stream failures as an error event.
                message = event.error or f"the request was {event.finish_reason.value}"
                yield _event(error_body(message, "server_error", code=event.finish_reason.value))
                break
        else:
            if include_usage:
                yield _event(fmt.usage_chunk([s for _, s in sorted(stats, key=lambda item: item[0])]))
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        runs.cancel()
