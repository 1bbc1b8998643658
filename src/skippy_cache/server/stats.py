"""The /v1/cache report.

`Engine.stats()` returns the snapshot the engine thread published after its
last step, so it is safe and cheap from any thread; `Engine.info` is fixed at start.
The pool's audit (who holds which cells) is read on the engine thread between
steps: call `cache_report` off the event loop.
"""

from __future__ import annotations

import dataclasses

from skippy_cache.runtime import Engine


def cache_report(engine: Engine) -> dict:
    """The cache's budgets, tiers, counters and pool state as JSON (GET /v1/cache)."""
    audit = engine.pool_audit()
    s = engine.stats()
    info = engine.info
    budgets, policy = info.budgets, info.policy
    return {
        "mode": info.mode.value,
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
            "host_cache_bytes": info.host_cache_bytes,
            "cache_dir": str(info.cache_dir) if info.cache_dir is not None else None,
            "disk_cache_bytes": info.disk_cache_bytes if info.cache_dir is not None else 0,
            "chunk_tokens": info.chunk_tokens,
            "idle_tokens": info.idle_tokens,
            "remote_url": info.remote_url,
        },
        # Each request's lookup counted once: hits by tier, records, evictions, demotions.
        "counters": dataclasses.asdict(s.cache.counters),
        "resident": dataclasses.asdict(s.cache.resident),
        # The state store's pages and tiers; None without one (turned off).
        "store": dataclasses.asdict(s.cache.store) if s.cache.store is not None else None,
        # The shared tier (Redis/Valkey): reachable or not, chunks in and out, round trips; None without one.
        "remote": dataclasses.asdict(s.remote) if s.remote is not None else None,
        "pool": {
            "n_ctx": s.n_ctx,
            "used_cells": s.used_cells,
            "reserved_cells": s.reserved_cells,
            "lanes_total": s.lanes_total,
            "lanes_busy": s.lanes_busy,
            "queue_depth": s.queue_depth,
            # At rest used_cells == entry_cells, and lane_cells, unowned_cells, native_mismatches are 0.
            "audit": dataclasses.asdict(audit),
            **dataclasses.asdict(s.placement),
        },
        "requests": {
            "done": s.requests_done,
            "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens,
            "hit_ratio": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
        },
    }
