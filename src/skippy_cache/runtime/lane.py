"""One execution lane: a sequence id below `reserved_seq_count` and the request running on it."""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from skippy_cache.drafts import Drafter
from skippy_cache.exact import Kernels, kernels
from skippy_cache.identity import PrefixIdentity
from skippy_cache.runtime.native import Sampler
from skippy_cache.runtime.remote import Prefetched
from skippy_cache.runtime.requests import EventSink, GenerationRequest, RequestHandle, RequestStats
from skippy_cache.runtime.textstream import TextStream
from skippy_cache.tiers import told

#: Prompt tokens a lane's guesses look up (a long prompt's start is rarely what a reply repeats next,
#: and the lookup's table is built on the engine thread).
DRAFT_LOOKBACK = 2048


class Phase(Enum):
    #: Positions [n_past, prefill_end) still to prefill.
    PREFILL = "prefill"
    #: Prefill done; the last prompt token is decoded in the next decode step.
    LAST_TOKEN = "last-token"
    #: Feeding back the sampled token.
    DECODE = "decode"
    #: Waiting for `leader`, a running lane, to compute the prefix both share (inflight.py).
    JOIN = "join"


@dataclass(slots=True, eq=False)
class Lane:
    """Owned by the engine thread. Compared by identity: two lanes are never "equal"."""

    seq_id: int
    handle: RequestHandle
    sink: EventSink
    sampler: Sampler
    stream: TextStream
    #: Cells this request may come to hold: prompt plus max_tokens.
    reserve: int
    t_submit: float
    t_admit: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0
    phase: Phase = Phase.PREFILL
    n_past: int = 0
    cached_tokens: int = 0
    #: Token to feed at position n_past in the next step (LAST_TOKEN and DECODE).
    next_token: int = -1
    generated: list[int] = field(default_factory=list)
    first_logits: np.ndarray | None = None
    #: The prompt's names, hashed once at admission (`PrefixCache.name`): the identity of
    #: everything but the tokens (where the prefix index files this prompt), and the whole
    #: prompt's identity (None below min_tokens).
    space: Hashable | None = None
    prompt_identity: PrefixIdentity | None = None
    #: With a store: the identities at every multiple of its chunk size (the store's names).
    chunk_ids: tuple[PrefixIdentity, ...] = ()
    #: With a store: the names of the partial chunks that would end the earlier replies the
    #: prompt resends (`PrefixCache.name`), where another process's entry of that reply ended.
    tail_ids: tuple[PrefixIdentity, ...] = ()
    #: Recorded with its first-token logits right after the last prompt token's decode.
    whole_prompt: PrefixIdentity | None = None
    #: Prompt lengths, ascending, where the lane records an entry as its prefill passes them (models
    #: whose state exists only at a sequence's end, family.py): its chunks end there.
    checkpoints: tuple[int, ...] = ()
    #: What the lane reused, as its request reports it (RequestStats).
    cache_source: str = "none"
    miss_reason: str | None = None
    evicted_ago: str | None = None
    restore_ms: float = 0.0
    #: What a prefetch brought from the shared tier before the request was queued (None: none asked).
    prefetched: Prefetched | None = None
    #: Phase JOIN: the lane whose cells of positions [0, join_at) this one will share.
    leader: Lane | None = None
    join_at: int = 0
    #: The lookup behind the guesses of the lane's lone decode steps (drafts.py), built on the first.
    drafter: Drafter | None = None
    #: Which kernel computes each of the prompt's rows in deterministic mode (exact.py): fixed
    #: by the request, so worked out once, not on every step that plans the lane's chunks.
    kernels: Kernels = field(init=False)

    def __post_init__(self) -> None:
        self.kernels = kernels(self.prefill_end, self.handle.request.replies)

    @property
    def request(self) -> GenerationRequest:
        return self.handle.request

    @property
    def prompt(self) -> list[int]:
        return self.handle.request.tokens

    @property
    def prefill_end(self) -> int:
        """Everything but the last prompt token, which is decoded for the logits of the first token:
        in a decode step, or in deterministic mode with the prompt's last rows (batching.py)."""
        return len(self.handle.request.tokens) - 1

    def guess(self) -> int | None:
        """A guess at the token after `next_token` (drafts.py); the prompt's last `DRAFT_LOOKBACK`
        tokens and the reply so far are what it looks up."""
        if self.drafter is None:
            self.drafter = Drafter([*self.prompt[-DRAFT_LOOKBACK:], *self.generated])
        return self.drafter.guess()

    def take(self, token: int) -> None:
        """A sampled token joins the reply."""
        self.generated.append(token)
        if self.drafter is not None:
            self.drafter.push(token)

    @property
    def chunk_limit(self) -> int:
        """Where the lane's next prefill chunk must end at the latest: its next checkpoint, or
        `prefill_end`."""
        return next((n for n in self.checkpoints if n > self.n_past), self.prefill_end)

    def stats(self, now: float) -> RequestStats:
        """The request's figures as it ends at `now` (perf_counter seconds)."""
        t_first = self.t_first or now
        n_out = len(self.generated)
        decode_s = now - t_first
        return RequestStats(
            prompt_tokens=len(self.prompt),
            cached_tokens=self.cached_tokens,
            completion_tokens=n_out,
            queue_ms=(self.t_admit - self.t_submit) * 1000,
            prefill_ms=(t_first - self.t_admit) * 1000,
            ttft_ms=(t_first - self.t_submit) * 1000,
            decode_tokens_per_s=(n_out - 1) / decode_s if n_out > 1 and decode_s > 0 else 0.0,
            cache_source=self.cache_source,
            miss_reason=told(self.miss_reason),
            evicted_ago=self.evicted_ago,
            restore_ms=self.restore_ms,
        )

