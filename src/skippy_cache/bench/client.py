"""A streaming OpenAI-compatible client that times each request and never drops a failure.

Time to first token is taken at the first streamed chunk that carries generated output
(`choices[].text`, `choices[].delta.content`, or a piece of a tool call); a chunk with only a
role, an empty string or a keep-alive does not count. Anthropic's Messages stream (`/v1/messages`)
is read by its events: text and tool_use blocks are output, usage comes with `message_delta`. A request that ends without any text but with a finish reason (the
model's first token was end-of-text) takes its TTFT from that chunk instead, since that chunk is
the first token's result. Usage comes from the final chunk (`stream_options.include_usage`);
servers that do not stream usage (llama-cpp-python's) leave the token counts `None`. llama.cpp's
llama-server also reports `timings.cache_n`, read as the cached-token count when `usage` has none.
skippy-cache adds a top-level `skippy_cache` object to the chunk with usage; its `source` says
which tier the reused state came from (resident, ram, disk, remote, or none).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Self

import httpx


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call a streamed reply made, as its chunks or events spelt it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Reply:
    """One request's outcome. `ok` False carries `error`; timings are from just before sending."""

    ok: bool
    ttft_ms: float | None
    total_ms: float
    text: str
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    error: str | None = None
    #: skippy-cache's `skippy_cache.source` (None: the server does not say).
    cache_source: str | None = None
    #: skippy-cache's `skippy_cache.restore_ms`: what its restore took of the TTFT (None: not said).
    restore_ms: float | None = None
    #: skippy-cache's `skippy_cache.queue_ms` and `prefill_ms`: the TTFT's wait for a lane and
    #: the time from admission to the first token, as the engine measured them (None: not said).
    queue_ms: float | None = None
    prefill_ms: float | None = None
    #: The tool calls the reply made (chat `delta.tool_calls`, Messages `tool_use` blocks).
    calls: tuple[ToolCall, ...] = ()


#: Anthropic's Messages API: its stream is events, not chunks, and it takes no `stream_options`.
MESSAGES = "/v1/messages"


class BenchClient:
    """One pooled `httpx.AsyncClient` for the whole run; `timeout` bounds each request end to end."""

    def __init__(self, timeout: float, max_connections: int = 16) -> None:
        self.timeout = timeout
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def get_json(self, base_url: str, path: str) -> Any:
        """GET `base_url + path` and parse its JSON (httpx errors and bad JSON raise)."""
        response = await self._http.get(base_url.rstrip("/") + path)
        response.raise_for_status()
        return response.json()

    async def stream(self, base_url: str, path: str, body: dict[str, Any]) -> Reply:
        """POST `body` with stream=true to `base_url + path`; every exception becomes a failed Reply."""
        messages = path == MESSAGES
        payload = {**body, "stream": True} if messages else {**body, "stream": True,
                                                             "stream_options": {"include_usage": True}}
        state = _MessagesState() if messages else _StreamState()
        start = time.perf_counter()
        try:
            # httpx's timeout is per read; this bounds the whole request (a server that trickles
            # keep-alives forever still fails).
            async with asyncio.timeout(self.timeout):
                async with self._http.stream("POST", base_url.rstrip("/") + path, json=payload) as response:
                    if response.status_code != 200:
                        detail = (await response.aread()).decode("utf-8", "replace")[:300]
                        return state.failed(start, f"HTTP {response.status_code}: {detail}")
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue  # blank separators, ": ping" comments, event: lines
                        data = line[5:].strip()
                        if data == "[DONE]":
                            state.done = True
                            break
                        state.feed(json.loads(data), start)
                        if state.done:
                            break
        except TimeoutError:
            return state.failed(start, f"timeout after {self.timeout:g} s")
        except (httpx.HTTPError, OSError, ValueError) as exc:
            return state.failed(start, f"{type(exc).__name__}: {exc}".strip())
        return state.finish(start)


#: The timings skippy-cache's `skippy_cache` object gives, kept as the `Reply` fields of the same names.
_ENGINE_TIMES = ("restore_ms", "queue_ms", "prefill_ms")


class _StreamState:
    """What the chunks of one stream said so far (owned by `BenchClient.stream`)."""

    def __init__(self) -> None:
        self.ttft_ms: float | None = None
        self.finish_ms: float | None = None
        self.text: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.cache_n: int | None = None
        self.cache_source: str | None = None
        self.engine_ms: dict[str, float] = {}
        self.error: str | None = None
        self.done = False
        #: Tool calls by their index in the reply: id, name and the arguments so far.
        self.calls: dict[int, dict[str, str]] = {}

    def output(self, now_ms: float) -> None:
        """Generated output arrived (text, or a piece of a call): the first one is the TTFT."""
        if self.ttft_ms is None:
            self.ttft_ms = now_ms

    def feed(self, chunk: dict[str, Any], start: float) -> None:
        now_ms = (time.perf_counter() - start) * 1000
        if "error" in chunk and not chunk.get("choices"):
            self.error = str(chunk["error"])[:300]
            return
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            piece = choice.get("text") or delta.get("content") or delta.get("reasoning_content") or ""
            if piece:
                self.text.append(piece)
                self.output(now_ms)
            for part in delta.get("tool_calls") or []:
                call = self.calls.setdefault(part.get("index", 0), {"id": "", "name": "", "arguments": ""})
                function = part.get("function") or {}
                call["id"] = part.get("id") or call["id"]
                call["name"] += function.get("name") or ""
                call["arguments"] += function.get("arguments") or ""
                self.output(now_ms)
            if choice.get("finish_reason") and self.finish_ms is None:
                self.finish_ms = now_ms
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        self.read_answer(chunk)

    def read_answer(self, chunk: dict[str, Any]) -> None:
        """skippy-cache's `skippy_cache` object and llama-server's `timings`, wherever they ride."""
        answer = chunk.get("skippy_cache")
        if isinstance(answer, dict) and isinstance(answer.get("source"), str):
            self.cache_source = answer["source"]
        if isinstance(answer, dict):
            for name in _ENGINE_TIMES:
                if isinstance(answer.get(name), (int, float)):
                    self.engine_ms[name] = float(answer[name])
        timings = chunk.get("timings")
        if isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
            self.cache_n = timings["cache_n"]

    def failed(self, start: float, error: str) -> Reply:
        return Reply(
            False,
            self.ttft_ms,
            (time.perf_counter() - start) * 1000,
            "".join(self.text),
            None,
            None,
            None,
            error,
        )

    def finish(self, start: float) -> Reply:
        if self.error is not None:
            return self.failed(start, f"error in stream: {self.error}")
        ttft = self.ttft_ms if self.ttft_ms is not None else self.finish_ms
        if ttft is None:
            return self.failed(start, "stream ended without a token")
        if not self.done:
            return self.failed(start, "stream ended without [DONE]")
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        prompt = usage.get("prompt_tokens")
        if cached is None and self.cache_n is not None:
            cached = self.cache_n
        return Reply(
            True,
            ttft,
            (time.perf_counter() - start) * 1000,
            "".join(self.text),
            prompt,
            cached,
            usage.get("completion_tokens"),
            cache_source=self.cache_source,
            **self.engine_ms,
            calls=tuple(ToolCall(c["id"], c["name"], c["arguments"]) for _, c in sorted(self.calls.items())),
        )


class _MessagesState(_StreamState):
    """What the events of one Messages stream said so far: text and tool_use blocks as output,
    usage from `message_start` and `message_delta` (cached: `cache_read_input_tokens`), the end
    at `message_stop`."""

    def __init__(self) -> None:
        super().__init__()
        self.anthropic_usage: dict[str, Any] = {}

    def feed(self, event: dict[str, Any], start: float) -> None:
        now_ms = (time.perf_counter() - start) * 1000
        kind = event.get("type")
        if kind == "error":
            self.error = str(event.get("error"))[:300]
        elif kind == "content_block_start":
            block = event.get("content_block") or {}
            if block.get("type") == "tool_use":
                self.calls[event.get("index", 0)] = {"id": block.get("id", ""), "name": block.get("name", ""),
                                                     "arguments": ""}
                self.output(now_ms)
        elif kind == "content_block_delta":
            delta = event.get("delta") or {}
            if delta.get("type") == "text_delta" and delta.get("text"):
                self.text.append(delta["text"])
                self.output(now_ms)
            elif delta.get("type") == "input_json_delta":
                call = self.calls.get(event.get("index", 0))
                if call is not None:
                    call["arguments"] += delta.get("partial_json") or ""
                self.output(now_ms)
        elif kind in ("message_start", "message_delta"):
            # As the anthropic client reads them: message_start's usage, overwritten by what
            # message_delta's (the final counts) says.
            usage = (event.get("message") or {}).get("usage") if kind == "message_start" else event.get("usage")
            self.anthropic_usage.update({k: v for k, v in (usage or {}).items() if v is not None})
            if kind == "message_delta":
                self.finish_ms = self.finish_ms or now_ms
            usage = self.anthropic_usage
            read = usage.get("cache_read_input_tokens") or 0
            prompt = (usage.get("input_tokens") or 0) + read + (usage.get("cache_creation_input_tokens") or 0)
            self.usage = {"prompt_tokens": prompt or None, "completion_tokens": usage.get("output_tokens"),
                          "prompt_tokens_details": {"cached_tokens": read}}
        elif kind == "message_stop":
            self.done = True
        self.read_answer(event)
