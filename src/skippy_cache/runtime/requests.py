"""What goes into the engine and what comes out of it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from skippy_cache.runtime.native import SamplingParams


class RequestError(ValueError):
    """A request the engine refuses; `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class QueueFullError(RuntimeError):
    pass


class EngineClosedError(RuntimeError):
    pass


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    #: Cache namespace (tenant / `cache_salt`): requests in different
    #: namespaces never share cached state.
    namespace: str | None = None
    #: Record prefixes for later requests (False for one-off prompts).
    record: bool = True
    #: Let this request reuse cached prefixes.
    lookup: bool = True
    #: Return the first token's logits in `DoneEvent` (exactness checks).
    keep_first_logits: bool = False


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


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token: int
    #: Text now safe to show (may be empty: a partial character or a possible stop string).
    text: str


@dataclass(frozen=True, slots=True)
class DoneEvent:
    finish_reason: FinishReason
    stats: RequestStats
    text: str
    tokens: tuple[int, ...]
    error: str | None = None
    first_logits: np.ndarray | None = None


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
