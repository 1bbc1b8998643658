"""/metrics parses with prometheus_client's parser and moves as requests are served; /health, /v1/cache."""

from __future__ import annotations

import pytest
from live_server import LiveServer

pytestmark = [pytest.mark.model, pytest.mark.timeout(120)]

COMPLETIONS_OK = {"endpoint": "/v1/completions", "status": "200"}
COMPLETIONS_BAD = {"endpoint": "/v1/completions", "status": "400"}

ENGINE_GAUGES = [
    "skippy_lanes_busy",
    "skippy_lanes_total",
    "skippy_queue_depth",
    "skippy_cache_resident_entries",
    "skippy_cache_resident_tokens",
    "skippy_prompt_cache_hit_ratio",
    "skippy_kv_cells_total",
]


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_parse_and_move(server: LiveServer) -> None:
    before = server.metrics()
    for name in ENGINE_GAUGES:
        assert (name, ()) in before, f"{name} missing from /metrics"
    assert value(before, "skippy_cache_evictions_total") >= 0

    prompt = "Metrics test: " + " ".join(f"line {i} of the shared preamble." for i in range(16))
    client = server.openai()
    first = client.completions.create(model=server.model_id, prompt=prompt, max_tokens=3, temperature=0)
    second = client.completions.create(model=server.model_id, prompt=prompt, max_tokens=3, temperature=0)
    with server.http() as http:
        assert http.post("/v1/completions", json={"prompt": 1}).status_code == 400

    after = server.metrics()
    assert value(after, "skippy_requests_total", **COMPLETIONS_OK) \
        == value(before, "skippy_requests_total", **COMPLETIONS_OK) + 2
    assert value(after, "skippy_requests_total", **COMPLETIONS_BAD) \
        == value(before, "skippy_requests_total", **COMPLETIONS_BAD) + 1

    def moved(name: str) -> float:
        return value(after, name) - value(before, name)

    assert moved("skippy_prompt_tokens_total") == first.usage.prompt_tokens + second.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    assert moved("skippy_cached_prompt_tokens_total") == cached
    completion_tokens = first.usage.completion_tokens + second.usage.completion_tokens
    assert moved("skippy_completion_tokens_total") == completion_tokens
    assert moved("skippy_time_to_first_token_seconds_count") == 2
    assert value(after, "skippy_cache_hits_total") >= value(before, "skippy_cache_hits_total") + 1
    assert value(after, "skippy_cache_resident_entries") >= 1
    assert value(after, "skippy_cache_resident_tokens") > 0
    assert 0 < value(after, "skippy_prompt_cache_hit_ratio") <= 1
    assert value(after, "skippy_lanes_total") == server.settings.lanes


def test_health(server: LiveServer) -> None:
    with server.http() as http:
        body = http.get("/health").json()
    assert body["status"] == "ok"
    assert body["model"] == server.model_id
    assert body["lanes_total"] == server.settings.lanes


def test_cache_endpoint_reports_budgets_and_stats(server: LiveServer) -> None:
    with server.http() as http:
        report = http.get("/v1/cache").json()
    assert report["mode"] == "lookup-record"
    budgets = report["budgets"]
    assert budgets["max_entries"] == 64
    assert budgets["reserved_seq_count"] == 2 * server.settings.lanes
    assert budgets["max_resident_tokens"] == 0  # no token cap below an 8192-cell context
    assert budgets["min_tokens"] == 64 and budgets["stride_tokens"] == 128 and budgets["record_limit"] == 2
    assert report["pool"]["n_ctx"] == server.engine.n_ctx
    for key in ("entries", "resident_tokens", "hits", "misses", "records", "evictions"):
        assert key in report["cache"]
