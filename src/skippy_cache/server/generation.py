"""POST /v1/completions and /v1/chat/completions: body -> tokens -> engine -> response or SSE stream;
the chat path the Messages and Responses APIs take too (`Generation.start_chat`); and the prompts
of /v1/cache/explain and /v1/cache/unpin, tokenized the same way."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

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
from skippy_cache.server.chat import ChatFormatter
from skippy_cache.server.errors import APIError, error_body, from_engine_error
from skippy_cache.server.http import SSE_HEADERS, parse_body, sse_event
from skippy_cache.server.jobs import ChatJob, Job, scoped
from skippy_cache.server.limits import RequestLimits, TenantRequests
from skippy_cache.server.metrics import ServerMetrics
from skippy_cache.server.modelnames import ModelNames
from skippy_cache.server.prompts import Prompt, PromptBuilder
from skippy_cache.server.replies import Reply, ReplyMemory
from skippy_cache.server.responses import (
    ChatFormat,
    Choice,
    CompletionFormat,
    OpenAIFormat,
    explanation_answer,
)
from skippy_cache.server.schemas import (
    CacheQuery,
    ChatCompletionRequest,
    CompletionRequest,
    UnpinRequest,
)
from skippy_cache.server.settings import ServerSettings
from skippy_cache.server.tenants import Scope, caller_of, scope_of
from skippy_cache.server.tools import TRIGGER, CallSplitter, Delta, call_grammar, render_messages, uses_custom
from skippy_cache.server.tracelog import TraceLog


@dataclass(frozen=True)
class Generation:
    engine: Engine
    settings: ServerSettings
    chat: ChatFormatter
    metrics: ServerMetrics
    models: ModelNames
    limits: RequestLimits
    system_fingerprint: str
    memory: ReplyMemory = field(default_factory=ReplyMemory)
    tenant_requests: TenantRequests = field(default_factory=lambda: TenantRequests(0))
    #: Where each ended request is logged (`--trace-log`), if anywhere.
    trace: TraceLog | None = None

    @property
    def model_id(self) -> str:
        return self.models.served

    @property
    def prompts(self) -> PromptBuilder:
        return PromptBuilder(self.engine, self.chat, self.memory)

    async def completions(self, request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        self.models.check(body.model)
        self.limits.check_stop(body.stop)
        tokens = await self._prompt_tokens(body.prompt)
        self.limits.check_prompt(len(tokens), param="prompt")
        echo = ""
        if body.echo:
            prompt = body.prompt
            echo = prompt if isinstance(prompt, str) else await asyncio.to_thread(self.engine.detokenize, tokens)
        job = Job(**_job_fields(body, scope_of(request)), max_tokens=body.max_tokens_or_default(),
                  top_logprobs=body.logprobs)
        run = self.submit(job, Prompt(tokens), prompt_param="prompt")
        fmt = CompletionFormat(self.model_id, self.system_fingerprint, echo=echo,
                               logprobs=body.logprobs is not None)
        return await self._respond(request, run, body, fmt)

    async def chat_completions(self, request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        self.models.check(body.model)
        job = ChatJob(**_job_fields(body, scope_of(request)), max_tokens=body.requested_max_tokens,
                      top_logprobs=body.top_logprobs_wanted, messages=body.messages, tools=body.tools or [],
                      tool_mode=body.tool_mode,
                      # One call unless asked for more, as llama-server does: small models asked
                      # for "one or more" tend to repeat a call until max_tokens.
                      parallel=body.parallel_tool_calls is True)
        runs, _ = await self.start_chat(job)
        fmt = ChatFormat(self.model_id, self.system_fingerprint, logprobs=bool(body.logprobs),
                         tool_names=job.tool_names, custom_names=job.custom_names, incremental=job.constrained,
                         legacy_functions=body.legacy_functions)
        return await self._respond(request, runs, body, fmt, job)

    async def prompt_size(self, job: ChatJob) -> int:
        """How many tokens a chat job's prompt has, as `start_chat` would render it."""
        self.limits.check_messages(len(job.messages))
        await asyncio.to_thread(tool_sampling, job)  # the same 400s for tools whose schemas do not compile
        prompt = await asyncio.to_thread(self._chat_prompt, job)
        return len(prompt.tokens)

    async def start_chat(self, job: ChatJob) -> tuple[EngineRuns, int]:
        """Render a chat job's prompt (tools, past calls and results included), check it against the
        limits and submit it, with the tool grammar its `tool_mode` asks for. Returns the runs and
        the prompt's length."""
        self.limits.check_stop(list(job.stop))
        self.limits.check_messages(len(job.messages))
        # Off the event loop: every tool's schema is compiled to a grammar.
        job = replace(job, sampling=await asyncio.to_thread(tool_sampling, job))
        prompt = await asyncio.to_thread(self._chat_prompt, job)
        self.limits.check_prompt(len(prompt.tokens), param=job.prompt_param)
        n_ctx = self.engine.info.n_ctx
        if job.max_tokens is None:
            # Up to what the context has left, capped (settings.DEFAULT_CHAT_MAX_TOKENS says why);
            # at least 1 so a prompt that fills the context gets the engine's context error.
            job = replace(job, max_tokens=max(min(self.settings.default_max_tokens, n_ctx - len(prompt.tokens)), 1))
        elif job.max_tokens_bound:
            job = replace(job, max_tokens=max(min(job.max_tokens, n_ctx - len(prompt.tokens)), 1))
        return self.submit(job, prompt, prompt_param=job.prompt_param), len(prompt.tokens)

    def _chat_prompt(self, job: ChatJob) -> Prompt:
        def recall(call_id: str) -> str | None:
            reply = self.memory.by_call(job.namespace, call_id)
            return reply.text if reply is not None else None

        native = self.chat.caps.tools and not uses_custom(job.messages, job.tools)
        messages = render_messages(job.messages, job.tools, recall, native=native)
        return self.prompts.build(messages, job.namespace, tools=job.tools if native else (), prefill=job.prefill)

    def remember(self, job: Job, done: DoneEvent, call_ids: tuple[str, ...] = ()) -> None:
        """Keep a finished chat reply's sampled tokens for the next turn that resends it (replies.py)."""
        if not job.record or done.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return
        # A stop string cut inside a token leaves text the tokens do not spell: not kept.
        if self.engine.detokenize(list(done.tokens)) == done.text:
            self.memory.remember(job.namespace, Reply(done.text, done.tokens), call_ids)

    async def explain(self, request: Request) -> Response:
        """What a request with this prompt would reuse right now, from where, and why not more."""
        body = await parse_body(request, CacheQuery)
        query = await self._query(body, scope_of(request))
        try:
            explanation = await asyncio.to_thread(self.engine.explain, query)
        except (RequestError, EngineClosedError) as exc:
            raise from_engine_error(exc, prompt_param="prompt" if body.prompt is not None else "messages") from None
        return JSONResponse({"object": "cache.explanation", "skippy_cache": explanation_answer(explanation)})

    async def unpin(self, request: Request) -> Response:
        """Release the pin on a prompt's entry, or (`all`) every pin."""
        body = await parse_body(request, UnpinRequest)
        if body.all and not caller_of(request).admin:
            raise APIError(403, "all: only an admin key may release every pin; name the prompt to release yours",
                           type="permission_error", param="all", code="forbidden")
        query = None if body.all else await self._query(body, scope_of(request))
        try:
            released = await asyncio.to_thread(self.engine.unpin, query)
        except (RequestError, EngineClosedError) as exc:
            raise from_engine_error(exc, prompt_param="prompt" if body.prompt is not None else "messages") from None
        return JSONResponse({"object": "cache.unpin", "released": released})

    async def _query(self, body: CacheQuery, scope: Scope) -> GenerationRequest:
        self.models.check(body.model)
        namespace = scope.namespace(body.cache_salt)
        if body.messages is not None:
            self.limits.check_messages(len(body.messages))
            job = ChatJob(sampling=SamplingParams(), max_tokens=1, **scoped(scope, body.cache_salt),
                          messages=body.messages, tools=body.tools or [])
            prompt = await asyncio.to_thread(self._chat_prompt, job)
        else:
            assert body.prompt is not None  # CacheQuery holds exactly one of the two
            prompt = Prompt(await self._prompt_tokens(body.prompt))
        return GenerationRequest(tokens=prompt.tokens, max_tokens=1, namespace=namespace, tenant=scope.tenant,
                                 lookup=body.cache.lookup, replies=prompt.replies, prefix_ends=prompt.prefix_ends)

    # -- steps -----------------------------------------------------------------

    async def _prompt_tokens(self, prompt: str | list[int]) -> list[int]:
        """A completions-style prompt as tokens: text is tokenized (off the event loop), ids taken as given."""
        if isinstance(prompt, str):
            return await asyncio.to_thread(self.engine.tokenize, prompt)
        return list(prompt)

    def submit(self, job: Job, prompt: Prompt, *, prompt_param: str) -> EngineRuns:
        """One engine request per choice (`n`), all with the same prompt: the first prefills it, the
        others share its cells in flight or reuse its entry, so a choice costs about its decode."""
        assert job.max_tokens is not None
        if job.choices > (queue := self.engine.info.max_queue):
            # Each choice waits in the queue: more than it holds could never be taken, and a 503's
            # "retry later" would be retried for ever.
            raise APIError(400, f"n={job.choices} asks for more choices than this server's queue holds ({queue}; "
                           "--queue-size)", param="n", code="invalid_value")
        sampling = job.sampling
        if not job.temperature_given:
            sampling = replace(sampling, temperature=self.settings.default_temperature)
        runs: list[EngineRun] = []
        tenant = job.tenant
        try:
            self.tenant_requests.take(tenant, job.choices)
        except APIError:
            assert tenant is not None  # only a tenant is limited
            self.metrics.refused(tenant)
            raise
        arrived = time.monotonic()

        def done(event: DoneEvent) -> None:
            self.tenant_requests.release(tenant)
            self.metrics.observe_done(event, tenant)
            if self.trace is not None:
                self.trace.write(arrived, prompt.tokens, event.stats.completion_tokens, tenant)

        try:
            for index in range(job.choices):
                request = GenerationRequest(
                    tokens=prompt.tokens,
                    max_tokens=job.max_tokens,
                    sampling=_choice_sampling(sampling, index),
                    stop=job.stop,
                    namespace=job.namespace,
                    tenant=tenant,
                    keep=job.keep,
                    lookup=job.lookup,
                    record=job.record,
                    pin=job.pin,
                    top_logprobs=job.top_logprobs,
                    replies=prompt.replies,
                    prefix_ends=prompt.prefix_ends,
                )
                runs.append(EngineRun(self.engine, request, on_done=done))
        except BaseException as exc:
            # The runs submitted give theirs back with their DoneEvent (cancelled); the rest now, on
            # every path: a slot kept here is the tenant's for good, and its requests 429s.
            self.tenant_requests.release(tenant, job.choices - len(runs))
            for run in runs:
                run.cancel()
            if isinstance(exc, RequestError | QueueFullError | EngineClosedError):
                raise from_engine_error(exc, prompt_param=prompt_param) from None
            raise
        return EngineRuns(runs)

    async def _respond(self, request: Request, runs: EngineRuns, body: CompletionRequest | ChatCompletionRequest,
                       fmt: OpenAIFormat, job: ChatJob | None = None) -> Response:
        # Cancels the engine requests if the client goes away; ends by itself
        # once the response is complete (the server then reports a disconnect).
        watcher = asyncio.create_task(cancel_on_disconnect(request, runs))
        if body.stream:
            remember = (lambda index, done: self.remember(job, done, fmt.call_ids(index))) if job else None
            events = _sse(runs, fmt, body.include_usage, watcher, remember)
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        choices = await collect(request, runs, watcher)
        answer = fmt.response(choices)
        if job is not None:
            for choice in choices:
                self.remember(job, choice.done, fmt.call_ids(choice.index))
        return JSONResponse(answer)

    async def respond_one(self, request: Request, runs: EngineRuns, job: ChatJob, fmt: OneReplyFormat,
                          stream: bool) -> Response:
        """A one-reply API's answer, whole or streamed; the reply is remembered either way (replies.py)."""
        watcher = asyncio.create_task(cancel_on_disconnect(request, runs))
        if stream:
            return StreamingResponse(self._one_stream(runs, job, fmt, watcher), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        done = (await collect(request, runs, watcher))[0].done
        answer = fmt.whole(done)
        self.remember(job, done, fmt.call_ids())
        return JSONResponse(answer)

    async def _one_stream(self, runs: EngineRuns, job: ChatJob, fmt: OneReplyFormat,
                          watcher: asyncio.Task[None]) -> AsyncIterator[str]:
        # However the stream ends, the engine requests are cancelled (a no-op once they finished).
        try:
            async for text in fmt.events(runs):
                yield text
            done = runs.runs[0].done
            if done is not None:
                self.remember(job, done, fmt.call_ids())
        finally:
            watcher.cancel()
            runs.cancel()


class OneReplyFormat(Protocol):
    """The response of an API with one reply per request (Messages, Responses): whole, or as events."""

    def whole(self, done: DoneEvent) -> dict: ...

    def events(self, runs: EngineRuns) -> AsyncIterator[str]: ...

    def call_ids(self) -> tuple[str, ...]: ...


async def reply_deltas(runs: EngineRuns, splitter: CallSplitter | None) -> AsyncIterator[list[Delta] | DoneEvent]:
    """A one-reply run as each API's stream walks it: what each token adds (text, or a call's
    start, arguments and end, from `splitter` when calls are looked for), what the splitter held
    back once the reply ended, then the run's DoneEvent, however it ended."""
    async for _, event in runs.events():
        if isinstance(event, TokenEvent):
            yield splitter.feed(event.text) if splitter is not None else [Delta(text=event.text)]
            continue
        if splitter is not None and event.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            yield splitter.finish()
        yield event


def _job_fields(body: CompletionRequest | ChatCompletionRequest, scope: Scope) -> dict:
    """The `Job` fields both OpenAI bodies spell alike."""
    return {"sampling": body.sampling(), "temperature_given": body.temperature is not None,
            "stop": body.stop_strings(), **scoped(scope, body.cache_salt),
            "lookup": body.cache.lookup, "record": body.cache.store, "pin": body.pin, "choices": body.choices}


def tool_sampling(job: ChatJob) -> SamplingParams:
    """The job's sampling with the grammar its `tool_mode` asks for: required or named, a call
    from the first token; auto, a call once the reply opens one (a lazy grammar), unless
    `response_format` already holds the reply to a grammar; none, as it is.

    Every tool's schema is compiled whatever the choice, so a schema that does not compile is a
    400 on the request that sends it, not on a later one that asks for a call. Takes as long as
    the compiles (bounded by the runtime's grammar limits): call it off the event loop."""
    if not job.tools:
        return job.sampling
    mode = job.tool_mode
    try:
        # Under none too: the schemas are checked, though no grammar is used.
        grammar = call_grammar(job.tools, "required" if mode == "none" else mode, job.parallel)
    except ValueError as exc:
        raise APIError(400, str(exc), param="tools", code="invalid_value") from None
    if mode == "none" or (mode == "auto" and job.sampling.grammar is not None):
        return job.sampling
    if mode == "auto":
        return replace(job.sampling, grammar=grammar, grammar_trigger=TRIGGER)
    if job.sampling.grammar is not None:
        raise APIError(400, "response_format cannot constrain a reply that tool_choice makes a tool call",
                       param="response_format", code="invalid_value")
    return replace(job.sampling, grammar=grammar)


async def collect(request: Request, runs: EngineRuns, watcher: asyncio.Task[None]) -> list[Choice]:
    """Every choice, finished; a failed or cancelled one is the APIError the client gets instead."""
    try:
        choices = await _collect(runs)
    finally:
        # A watcher that ended by itself saw the client go (no response was sent yet).
        client_left = watcher.done() and not watcher.cancelled()
        watcher.cancel()
        runs.cancel()
    for choice in choices:
        done = choice.done
        if done.finish_reason is FinishReason.ERROR and done.request_fault:
            raise APIError(400, done.error or "the request cannot be generated", code="invalid_value")
        if done.finish_reason is FinishReason.ERROR:
            raise APIError(500, done.error or "generation failed", type="server_error")
        if done.finish_reason is FinishReason.CANCELLED:
            raise _cancelled(client_left)
    return choices


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


async def _sse(runs: EngineRuns, fmt: OpenAIFormat, include_usage: bool, watcher: asyncio.Task[None],
               remember: Callable[[int, DoneEvent], None] | None = None) -> AsyncIterator[str]:
    """OpenAI's server-sent events: chunks (each naming its choice's `index`), then `data: [DONE]`.

    However the stream ends (finished, client gone and this generator
    cancelled or closed), `finally` cancels the engine requests, so an
    abandoned request frees its lanes at the engine's next step.
    """
    try:
        for chunk in fmt.opening_chunks(len(runs)):
            yield sse_event(chunk)
        stats = []
        async for index, event in runs.events():
            if isinstance(event, TokenEvent):
                # A token with logprobs gets its chunk even while its text is held back.
                if event.text or event.logprobs is not None:
                    for chunk in fmt.delta_chunks(index, event.text, event.logprobs):
                        yield sse_event(chunk)
                continue
            if event.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                for chunk in fmt.final_chunks(index, event.finish_reason):
                    yield sse_event(chunk)
                stats.append((index, event.stats))
                if remember is not None:
                    remember(index, event)
            else:
                # Headers are gone already; OpenAI reports mid-stream failures as an error event.
                message = event.error or f"the request was {event.finish_reason.value}"
                yield sse_event(error_body(message, "server_error", code=event.finish_reason.value))
                break
        else:
            if include_usage:
                yield sse_event(fmt.usage_chunk([s for _, s in sorted(stats, key=lambda item: item[0])]))
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        runs.cancel()
