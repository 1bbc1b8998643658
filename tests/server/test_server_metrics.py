"""/metrics parses with prometheus_client's parser and moves as requests are served; /health, /v1/cache.

The state store (exact KV states that left the pool, as chunks) is followed
on a server of its own, small enough that one idle entry is demoted on cue.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from live_server import LiveServer, run_own_server
from metric_docs import SHARED_TIER_PREFIX, documented_metrics, exposed_metrics, undocumented
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
    "skippy_store_pages",
    "skippy_store_pending",
    "skippy_store_dedup_ratio",
]

STORE_COUNTERS = [
    "skippy_cache_restores_total",
    "skippy_cache_disk_restores_total",
    "skippy_cache_demotions_total",
    "skippy_cache_idle_evictions_total",
    "skippy_cache_restore_failures_total",
    "skippy_store_misses_total",
    "skippy_store_quarantined_total",
]

#: Per-tier store metrics, labelled tier="ram" and tier="disk".
STORE_TIER_METRICS = ["skippy_store_chunks", "skippy_store_bytes", "skippy_store_max_bytes",
                      "skippy_store_hits_total"]

MIB = 1024 * 1024
#: The store server: a 16 MiB RAM tier, and entries demoted after 32 idle tokens.
HOST_MIB = 16
IDLE_TOKENS = 32


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_parse_and_move(server: LiveServer) -> None:
    before = server.metrics()
    for name in ENGINE_GAUGES:
        assert (name, ()) in before, f"{name} missing from /metrics"
    assert value(before, "skippy_cache_evictions_total") >= 0
    for name in STORE_COUNTERS:
        assert (name, ()) in before, f"{name} missing from /metrics"
    for name in STORE_TIER_METRICS:
        for tier in ("ram", "disk"):
            assert (name, (("tier", tier),)) in before, f"{name}{{tier={tier}}} missing from /metrics"
    # The session server runs with the default RAM tier and no disk tier.
    assert value(before, "skippy_store_max_bytes", tier="ram") == server.engine.info.host_cache_bytes > 0
    assert value(before, "skippy_store_max_bytes", tier="disk") == 0

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
    # The first was a miss never seen before, its whole prefill counted; the repeat was no miss.
    assert value(after, "skippy_cache_misses_total", reason="never_seen") \
        == value(before, "skippy_cache_misses_total", reason="never_seen") + 1
    assert value(after, "skippy_cache_missed_tokens_total", reason="never_seen") \
        == value(before, "skippy_cache_missed_tokens_total", reason="never_seen") + first.usage.prompt_tokens - 1
    assert value(after, "skippy_cache_hits_total") >= value(before, "skippy_cache_hits_total") + 1
    assert value(after, "skippy_cache_resident_entries") >= 1
    assert value(after, "skippy_cache_resident_tokens") > 0
    assert 0 < value(after, "skippy_prompt_cache_hit_ratio") <= 1
    assert value(after, "skippy_lanes_total") == server.settings.lanes


def test_every_metric_is_in_the_docs_and_every_documented_one_exists(server: LiveServer) -> None:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert not undocumented(text), "add them to the metrics table of docs/serving/endpoints.md"
    missing = set(documented_metrics()) - set(exposed_metrics(text))
    assert {name for name in missing if not name.startswith(SHARED_TIER_PREFIX)} == set()


def test_exact_mode_placement_in_metrics(exact_server: LiveServer) -> None:
    # Exact mode steers cells onto the grid with imported pads: how much, and whether a step missed it.
    # A prompt that starts while another request decodes cannot start where that lane's cells end (its
    # room to grow is kept), and no idle entry can make way for it: pads fill the gap. (Alone on a
    # fresh pool, one request after another, the second one's lane would take the first one's
    # demoted entry's cells from cell 0 instead.)
    def prompt(topic: str) -> str:
        return f"{topic} test: " + " ".join(f"line {i} of a preamble long enough to tile." for i in range(24))

    client = exact_server.openai()
    decoding = client.completions.create(model=exact_server.model_id, prompt=prompt("placement"),
                                         max_tokens=48, stream=True)
    next(iter(decoding))
    client.completions.create(model=exact_server.model_id, prompt=prompt("alignment"), max_tokens=2)
    list(decoding)  # to its end, so the lane is done before the counters are read
    samples = exact_server.metrics()
    with exact_server.http() as http:
        placement = http.get("/v1/cache").json()["pool"]
    for name in ("pad_tokens", "unaligned_steps", "relocations"):
        assert value(samples, f"skippy_placement_{name}_total") == placement[name], name
    assert value(samples, "skippy_placement_pad_tokens_total") > 0
    assert value(samples, "skippy_placement_unaligned_steps_total") == 0


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
    assert budgets["host_cache_bytes"] == server.engine.info.host_cache_bytes > 0
    assert budgets["idle_tokens"] == 256 and budgets["chunk_tokens"] == 64 and budgets["cache_dir"] is None
    assert budgets["eviction"] == "lrfu"
    assert report["pool"]["n_ctx"] == server.engine.info.n_ctx
    for key in ("entries", "resident_tokens", "records", "evictions"):
        assert key in report["resident"]
    # One counter set: each request's lookup counted once, hits by tier.
    counters = report["counters"]
    for key in ("lookups", "hits", "hit_tokens", "restores", "restore_tokens", "disk_restores", "idle_evictions",
                "demotions", "restore_failures", "joins", "join_tokens"):
        assert counters[key] >= 0
    assert counters["hits"] <= counters["lookups"] and counters["restores"] <= counters["hits"]
    store = report["store"]
    assert set(store) == {"pages", "pending", "chunk_tokens", "chunks", "restore_buffer_bytes"}
    chunks = store["chunks"]
    assert chunks["ram_max_bytes"] == server.engine.info.host_cache_bytes and chunks["disk"] is None
    assert 0 <= chunks["ram_bytes"] <= chunks["ram_max_bytes"]
    # LRFU's bonus: one turnover until the RAM tier has evicted enough to judge its shadow books.
    assert chunks["ram_eviction_bonus"] == 1.0
    assert value(server.metrics(), "skippy_store_eviction_bonus", tier="ram") == 1.0


@pytest.fixture(scope="module")
def store_server() -> Iterator[LiveServer]:
    # A prompt answered with one token records one entry: the whole prompt, with its first-token logits.
    # Chunks of 256: the test's prompt is shorter than one, so its entry is stored as one chunk (its tail).
    settings = ServerSettings(ctx_size=1024, lanes=1, queue_size=4, host_cache_mib=HOST_MIB, idle_tokens=IDLE_TOKENS,
                              chunk_tokens=256, fast=True)
    yield from run_own_server(settings)


def test_store_demotion_and_restore_in_metrics_and_report(store_server: LiveServer) -> None:
    server = store_server
    client = server.openai()

    def complete(prompt: str, max_tokens: int) -> Completion:
        return client.completions.create(model=server.model_id, prompt=prompt, max_tokens=max_tokens,
                                          temperature=0)

    def report() -> dict:
        # The store's writer cuts exports in the background: read the books once it is done.
        deadline = time.monotonic() + 30
        while True:
            with server.http() as http:
                body = http.get("/v1/cache").json()
            if body["store"]["pending"] == 0 or time.monotonic() > deadline:
                return body
            time.sleep(0.05)

    start = report()
    assert start["budgets"]["host_cache_bytes"] == HOST_MIB * MIB
    assert start["budgets"]["idle_tokens"] == IDLE_TOKENS
    assert start["store"]["chunks"]["ram_max_bytes"] == HOST_MIB * MIB
    assert (start["store"]["pages"], start["store"]["chunks"]["ram_chunks"]) == (0, 0)
    assert value(server.metrics(), "skippy_store_max_bytes", tier="ram") == HOST_MIB * MIB

    # A prompt over min_tokens (64): recorded as one whole-prompt entry.
    prompt = "Store test: " + " ".join(f"item {i} of the list." for i in range(14))
    first = complete(prompt, 1)  # one token: the prompt is the lane's whole sequence, one entry
    n_prompt = first.usage.prompt_tokens
    assert 64 < n_prompt < 256, n_prompt  # shorter than a chunk: the whole entry is its tail
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    recorded = report()
    assert (recorded["resident"]["entries"], recorded["resident"]["resident_tokens"]) == (1, n_prompt)
    assert recorded["store"]["pages"] == 0 and recorded["counters"]["demotions"] == 0

    # A prompt too short to record (< 64 tokens) but longer than idle_tokens:
    # its prefill alone leaves the entry idle long enough to be demoted.
    filler = complete("Unrelated: " + " ".join(f"w{i}" for i in range(20)), 1)
    assert IDLE_TOKENS < filler.usage.prompt_tokens < 64, filler.usage.prompt_tokens
    demoted = report()
    assert demoted["resident"]["entries"] == 0 and demoted["resident"]["resident_tokens"] == 0
    store = demoted["store"]
    assert (store["pages"], store["pending"], store["chunks"]["ram_chunks"]) == (1, 0, 1)
    # The chunk holds at least the K/V rows and logits the resident entry was estimated at.
    assert recorded["resident"]["estimated_bytes"] <= store["chunks"]["ram_bytes"] <= HOST_MIB * MIB
    counters = demoted["counters"]
    assert (counters["idle_evictions"], counters["demotions"], counters["restores"],
            counters["restore_failures"]) == (1, 1, 0, 0)
    samples = server.metrics()
    assert value(samples, "skippy_store_pages") == 1
    assert value(samples, "skippy_store_chunks", tier="ram") == 1
    assert value(samples, "skippy_store_bytes", tier="ram") == store["chunks"]["ram_bytes"]
    assert value(samples, "skippy_cache_demotions_total") == 1
    assert value(samples, "skippy_cache_idle_evictions_total") == 1
    assert value(samples, "skippy_cache_restores_total") == 0
    assert value(samples, "skippy_cache_resident_entries") == 0
    assert store["restore_buffer_bytes"] == value(samples, "skippy_store_restore_buffer_bytes") == 0

    # The same prompt again: its whole-prompt state restored from the store, every token cached.
    again = complete(prompt, 1)
    assert again.usage.prompt_tokens == n_prompt
    assert again.usage.prompt_tokens_details.cached_tokens == n_prompt
    # The response says so too: restored from the store's RAM tier, and how long that took.
    said = again.model_extra["skippy_cache"]
    assert (said["source"], said["matched_tokens"]) == ("ram", n_prompt) and said["restore_ms"] > 0
    restored = report()
    counters = restored["counters"]
    assert (counters["restores"], counters["restore_tokens"], counters["restore_failures"]) == (1, n_prompt, 0)
    assert counters["hits"] == 1 and counters["hit_tokens"] == n_prompt and counters["restore_ms"] > 0
    # Still in the store, and resident again (re-recorded from the restored lane).
    assert restored["store"]["pages"] == 1 and restored["resident"]["entries"] == 1
    # The buffer its chunks were joined into is kept for the next restore.
    assert restored["store"]["restore_buffer_bytes"] > 0
    samples = server.metrics()
    assert value(samples, "skippy_cache_restores_total") == 1
    assert value(samples, "skippy_store_hits_total", tier="ram") == 1
    assert value(samples, "skippy_cache_hits_total") == 1
    assert value(samples, "skippy_cache_restore_failures_total") == 0
    assert value(samples, "skippy_cache_demotions_total") == 1


def test_no_store_reports_none_and_zeros() -> None:
    """host_cache_mib = 0 and no cache_dir reach the engine: no store, `store: null`, zero store metrics."""
    settings = ServerSettings(ctx_size=256, lanes=1, host_cache_mib=0, idle_tokens=0, fast=True)
    engine = Engine(settings.engine_config())
    try:
        report = cache_report(engine)
        assert report["store"] is None
        assert (report["budgets"]["host_cache_bytes"], report["budgets"]["idle_tokens"]) == (0, 0)
        assert report["counters"]["demotions"] == 0 and report["counters"]["restores"] == 0
        collected = {(sample.name, tuple(sample.labels.items())): sample.value
                     for m in EngineCollector(engine).collect() for sample in m.samples}
        for name in ("skippy_store_pages", "skippy_cache_restores", "skippy_cache_demotions",
                     "skippy_cache_idle_evictions", "skippy_cache_restore_failures", "skippy_store_misses"):
            assert collected[(name if name.startswith("skippy_store_p") else name + "_total", ())] == 0, name
        for tier in ("ram", "disk"):
            assert collected[("skippy_store_max_bytes", (("tier", tier),))] == 0
    finally:
        engine.close(drain=False)


def test_the_pool_audit_at_rest_finds_every_used_cell_in_an_entry(server: LiveServer) -> None:
    """After requests that record and reuse entries, no cell is left to a lane or to no one."""
    system = {"role": "system", "content": "You are a careful assistant who answers in one word. " * 12}
    client = server.openai()
    for question in ("Name a colour.", "Name a fruit.", "Name a colour."):
        client.chat.completions.create(model=server.model_id, max_tokens=4, temperature=0,
                                       messages=[system, {"role": "user", "content": question}])
    server.wait_idle()
    with server.http(timeout=60) as http:
        pool = http.get("/v1/cache").json()["pool"]
    audit = pool["audit"]
    assert (audit["lane_cells"], audit["unowned_cells"], audit["native_mismatches"]) == (0, 0, 0), audit
    assert audit["used_cells"] == audit["entry_cells"] == pool["used_cells"] > 0, audit
