"""What goes into the engine and what comes out of it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from skippy_cache.runtime.logprobs import MAX_TOP_LOGPROBS, TokenLogprobs
from skippy_cache.runtime.native import SamplingParams


class RequestError(ValueError):
    """A request the engine refuses; `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class QueueFullError(RuntimeError):
    """The server cannot take the request now: its queue is full, or saturated (see `Scheduler`)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        #: When a retry may find room (the HTTP `Retry-After`).
        self.retry_after_s = retry_after_s


class EngineClosedError(RuntimeError):
    pass


class Keep(str, Enum):
    """Where a request's entries may go when they leave the pool (a tenant's `store` option)."""

    #: Every tier the server has: RAM, disk, the shared tier.
    ALL = "all"
    #: The store's RAM tier only: never written to disk or to the shared tier.
    RAM = "ram"
    #: Nowhere: dropped when they leave the pool.
    NONE = "none"


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    #: Cache namespace (tenant / `cache_salt`): requests in different
    #: namespaces never share cached state.
    namespace: str | None = None
    #: Who sent it (the API key's tenant; None without tenants): admission takes turns between
    #: tenants, and each tenant's entries are counted apart. Never part of an identity: the
    #: namespace already separates what tenants may share.
    tenant: str | None = None
    #: Where its entries may go when they leave the pool.
    keep: Keep = Keep.ALL
    #: Record prefixes for later requests (False for one-off prompts).
    record: bool = True
    #: Let this request reuse cached prefixes.
    lookup: bool = True
    #: Return the first token's logits in `DoneEvent` (exactness checks).
    keep_first_logits: bool = False
    #: Keep the whole prompt's entry resident (bounded: `EngineConfig.pin_percent`).
    pin: bool = False
    #: Give each token event its logprob and this many most likely alternatives (None: no logprobs).
    top_logprobs: int | None = None
    #: Earlier replies the prompt resends (a chat's history), as (start, end) positions: `start`
    #: is the length of the prompt that generated the reply. Deterministic mode computes their
    #: rows one at a time, as they were generated, so the next turn reuses the reply (exact.py).
    #: With a store, a reply's end names the partial chunk a lookup by name may end on: where
    #: another process's entry of that reply ended (`PrefixCache.name`).
    replies: tuple[tuple[int, int], ...] = ()
    #: Where prompts that start like this one are likely to part from it (a chat's system message
    #: ends there). With a store, the prefix up to each is recorded as an entry of its own, whose
    #: rows past the last whole chunk are a partial chunk named by that prefix, so a lookup by name
    #: (another replica's, or after a restart) reaches there instead of the last chunk boundary.
    prefix_ends: tuple[int, ...] = ()


def check_prompt_tokens(tokens: list[int], n_vocab: int) -> None:
    """Raise `RequestError` for a prompt token id outside the vocabulary (llama.cpp aborts on one)."""
    for token in tokens:
        if not 0 <= token < n_vocab:
            raise RequestError(f"token id {token} is outside the vocabulary (0..{n_vocab - 1})", param="prompt")


def validate_request(request: GenerationRequest, *, n_vocab: int, n_ctx: int) -> None:
    """Raise `RequestError` for a request that could never run on a context of `n_ctx` cells."""
    if not request.tokens:
        raise RequestError("the prompt is empty", param="prompt")
    check_prompt_tokens(request.tokens, n_vocab)
    if request.max_tokens < 1:
        raise RequestError(f"max_tokens must be at least 1, got {request.max_tokens}", param="max_tokens")
    for token, _bias in request.sampling.logit_bias:
        if not 0 <= token < n_vocab:
            raise RequestError(f"logit_bias: token id {token} is outside the vocabulary (0..{n_vocab - 1})",
                               param="logit_bias")
    if request.sampling.repeat_penalty <= 0:
        raise RequestError(f"repeat_penalty must be above 0, got {request.sampling.repeat_penalty}",
                           param="repeat_penalty")
    if request.top_logprobs is not None and not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"top_logprobs must be 0..{MAX_TOP_LOGPROBS}, got {request.top_logprobs}",
                           param="top_logprobs")
    if len(request.tokens) >= n_ctx:
        raise RequestError(
            f"the prompt has {len(request.tokens)} tokens; the context holds {n_ctx}",
            param="prompt",
            code="context_length_exceeded",
        )
    if len(request.tokens) + request.max_tokens > n_ctx:
        raise RequestError(
            f"prompt ({len(request.tokens)} tokens) plus max_tokens ({request.max_tokens}) "
            f"exceeds the context of {n_ctx} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class RequestStats:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_ms: float
    prefill_ms: float
    ttft_ms: float
    decode_tokens_per_s: float
    #: Where the reused prefix came from: "resident", "ram", "disk", "inflight" (the cells of
    #: another running request's prefill), or "none".
    cache_source: str = "none"
    #: Why no more of the prompt was reused; None when every token but the last was (or the
    #: whole prompt, with its logits). Values: tiers.Why's, but exact_repeat and all_but_last.
    miss_reason: str | None = None
    #: With miss_reason "evicted": how long ago that prefix left the pool (misses.AGE_BUCKETS).
    evicted_ago: str | None = None
    #: Time spent restoring the reused prefix from the store.
    restore_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token: int
    #: Text now safe to show (may be empty: a partial character or a possible stop string).
    text: str
    #: The token's logprob and alternatives, when the request asked (`top_logprobs`).
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True, slots=True)
class DoneEvent:
    finish_reason: FinishReason
    stats: RequestStats
    text: str
    tokens: tuple[int, ...]
    error: str | None = None
    first_logits: np.ndarray | None = None
    #: The stop string that ended the text (finish_reason STOP), None if it ended otherwise.
    stop_sequence: str | None = None
    #: An ERROR the request caused itself (its grammar allowed no token): the client's 4xx, not the
    #: server's 500.
    request_fault: bool = False


Event = TokenEvent | DoneEvent
EventSink = Callable[[Event], None]


class RequestHandle:
    """The caller's side of a submitted request."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Free the lane at the next step; a `DoneEvent` (cancelled) still arrives."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    tokens: tuple[int, ...]
    finish_reason: FinishReason
    stats: RequestStats
    first_logits: np.ndarray | None = None
