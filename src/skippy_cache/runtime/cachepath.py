"""The cache path of one request: which cached state a new lane starts from, and what it records.

Two modes, one place:
- fast mode: an exact repeat of a whole prompt (its cells and first-token
  logits), else the longest shared prefix from the radix index; each prompt
  records one entry, the whole prompt, after its last token's decode;
- deterministic mode: the seed's grid lengths only, looked up longest first and
  recorded when prefill reaches them, because a lane's own cells must start a
  fresh run aligned with the 64-token grid (placement.py).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from skippy_cache.config import PrefixCandidatePolicy, StageKvCacheMode
from skippy_cache.identity import IdentityKey, PrefixIdentity, prefix_identities, prefix_identity
from skippy_cache.runtime.kvpool import KvPool
from skippy_cache.runtime.lane import Lane
from skippy_cache.runtime.requests import GenerationRequest


class CachePath:
    def __init__(
        self,
        pool: KvPool,
        identity_key: IdentityKey,
        policy: PrefixCandidatePolicy,
        mode: StageKvCacheMode,
        *,
        deterministic: bool,
    ) -> None:
        self.pool = pool
        self.identity_key = identity_key
        self.policy = policy
        self.mode = mode
        self.deterministic = deterministic
        # Whole-prompt entries hold the last prompt token's cell too, decoded on
        # its own step: a separate key keeps a longer prompt from reusing that
        # cell as if it had been computed inside a prefill chunk.
        self._whole_prompt_key = replace(identity_key, extra=(("entry", "whole-prompt"),))

    def space(self, request: GenerationRequest) -> IdentityKey:
        """Everything but the tokens that decides which KV a prompt produces."""
        return self.identity_key.with_namespace(request.namespace)

    def attach(self, lane: Lane) -> np.ndarray | None:
        """Put the lane's cached prefix on it and plan its records; sets `n_past` and `cached_tokens`.

        Returns the first-token logits when the whole prompt was cached (an
        exact repeat: nothing is left to decode before sampling).
        """
        request = lane.request
        looks_up = self.mode.looks_up and request.lookup
        if self.deterministic:
            hit = self._attach_on_grid(lane, looks_up)
        else:
            whole = self._whole_prompt_identity(request)
            lane.whole_prompt = whole if self.mode.records and request.record else None
            hit, exact_repeat = (
                self.pool.attach_prompt(lane.seq_id, whole, lane.space, request.tokens[: lane.prefill_end])
                if looks_up
                else (0, False)
            )
            if exact_repeat:
                assert whole is not None
                logits = self.pool.prompt_logits(whole)
                assert logits is not None, "a cached whole-prompt entry lost its logits"
                lane.whole_prompt = None
                lane.n_past = lane.cached_tokens = len(lane.prompt)
                return logits
        lane.n_past = lane.cached_tokens = hit
        return None

    def prefill_done(self, lane: Lane) -> None:
        """Record the grid lengths the lane planned (deterministic mode; fast mode plans none)."""
        for n in lane.record_lengths:
            self.pool.record(lane.seq_id, lane.identities[n])
        lane.identities = {}

    def first_logits(self, lane: Lane, logits: np.ndarray) -> None:
        """The last prompt token was decoded: record the whole prompt with these logits, if planned."""
        if lane.whole_prompt is not None:
            self.pool.record(lane.seq_id, lane.whole_prompt, logits, indexed=(lane.space, lane.prompt))
            lane.whole_prompt = None

    def _attach_on_grid(self, lane: Lane, looks_up: bool) -> int:
        request = lane.request
        grid = self.policy.grid_tokens
        lookups = self.policy.candidate_token_counts(lane.prefill_end) if looks_up else []
        records = (
            self.policy.record_candidate_token_counts(lane.prefill_end) if self.mode.records and request.record else []
        )
        lookups = [n for n in lookups if n % grid == 0]
        lane.record_lengths = [n for n in records if n % grid == 0]
        identities = prefix_identities(
            lane.space, request.tokens[: lane.prefill_end], set(lookups) | set(lane.record_lengths)
        )
        lane.identities = {n: identities[n] for n in lane.record_lengths}
        hit = self.pool.attach(lane.seq_id, [identities[n] for n in lookups]) if lookups else None
        return hit.token_count if hit is not None else 0

    def _whole_prompt_identity(self, request: GenerationRequest) -> PrefixIdentity | None:
        wanted = (self.mode.looks_up and request.lookup) or (self.mode.records and request.record)
        if not wanted or len(request.tokens) < max(self.policy.min_tokens, 1):
            return None
        return prefix_identity(self._whole_prompt_key.with_namespace(request.namespace), request.tokens)
