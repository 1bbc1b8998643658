"""The /v1/cache report.

`Engine.stats()` returns the snapshot the engine thread published after its
last step, so it is safe and cheap from any thread; `Engine.info` is fixed at start.
The pool's audit (who holds which cells) is read on the engine thread between
steps: call `cache_report` off the event loop.
"""

from __future__ import annotations

import dataclasses

from skippy_cache.runtime import Engine, TenantFigures
from skippy_cache.server.metrics import ServerMetrics


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
            "eviction": info.eviction.value,
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


def tenant_report(engine: Engine, metrics: ServerMetrics, tenant: str) -> dict:
    """What one tenant holds and has asked for (GET /v1/cache with a user key): nothing of any other's."""
    return {"tenant": tenant, **_tenant_figures(engine.tenant_figures().get(tenant), metrics, tenant)}


def tenants_report(engine: Engine, metrics: ServerMetrics) -> dict:
    """Every tenant's figures (GET /v1/cache with an admin key, on a server with tenants)."""
    held = engine.tenant_figures()
    names = sorted({name for name in held if name is not None} | set(metrics.tenants))
    return {name: _tenant_figures(held.get(name), metrics, name) for name in names}


def _tenant_figures(held: TenantFigures | None, metrics: ServerMetrics, tenant: str) -> dict:
    held = held or TenantFigures()
    own = metrics.tenant_totals(tenant)
    return {
        "resident_entries": held.entries,
        "resident_tokens": held.tokens,
        "stored_pages": held.stored_pages,
        "requests": {
            "done": own.requests,
            "prompt_tokens": own.prompt_tokens,
            "cached_tokens": own.cached_tokens,
            "hit_ratio": own.cached_tokens / own.prompt_tokens if own.prompt_tokens else 0.0,
            "misses": own.misses,
        },
    }
