"""OpenAI response objects and stream chunks for the two generation endpoints."""

from __future__ import annotations

import time
import uuid

from skippy_cache.runtime import Explanation, FinishReason, RequestStats


def usage(stats: RequestStats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def cache_answer(stats: RequestStats) -> dict:
    """The top-level `skippy_cache` object: what this request reused, from where, and why not more."""
    answer = {
        "source": stats.cache_source,
        "matched_tokens": stats.cached_tokens,
        "prompt_tokens": stats.prompt_tokens,
        "restore_ms": round(stats.restore_ms, 3),
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

    def __init__(self, model: str, system_fingerprint: str) -> None:
        super().__init__(model, system_fingerprint, "cmpl")

    def response(self, text: str, reason: FinishReason, stats: RequestStats) -> dict:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(reason)}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage(stats),
                "skippy_cache": cache_answer(stats)}

    def opening_chunks(self) -> list[dict]:
        return []

    def delta_chunk(self, text: str) -> dict:
        return self._chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": None})

    def final_chunk(self, reason: FinishReason) -> dict:
        return self._chunk({"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason(reason)})

    def usage_chunk(self, stats: RequestStats) -> dict:
        return {**self._head("text_completion"), "choices": [], "usage": usage(stats),
                "skippy_cache": cache_answer(stats)}

    def _chunk(self, choice: dict) -> dict:
        return {**self._head("text_completion"), "choices": [choice], "usage": None}


class ChatFormat(_Envelope):
    """`chat.completion` objects and `chat.completion.chunk` chunks (/v1/chat/completions)."""

    def __init__(self, model: str, system_fingerprint: str) -> None:
        super().__init__(model, system_fingerprint, "chatcmpl")

    def response(self, text: str, reason: FinishReason, stats: RequestStats) -> dict:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None,
            "finish_reason": finish_reason(reason),
        }
        return {**self._head("chat.completion"), "choices": [choice], "usage": usage(stats),
                "skippy_cache": cache_answer(stats)}

    def opening_chunks(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def delta_chunk(self, text: str) -> dict:
        return self._chunk({"content": text}, None)

    def final_chunk(self, reason: FinishReason) -> dict:
        return self._chunk({}, finish_reason(reason))

    def usage_chunk(self, stats: RequestStats) -> dict:
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": usage(stats),
                "skippy_cache": cache_answer(stats)}

    def _chunk(self, delta: dict, reason: str | None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return {**self._head("chat.completion.chunk"), "choices": [choice], "usage": None}


ResponseFormat = CompletionFormat | ChatFormat
