"""OpenAI response objects and stream chunks for the two generation endpoints."""

from __future__ import annotations

import codecs
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace

from skippy_cache.runtime import DoneEvent, Explanation, FinishReason, Logprob, RequestStats, TokenLogprobs
from skippy_cache.server.tools import Call, CallSplitter, Delta, split_reply


def usage(stats: Sequence[RequestStats]) -> dict:
    """One response's usage: the prompt once (every choice ran the same one; the first paid for it,
    the others reused it), the completion tokens of all choices."""
    first = stats[0]
    completion = sum(s.completion_tokens for s in stats)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }


def cache_answer(stats: RequestStats) -> dict:
    """The top-level `skippy_cache` object: what this request reused, from where, and why not more."""
    answer = {
        "source": stats.cache_source,
        "matched_tokens": stats.cached_tokens,
        "prompt_tokens": stats.prompt_tokens,
        "restore_ms": round(stats.restore_ms, 3),
        # Where the TTFT went inside the engine: waiting for a lane (a prefetch from the shared
        # tier included), then from admission to the first token (restore and prefill).
        "queue_ms": round(stats.queue_ms, 3),
        "prefill_ms": round(stats.prefill_ms, 3),
    }
    return _with_reason(answer, stats.miss_reason, stats.evicted_ago)


def explanation_answer(explanation: Explanation) -> dict:
    """`skippy_cache` as a request would get it now (POST /v1/cache/explain); nothing is restored yet."""
    answer = {
        "source": explanation.source,
        "matched_tokens": explanation.matched_tokens,
        "prompt_tokens": explanation.prompt_tokens,
    }
    return _with_reason(answer, explanation.miss_reason, explanation.evicted_ago)


def _with_reason(answer: dict, miss_reason: str | None, evicted_ago: str | None) -> dict:
    if miss_reason is not None:
        answer["miss_reason"] = miss_reason
    if evicted_ago is not None:
        answer["evicted_ago"] = evicted_ago
    return answer


def finish_reason(reason: FinishReason) -> str:
    # Only finished requests are reported; cancelled ones have no client left.
    assert reason in (FinishReason.STOP, FinishReason.LENGTH), f"no OpenAI finish_reason for {reason}"
    return reason.value


@dataclass(frozen=True)
class Choice:
    """One finished choice of a response: its DoneEvent and, when asked for, each token's logprobs."""

    index: int
    done: DoneEvent
    logprobs: list[TokenLogprobs]


def token_text(piece: bytes) -> str:
    """A token as text; a token holding part of a UTF-8 character is spelt `bytes:\\xe2\\x80` as OpenAI does."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


class _LegacyLogprobs:
    """The completions API's `logprobs` object for one choice, built token by token.

    `text_offset` counts characters of the returned text (after the echoed
    prompt): the offset where each token's text starts.
    """

    def __init__(self, offset: int) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._offset = offset

    def shape(self, tokens: Sequence[TokenLogprobs]) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for item in tokens:
            out["tokens"].append(token_text(item.chosen.piece))
            out["token_logprobs"].append(item.chosen.logprob)
            top = {token_text(alt.piece): alt.logprob for alt in item.top}
            # OpenAI: the sampled token is always there, so up to logprobs + 1 entries.
            top.setdefault(token_text(item.chosen.piece), item.chosen.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self._offset)
            self._offset += len(self._decoder.decode(item.chosen.piece))
        return out


def _chat_logprob(item: Logprob) -> dict:
    return {"token": token_text(item.piece), "logprob": item.logprob, "bytes": list(item.piece)}


def chat_logprobs(tokens: Sequence[TokenLogprobs]) -> dict:
    """The chat API's `logprobs` object: `content`, one entry per token with its `top_logprobs`."""
    content = [{**_chat_logprob(item.chosen), "top_logprobs": [_chat_logprob(alt) for alt in item.top]}
               for item in tokens]
    return {"content": content, "refusal": None}


class _Envelope:
    """What every object of one response shares: id, creation time, model."""

    def __init__(self, model: str, system_fingerprint: str, id_prefix: str) -> None:
        self.model = model
        self.system_fingerprint = system_fingerprint
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
        }


class CompletionFormat(_Envelope):
    """`text_completion` objects (/v1/completions)."""

    def __init__(self, model: str, system_fingerprint: str, *, echo: str = "", logprobs: bool = False) -> None:
        super().__init__(model, system_fingerprint, "cmpl")
        #: The prompt's text, returned before each choice's completion (`echo`).
        self.echo = echo
        self.logprobs = logprobs
        self._legacy: dict[int, _LegacyLogprobs] = {}

    def response(self, choices: Sequence[Choice]) -> dict:
        out = [
            {
                "index": c.index,
                "text": self.echo + c.done.text,
                "logprobs": self._logprobs(c.index, c.logprobs),
                "finish_reason": finish_reason(c.done.finish_reason),
            }
            for c in choices
        ]
        stats = [c.done.stats for c in choices]
        return {**self._head("text_completion"), "choices": out, "usage": usage(stats),
                "skippy_cache": cache_answer(stats[0])}

    def opening_chunks(self, n_choices: int) -> list[dict]:
        if not self.echo:
            return []
        return [self._chunk({"index": i, "text": self.echo, "logprobs": None, "finish_reason": None})
                for i in range(n_choices)]

    def delta_chunks(self, index: int, text: str, logprobs: TokenLogprobs | None = None) -> list[dict]:
        shaped = self._logprobs(index, [logprobs]) if logprobs is not None else None
        return [self._chunk({"index": index, "text": text, "logprobs": shaped, "finish_reason": None})]

    def final_chunks(self, index: int, reason: FinishReason) -> list[dict]:
        return [self._chunk({"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason(reason)})]

    def usage_chunk(self, stats: Sequence[RequestStats]) -> dict:
        return {**self._head("text_completion"), "choices": [], "usage": usage(stats),
                "skippy_cache": cache_answer(stats[0])}

    def _logprobs(self, index: int, tokens: Sequence[TokenLogprobs]) -> dict | None:
        if not self.logprobs:
            return None
        legacy = self._legacy.setdefault(index, _LegacyLogprobs(len(self.echo)))
        return legacy.shape(tokens)

    def _chunk(self, choice: dict) -> dict:
        return {**self._head("text_completion"), "choices": [choice], "usage": None}


def _tool_call(call: Call) -> dict:
    if call.custom:
        return {"id": call.id, "type": "custom", "custom": {"name": call.name, "input": call.arguments}}
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class ChatFormat(_Envelope):
    """`chat.completion` objects and `chat.completion.chunk` chunks (/v1/chat/completions).

    With `tool_names`, each choice's reply is split into text and tool calls (server/tools.py);
    a reply that called a tool and stopped ends with finish_reason `tool_calls`.
    """

    def __init__(self, model: str, system_fingerprint: str, *, logprobs: bool = False,
                 tool_names: set[str] | None = None, custom_names: frozenset[str] = frozenset(),
                 incremental: bool = False, legacy_functions: bool = False) -> None:
        super().__init__(model, system_fingerprint, "chatcmpl")
        self.logprobs = logprobs
        self.tool_names = tool_names
        self.custom_names = custom_names
        #: Stream calls as generated (`CallSplitter.incremental`: a grammar holds the reply to calls).
        self.incremental = incremental
        #: The request used `functions`: a call is `function_call` (one per reply), not `tool_calls`.
        self.legacy_functions = legacy_functions
        self._splitters: dict[int, CallSplitter] = {}
        self._calls: dict[int, list[Call]] = {}
        self._calls_done: dict[int, int] = {}
        self._custom_open: dict[int, bool] = {}

    def call_ids(self, index: int) -> tuple[str, ...]:
        """The ids of the calls choice `index` returned (streamed or not)."""
        splitter = self._splitters.get(index)
        calls = splitter.calls if splitter is not None else self._calls.get(index, [])
        return tuple(call.id for call in calls)

    def response(self, choices: Sequence[Choice]) -> dict:
        out = []
        for c in choices:
            message: dict = {"role": "assistant", "content": c.done.text, "refusal": None}
            reason = finish_reason(c.done.finish_reason)
            if self.tool_names is not None:
                text, calls = split_reply(c.done.text, self.tool_names, incremental=self.incremental,
                                          custom=self.custom_names)
                self._calls[c.index] = calls
                if calls:
                    message = {"role": "assistant", "content": text or None, "refusal": None}
                    if self.legacy_functions:
                        message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
                    else:
                        message["tool_calls"] = [_tool_call(call) for call in calls]
                    reason = self._calls_reason(c.done.finish_reason)
            out.append({
                "index": c.index,
                "message": message,
                "logprobs": chat_logprobs(c.logprobs) if self.logprobs else None,
                "finish_reason": reason,
            })
        stats = [c.done.stats for c in choices]
        return {**self._head("chat.completion"), "choices": out, "usage": usage(stats),
                "skippy_cache": cache_answer(stats[0])}

    def opening_chunks(self, n_choices: int) -> list[dict]:
        return [self._chunk(i, {"role": "assistant", "content": ""}, None) for i in range(n_choices)]

    def delta_chunks(self, index: int, text: str, logprobs: TokenLogprobs | None = None) -> list[dict]:
        shaped = chat_logprobs([logprobs]) if logprobs is not None else None
        if self.tool_names is None:
            return [self._chunk(index, {"content": text}, None, shaped)]
        chunks = self._tool_chunks(index, self._splitter(index).feed(text))
        if shaped is not None:
            # A token's logprobs ride on its first chunk, or on an empty one while its text is held.
            if chunks:
                chunks[0]["choices"][0]["logprobs"] = shaped
            else:
                chunks = [self._chunk(index, {"content": ""}, None, shaped)]
        return chunks

    def final_chunks(self, index: int, reason: FinishReason) -> list[dict]:
        if self.tool_names is None:
            return [self._chunk(index, {}, finish_reason(reason))]
        splitter = self._splitter(index)
        chunks = self._tool_chunks(index, splitter.finish())
        shown = self._calls_reason(reason) if splitter.calls else finish_reason(reason)
        return [*chunks, self._chunk(index, {}, shown)]

    def usage_chunk(self, stats: Sequence[RequestStats]) -> dict:
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": usage(stats),
                "skippy_cache": cache_answer(stats[0])}

    def _calls_reason(self, reason: FinishReason) -> str:
        # A reply cut at max_tokens says so, calls or not; one that ended on its own called tools.
        if reason is not FinishReason.STOP:
            return finish_reason(reason)
        return "function_call" if self.legacy_functions else "tool_calls"

    def _splitter(self, index: int) -> CallSplitter:
        assert self.tool_names is not None
        return self._splitters.setdefault(index, CallSplitter(self.tool_names, incremental=self.incremental,
                                                              custom=self.custom_names))

    def _tool_chunks(self, index: int, deltas: Sequence[Delta]) -> list[dict]:
        """Text as content deltas; a call as OpenAI streams one: id, type and name with empty
        arguments, then the arguments in pieces (which concatenate to the non-streamed string)."""
        chunks = []
        for delta in deltas:
            if delta.text:
                chunks.append(self._chunk(index, {"content": delta.text}, None))
            # The call a start or a fragment belongs to: the one after those already done.
            number = self._calls_done.get(index, 0)
            if delta.done is not None:
                self._calls_done[index] = number + 1
            if self.legacy_functions:
                if number > 0:
                    continue  # the legacy form holds one call
                if delta.call is not None:
                    chunks.append(self._chunk(index, {"function_call": {"name": delta.call.name,
                                                                        "arguments": ""}}, None))
                elif delta.arguments:
                    chunks.append(self._chunk(index, {"function_call": {"arguments": delta.arguments}}, None))
                continue
            if delta.call is not None:
                head = {"index": number, **_tool_call(replace(delta.call, arguments=""))}
                chunks.append(self._chunk(index, {"tool_calls": [head]}, None))
            elif delta.arguments:
                # The fragment's call is the one started last (a custom call's input is its text).
                key, field = ("custom", "input") if self._custom_open.get(index) else ("function", "arguments")
                chunks.append(self._chunk(index, {"tool_calls": [{"index": number, key: {
                    field: delta.arguments}}]}, None))
            if delta.call is not None:
                self._custom_open[index] = delta.call.custom
        return chunks

    def _chunk(self, index: int, delta: dict, reason: str | None, logprobs: dict | None = None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return {**self._head("chat.completion.chunk"), "choices": [choice], "usage": None}


#: The shape of a /v1/completions or /v1/chat/completions answer.
OpenAIFormat = CompletionFormat | ChatFormat
