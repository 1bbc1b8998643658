"""The /v1/cache report.

`Engine.stats()` returns the snapshot the engine thread published after its
last step, so it is safe and cheap from any thread.
"""

from __future__ import annotations

import dataclasses

from skippy_cache.runtime.engine import Engine


def cache_report(engine: Engine) -> dict:
    """The cache's budgets, counters and pool state as JSON (GET /v1/cache)."""
    s = engine.stats()
    budgets = engine.cache_config
    policy = engine.policy
    config = engine.config
    return {
        "mode": s.cache_mode,
        "budgets": {
            "max_entries": budgets.max_entries,
            "max_bytes": budgets.max_bytes,
            "max_resident_tokens": budgets.max_resident_tokens,
            "min_tokens": budgets.min_tokens,
            "reserved_seq_count": budgets.reserved_seq_count,
            "n_seq_max": budgets.n_seq_max,
            "stride_tokens": policy.stride_tokens,
            "record_limit": policy.record_limit,
            "grid_tokens": policy.grid_tokens,
            "host_cache_bytes": config.host_cache_bytes,
            "idle_tokens": config.idle_tokens,
        },
        "cache": dataclasses.asdict(s.cache),
        # None when there is no host tier (host_cache_bytes 0, or deterministic mode).
        "host": dataclasses.asdict(s.host) if s.host is not None else None,
        "pool": {
            "n_ctx": s.n_ctx,
            "used_cells": s.used_cells,
            "reserved_cells": s.reserved_cells,
            "lanes_total": s.lanes_total,
            "lanes_busy": s.lanes_busy,
            "queue_depth": s.queue_depth,
            **dataclasses.asdict(s.pool),
        },
        "requests": {
            "done": s.requests_done,
            "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens,
            "hit_ratio": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
        },
    }
