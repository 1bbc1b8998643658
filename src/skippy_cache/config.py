"""Cache configuration: the context a server runs, the cache settings, and the budgets derived from them.

A port of the seed's configuration module (`skippy_cache/config.rs`) with its
semantics kept exactly; its tests are ported one to one in
`tests/core/test_config_seed.py`.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass

#: Below this many cells the resident-token cap is disabled: half of a small
#: pool is smaller than one typical prompt, so the cap would reject the very
#: first record and degrade the cache without preventing any real wedge.
MIN_CTX_FOR_CELL_CAP = 8192

#: llama.cpp's sequence-id space (`LLAMA_MAX_SEQ`). Lanes and cache entries
#: share it, so the entry cap must leave room for the reserved lane ids.
LLAMA_MAX_SEQ = 256

#: Upper bound on `max_entries` whatever the configuration says (the seed's clamp).
MAX_ENTRIES_CLAMP = 512


class CacheMode(enum.Enum):
    DISABLED = "disabled"
    #: lookup-record for model families whose resident KV is certified exact,
    #: disabled otherwise (the runtime resolves it once it has read the model).
    AUTO = "auto"
    RECORD = "record"
    LOOKUP_RECORD = "lookup-record"

    @property
    def records(self) -> bool:
        return self in (CacheMode.RECORD, CacheMode.LOOKUP_RECORD)

    @property
    def looks_up(self) -> bool:
        return self is CacheMode.LOOKUP_RECORD


class CachePayload(enum.Enum):
    AUTO = "auto"
    RESIDENT_KV = "resident-kv"
    KV_RECURRENT = "kv-recurrent"
    FULL_STATE = "full-state"


_MODE_WORDS: dict[str, CacheMode] = {
    "off": CacheMode.DISABLED,
    "0": CacheMode.DISABLED,
    "false": CacheMode.DISABLED,
    "disabled": CacheMode.DISABLED,
    "on": CacheMode.LOOKUP_RECORD,
    "1": CacheMode.LOOKUP_RECORD,
    "true": CacheMode.LOOKUP_RECORD,
    "lookup-record": CacheMode.LOOKUP_RECORD,
    "record": CacheMode.RECORD,
    "auto": CacheMode.AUTO,
}


def parse_cache_mode(value: str, *, name: str = "cache mode") -> CacheMode:
    """Parse the words `SKIPPY_KV_CACHE` and `--cache-mode` accept."""
    mode = _MODE_WORDS.get(value.strip().lower())
    if mode is None:
        choices = ", ".join(sorted(_MODE_WORDS))
        raise ValueError(f"{name}={value!r} is not a cache mode (one of: {choices})")
    return mode


def parse_payload(value: str, *, name: str = "payload") -> CachePayload:
    try:
        return CachePayload(value.strip().lower())
    except ValueError:
        choices = ", ".join(p.value for p in CachePayload)
        raise ValueError(f"{name}={value!r} is not a payload (one of: {choices})") from None


def _parse_uint(name: str, value: str) -> int:
    text = value.strip().replace("_", "")
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"{name}={value!r} is not a non-negative integer")
    return int(text)


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """The cache settings, as an operator writes them (`SKIPPY_KV_CACHE*`)."""

    mode: CacheMode = CacheMode.AUTO
    payload: CachePayload = CachePayload.AUTO
    max_entries: int = 64
    #: 0 means no byte cap.
    max_bytes: int = 0
    min_tokens: int = 64
    shared_prefix_stride_tokens: int = 128
    #: 0 means record every candidate length.
    shared_prefix_record_limit: int = 2

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CacheConfig:
        """Read `SKIPPY_KV_CACHE*`; unset variables keep their defaults.

        A malformed value raises `ValueError` naming the variable and the value,
        so a typo in a deployment fails at start rather than silently running
        with the default.
        """
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        if (raw := env.get("SKIPPY_KV_CACHE")) is not None:
            values["mode"] = parse_cache_mode(raw, name="SKIPPY_KV_CACHE")
        if (raw := env.get("SKIPPY_KV_CACHE_PAYLOAD")) is not None:
            values["payload"] = parse_payload(raw, name="SKIPPY_KV_CACHE_PAYLOAD")
        for suffix, field in _UINT_ENV_FIELDS:
            name = f"SKIPPY_KV_CACHE_{suffix}"
            if (raw := env.get(name)) is not None:
                values[field] = _parse_uint(name, raw)
        return cls(**values)  # type: ignore[arg-type]


_UINT_ENV_FIELDS = (
    ("MAX_ENTRIES", "max_entries"),
    ("MAX_BYTES", "max_bytes"),
    ("MIN_TOKENS", "min_tokens"),
    ("SHARED_STRIDE_TOKENS", "shared_prefix_stride_tokens"),
    ("SHARED_RECORD_LIMIT", "shared_prefix_record_limit"),
)


@dataclass(frozen=True, kw_only=True)
class ContextConfig:
    """What one server's llama.cpp context runs: the model, its layer range and the context.

    `stage_id`, `stage_index` and the layer range are the seed's (a model served in stages across
    processes); one server is stage 0 of all layers, and the prefix identity still names them.

    The seed's `n_gpu_layers`, `model_path` and `n_batch` are left out: nothing
    here reads them (the engine's own config builds the llama.cpp context).
    """

    stage_id: str = "stage-0"
    stage_index: int = 0
    layer_start: int = 0
    #: Exclusive; 0 until the runtime has read the model's layer count.
    layer_end: int = 0
    ctx_size: int = 8192
    lane_count: int = 4
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: bool = True
    kv_unified: bool = True
    model_id: str = ""


def derive_max_resident_tokens(ctx_size: int) -> int:
    """Cap on cells the cache may pin: half the pool, or 0 (no cap) below the floor.

    The cache shares the `n_ctx` cell pool with the execution lanes
    (`kv_unified`). Bounded only by entries and bytes it can pin more cells than
    the pool has, and lanes then fail `llama_decode` with "failed to find a
    memory slot". Half the pool stays free for in-flight prefills. Below
    `MIN_CTX_FOR_CELL_CAP` half a pool is smaller than one prompt, so the cap
    would only reject records; a fixed cell floor is easier to reason about than
    one tied to `min_tokens`, which may be as low as 64 on a small context.
    """
    if ctx_size < MIN_CTX_FOR_CELL_CAP:
        return 0
    return ctx_size // 2


@dataclass(frozen=True, kw_only=True)
class ResidentCacheConfig:
    """The resident cache's budgets, derived from the context and the cache settings."""

    max_entries: int
    #: 0 means no byte cap.
    max_bytes: int
    min_tokens: int
    #: Sequence ids below this belong to execution lanes (two per lane: one to
    #: run, one spare); cache entries take ids from here up.
    reserved_seq_count: int
    #: 0 means no token cap; see `derive_max_resident_tokens`.
    max_resident_tokens: int

    @classmethod
    def from_context(cls, stage: ContextConfig, cache: CacheConfig) -> ResidentCacheConfig:
        reserved_seq_count = max(stage.lane_count * 2, 2)
        if reserved_seq_count >= LLAMA_MAX_SEQ:
            raise ValueError(
                f"lane_count={stage.lane_count} reserves {reserved_seq_count} sequence ids; "
                f"llama.cpp has {LLAMA_MAX_SEQ}, so at most {LLAMA_MAX_SEQ // 2 - 1} lanes leave room for the cache"
            )
        max_entries = min(max(cache.max_entries, 1), MAX_ENTRIES_CLAMP)
        # Entries need sequence ids of their own; beyond this llama.cpp has none
        # to give and the record would fail after the prefill was paid for.
        max_entries = max(min(max_entries, LLAMA_MAX_SEQ - reserved_seq_count), 1)
        return cls(
            max_entries=max_entries,
            max_bytes=cache.max_bytes,
            min_tokens=cache.min_tokens,
            reserved_seq_count=reserved_seq_count,
            max_resident_tokens=derive_max_resident_tokens(stage.ctx_size),
        )

    @property
    def n_seq_max(self) -> int:
        """Sequences the llama.cpp context must be created with."""
        return min(self.reserved_seq_count + self.max_entries, LLAMA_MAX_SEQ)


@dataclass(frozen=True, kw_only=True)
class PrefixCandidatePolicy:
    """Which prefix lengths a request looks up and which it records."""

    min_tokens: int
    stride_tokens: int
    record_limit: int
    page_size_tokens: int

    @classmethod
    def from_cache(cls, cache: CacheConfig) -> PrefixCandidatePolicy:
        return cls(
            min_tokens=cache.min_tokens,
            stride_tokens=cache.shared_prefix_stride_tokens,
            record_limit=cache.shared_prefix_record_limit,
            page_size_tokens=max(cache.min_tokens, 1),
        )

    @property
    def grid_tokens(self) -> int:
        """The grid step shared lengths fall on (the runtime aligns prefill chunks to it)."""
        return min(max(self.stride_tokens, 1), max(self.page_size_tokens, 1))

    def candidate_token_counts(self, token_count: int) -> list[int]:
        """Lengths to look up, longest first: `token_count`, then the grid down to `min_tokens`."""
        if token_count <= 0:
            return []
        counts = [token_count]
        if self.min_tokens == 0 or token_count <= self.min_tokens:
            return counts
        stride = self.grid_tokens
        candidate = _stable_grid_floor(token_count, stride)
        if candidate == token_count:
            candidate = max(candidate - stride, 0)
        candidate = max(candidate, self.min_tokens)
        while candidate >= self.min_tokens:
            counts.append(candidate)
            if candidate == self.min_tokens:
                break
            candidate = max(candidate - stride, self.min_tokens)
        return sorted(set(counts), reverse=True)

    def record_candidate_token_counts(self, token_count: int) -> list[int]:
        """Lengths to record: `token_count` plus the longest shared grid lengths.

        Two prompts with a common prefix and different tails then meet on a
        shared grid length (the seed's 2214/2231 -> 2176 case).
        """
        candidates = self.candidate_token_counts(token_count)
        limit = self.record_limit
        if limit == 0 or len(candidates) <= limit:
            return candidates
        selected = [token_count]
        if limit == 1:
            return selected
        for candidate in candidates:
            if len(selected) >= limit:
                break
            if candidate != token_count:
                selected.append(candidate)
        if len(selected) < limit:
            for candidate in reversed(candidates):
                if len(selected) >= limit:
                    break
                if candidate not in selected:
                    selected.append(candidate)
        return sorted(set(selected), reverse=True)


def _stable_grid_floor(token_count: int, stride: int) -> int:
    stride = max(stride, 1)
    return token_count - token_count % stride
