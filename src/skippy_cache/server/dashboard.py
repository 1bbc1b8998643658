"""GET /dashboard, a live page of the cache, and GET /v1/dashboard, the JSON it polls.

The page (static/dashboard.html) is one file with its CSS and JavaScript
inline: nothing is built, nothing comes from a CDN. It holds no data; the
JSON does, under /v1 and so behind `--api-key` like the rest of the API (the
page asks for the key when the JSON answers 401).

The JSON: the pool as a strip of columns by owner (free, lanes, cache
entries, shared), the tiers' occupancy, hit ratio and TTFT per 10 seconds
over the last 10 minutes, the prefixes that saved the most tokens (their
first words, unless `--dashboard-prefix-text` is off), and misses by reason.
"""

from __future__ import annotations

from importlib.resources import files

from skippy_cache.runtime import Engine
from skippy_cache.server.metrics import ServerMetrics


def page() -> str:
    return files("skippy_cache.server").joinpath("static/dashboard.html").read_text(encoding="utf-8")


def dashboard_data(engine: Engine, metrics: ServerMetrics, *, prefix_text: bool, tenant: str | None = None) -> dict:
    """Everything the page draws, as of now (the pool view is read between engine steps).

    With `tenant` (a user key), what that tenant may see: its own requests,
    misses and top prefixes (figures only, never their text), the tokens its
    entries hold; the pool strip stays whole, as the load it shows is
    observable anyway from any request's queueing time.
    """
    s = engine.stats()
    info = engine.info
    view = engine.pool_view(tenant=tenant)
    resident, store, counters = s.cache.resident, s.cache.store, s.cache.counters
    pool = {"n_cells": view.n_cells, "used": s.used_cells, "lanes_busy": s.lanes_busy,
            "lanes_total": s.lanes_total, "queue_depth": s.queue_depth, "columns": view.columns}
    top = []
    for tokens, hits, head, namespace, owner in view.top:
        text = engine.detokenize(list(head)).strip() if prefix_text and tenant is None else None
        top.append({"tokens_saved": tokens, "hits": hits, "namespace": namespace if owner is None else owner,
                    "first_words": text})
    if tenant is not None:
        own = metrics.tenant_totals(tenant)
        held = engine.tenant_figures().get(tenant)
        return {
            "tenant": tenant,
            "pool": pool,
            "tiers": [{"name": "your entries", "unit": "tokens", "used": held.tokens if held else 0,
                       "max": info.n_ctx}],
            "totals": {"requests": own.requests, "prompt_tokens": own.prompt_tokens,
                       "cached_tokens": own.cached_tokens, "lookups": own.requests, "hits": own.hits},
            "misses": dict(sorted(own.misses.items(), key=lambda kv: -kv[1])),
            "missed_tokens": own.missed_tokens,
            "timeline": metrics.timeline.points(tenant=tenant),
            "top_prefixes": top,
        }
    tiers = [{"name": "resident", "unit": "tokens", "used": resident.resident_cells,
              "max": resident.max_resident_tokens or info.n_ctx}]
    if store is not None:
        tiers.append({"name": "ram", "unit": "bytes", "used": store.chunks.ram_bytes,
                      "max": store.chunks.ram_max_bytes})
        if store.chunks.disk is not None:
            disk = store.chunks.disk
            tiers.append({"name": "disk", "unit": "bytes", "used": disk.bytes, "max": disk.max_bytes})
    if s.remote is not None:
        tiers.append({"name": "remote", "unit": "chunks", "up": s.remote.up, "hits": s.remote.hits,
                      "writes": s.remote.writes})
    return {
        "pool": pool,
        "tiers": tiers,
        "totals": {"requests": s.requests_done, "prompt_tokens": s.prompt_tokens,
                   "cached_tokens": s.cached_tokens, "lookups": counters.lookups, "hits": counters.hits},
        "misses": dict(sorted(counters.misses.items(), key=lambda kv: -kv[1])),
        "missed_tokens": counters.missed_tokens,
        "timeline": metrics.timeline.points(),
        "top_prefixes": top,
    }
