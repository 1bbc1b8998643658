"""/metrics parses with prometheus_client's parser and moves as requests are served; /health, /v1/cache.

The host tier (exact KV states demoted from the pool to RAM) is followed on a
server of its own, small enough that one idle entry is demoted on cue.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from live_server import LiveServer, run_own_server
from openai.types import Completion

from skippy_cache.runtime import Engine
from skippy_cache.server import ServerSettings
from skippy_cache.server.metrics import EngineCollector
from skippy_cache.server.stats import cache_report

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
    "skippy_cache_host_entries",
    "skippy_cache_host_bytes",
    "skippy_cache_host_max_bytes",
]

HOST_COUNTERS = [
    "skippy_cache_host_hits_total",
    "skippy_cache_demotions_total",
    "skippy_cache_idle_evictions_total",
    "skippy_cache_restore_failures_total",
]

MIB = 1024 * 1024
#: The host-tier server: a 16 MiB tier, and entries demoted after 32 idle tokens.
HOST_MIB = 16
IDLE_TOKENS = 32


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_parse_and_move(server: LiveServer) -> None:
    before = server.metrics()
    for name in ENGINE_GAUGES:
        assert (name, ()) in before, f"{name} missing from /metrics"
    assert value(before, "skippy_cache_evictions_total") >= 0
    for name in HOST_COUNTERS:
        assert (name, ()) in before, f"{name} missing from /metrics"
    # The session server runs with the default host tier.
    assert value(before, "skippy_cache_host_max_bytes") == 2048 * MIB

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
    assert budgets["host_cache_bytes"] == 2048 * MIB and budgets["idle_tokens"] == 256
    assert report["pool"]["n_ctx"] == server.engine.info.n_ctx
    for key in ("entries", "resident_tokens", "records", "evictions"):
        assert key in report["resident"]
    # One counter set: each request's lookup counted once, hits by tier.
    counters = report["counters"]
    for key in ("lookups", "hits", "hit_tokens", "host_hits", "host_hit_tokens", "idle_evictions", "demotions",
                "restore_failures"):
        assert counters[key] >= 0
    assert counters["hits"] <= counters["lookups"] and counters["host_hits"] <= counters["hits"]
    host = report["host"]
    assert set(host) == {"entries", "bytes", "max_bytes", "puts", "evictions", "rejected"}
    assert host["max_bytes"] == 2048 * MIB
    assert 0 <= host["bytes"] <= host["max_bytes"]


@pytest.fixture(scope="module")
def host_server() -> Iterator[LiveServer]:
    # A prompt answered with one token records one entry: the whole prompt, with its first-token logits.
    settings = ServerSettings(ctx_size=1024, lanes=1, queue_size=4, host_cache_mib=HOST_MIB, idle_tokens=IDLE_TOKENS)
    yield from run_own_server(settings)


def test_host_tier_demotion_and_restore_in_metrics_and_report(host_server: LiveServer) -> None:
    server = host_server
    client = server.openai()

    def complete(prompt: str, max_tokens: int) -> Completion:
        return client.completions.create(model=server.model_id, prompt=prompt, max_tokens=max_tokens,
                                          temperature=0)

    def report() -> dict:
        with server.http() as http:
            return http.get("/v1/cache").json()

    start = report()
    assert start["budgets"]["host_cache_bytes"] == HOST_MIB * MIB
    assert start["budgets"]["idle_tokens"] == IDLE_TOKENS
    assert start["host"]["max_bytes"] == HOST_MIB * MIB
    assert (start["host"]["entries"], start["host"]["bytes"], start["host"]["puts"]) == (0, 0, 0)
    assert value(server.metrics(), "skippy_cache_host_max_bytes") == HOST_MIB * MIB

    # A prompt over min_tokens (64): recorded as one whole-prompt entry.
    prompt = "Host tier test: " + " ".join(f"item {i} of the list." for i in range(14))
    first = complete(prompt, 1)  # one token: the prompt is the lane's whole sequence, one entry
    n_prompt = first.usage.prompt_tokens
    assert n_prompt > 64, n_prompt
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    recorded = report()
    assert (recorded["resident"]["entries"], recorded["resident"]["resident_tokens"]) == (1, n_prompt)
    assert recorded["host"]["entries"] == 0 and recorded["counters"]["demotions"] == 0

    # A prompt too short to record (< 64 tokens) but longer than idle_tokens:
    # its prefill alone leaves the entry idle long enough to be demoted.
    filler = complete("Unrelated: " + " ".join(f"w{i}" for i in range(20)), 1)
    assert IDLE_TOKENS < filler.usage.prompt_tokens < 64, filler.usage.prompt_tokens
    demoted = report()
    assert demoted["resident"]["entries"] == 0 and demoted["resident"]["resident_tokens"] == 0
    host = demoted["host"]
    assert (host["entries"], host["puts"], host["evictions"], host["rejected"]) == (1, 1, 0, 0)
    # The exact state holds at least the K/V rows and logits the resident entry was estimated at.
    assert recorded["resident"]["estimated_bytes"] <= host["bytes"] <= HOST_MIB * MIB
    counters = demoted["counters"]
    assert (counters["idle_evictions"], counters["demotions"], counters["host_hits"],
            counters["restore_failures"]) == (1, 1, 0, 0)
    samples = server.metrics()
    assert value(samples, "skippy_cache_host_entries") == 1
    assert value(samples, "skippy_cache_host_bytes") == host["bytes"]
    assert value(samples, "skippy_cache_demotions_total") == 1
    assert value(samples, "skippy_cache_idle_evictions_total") == 1
    assert value(samples, "skippy_cache_host_hits_total") == 0
    assert value(samples, "skippy_cache_resident_entries") == 0

    # The same prompt again: its whole-prompt state restored from the host tier, every token cached.
    again = complete(prompt, 1)
    assert again.usage.prompt_tokens == n_prompt
    assert again.usage.prompt_tokens_details.cached_tokens == n_prompt
    restored = report()
    counters = restored["counters"]
    assert (counters["host_hits"], counters["host_hit_tokens"], counters["restore_failures"]) == (1, n_prompt, 0)
    assert counters["hits"] == 1 and counters["hit_tokens"] == n_prompt
    # Still in the host tier, and resident again (re-recorded from the restored lane).
    assert restored["host"]["entries"] == 1 and restored["resident"]["entries"] == 1
    samples = server.metrics()
    assert value(samples, "skippy_cache_host_hits_total") == 1
    assert value(samples, "skippy_cache_hits_total") == 1
    assert value(samples, "skippy_cache_restore_failures_total") == 0
    assert value(samples, "skippy_cache_demotions_total") == 1


def test_no_host_tier_reports_none_and_zeros() -> None:
    """host_cache_mib = 0 reaches the engine: no tier, `host: null`, zero host gauges."""
    settings = ServerSettings(ctx_size=256, lanes=1, host_cache_mib=0, idle_tokens=0)
    engine = Engine(settings.engine_config())
    try:
        report = cache_report(engine)
        assert report["host"] is None
        assert (report["budgets"]["host_cache_bytes"], report["budgets"]["idle_tokens"]) == (0, 0)
        assert report["counters"]["demotions"] == 0 and report["counters"]["host_hits"] == 0
        collected = {m.name: m.samples[0].value for m in EngineCollector(engine).collect()}
        for name in ("skippy_cache_host_entries", "skippy_cache_host_bytes", "skippy_cache_host_max_bytes",
                     "skippy_cache_host_hits", "skippy_cache_demotions", "skippy_cache_idle_evictions",
                     "skippy_cache_restore_failures"):
            assert collected[name] == 0, name
    finally:
        engine.close(drain=False)
