"""Prometheus metrics on a registry of the server's own.

Two kinds: what the server observes per request (HTTP status, tokens, time to
first token), counted as it happens; and the engine's state (lanes, queue,
cells, cache entries), read from `engine.stats()` only when /metrics is
scraped, so the engine's loop does no metrics work.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from skippy_cache.runtime import RTT_BUCKETS, DoneEvent, Engine, FinishReason, RemoteStats
from skippy_cache.server.timeline import Timeline
from skippy_cache.tiers import StoreStats

#: Time to first token: tens of ms for a full cache hit, seconds for a cold
#: long prompt on a CPU, minutes when queued behind a full pool.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self, engine: Engine, endpoints: Iterable[str]) -> None:
        self.registry = CollectorRegistry()
        self.endpoints = frozenset(endpoints)
        r = self.registry
        self.requests = Counter(
            "skippy_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.ignored_fields = Counter(
            "skippy_ignored_fields", "Request fields accepted and ignored (they cannot change the output), "
            "by endpoint and field", ["endpoint", "field"], registry=r,
        )
        self.generations = Counter(
            "skippy_generations", "Engine requests by how they ended (stop, length, cancelled, error)",
            ["reason"], registry=r,
        )
        self.prompt_tokens = Counter("skippy_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(
            "skippy_cached_prompt_tokens", "Prompt tokens served from the resident prefix cache", registry=r
        )
        self.completion_tokens = Counter("skippy_completion_tokens", "Tokens generated", registry=r)
        self.hit_ratio = Gauge(
            "skippy_prompt_cache_hit_ratio", "Cached prompt tokens / prompt tokens since start", registry=r
        )
        self.ttft = Histogram(
            "skippy_time_to_first_token_seconds", "Submit to first generated token (queue + prefill)",
            buckets=TTFT_BUCKETS, registry=r,
        )
        self._prompt_total = 0
        self._cached_total = 0
        #: Each tenant's own figures: what a user key may see (/v1/cache, the dashboard), and the
        #: `skippy_tenant_*` series (labelled by the tenant's name, never by its key).
        self.tenants: dict[str, TenantTotals] = {}
        #: The dashboard's recent history.
        self.timeline = Timeline()
        r.register(EngineCollector(engine))
        r.register(TenantCollector(self.tenants))

    def observe_done(self, done: DoneEvent, tenant: str | None = None) -> None:
        self.timeline.add(done, tenant=tenant)
        stats = done.stats
        if tenant is not None:
            self.tenants.setdefault(tenant, TenantTotals()).add(done)
        self.generations.labels(done.finish_reason.value).inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.inc(stats.cached_tokens)
        self.completion_tokens.inc(stats.completion_tokens)
        self._prompt_total += stats.prompt_tokens
        self._cached_total += stats.cached_tokens
        if self._prompt_total:
            self.hit_ratio.set(self._cached_total / self._prompt_total)
        if stats.completion_tokens and done.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.ttft.observe(stats.ttft_ms / 1000)

    def tenant_totals(self, tenant: str) -> TenantTotals:
        return self.tenants.get(tenant) or TenantTotals()

    def refused(self, tenant: str) -> None:
        """A request of `tenant` refused past --tenant-max-requests."""
        self.tenants.setdefault(tenant, TenantTotals()).refused += 1

    def endpoint_label(self, path: str) -> str:
        # Unknown paths share one label: a scanner must not grow the series without bound.
        return path if path in self.endpoints else "other"

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(slots=True)
class TenantTotals:
    """One tenant's ended requests: what its user keys are shown in place of the server's counters."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    #: Requests that reused a cached prefix.
    hits: int = 0
    #: Requests by why they reused no more, as each was told (another tenant's prompt is `never_seen`).
    misses: dict[str, int] = field(default_factory=dict)
    missed_tokens: dict[str, int] = field(default_factory=dict)
    #: Requests refused past --tenant-max-requests (429).
    refused: int = 0

    def add(self, done: DoneEvent) -> None:
        stats = done.stats
        self.requests += 1
        self.prompt_tokens += stats.prompt_tokens
        self.cached_tokens += stats.cached_tokens
        self.hits += stats.cached_tokens > 0
        if stats.miss_reason is not None:
            self.misses[stats.miss_reason] = self.misses.get(stats.miss_reason, 0) + 1
            missed = stats.prompt_tokens - stats.cached_tokens
            self.missed_tokens[stats.miss_reason] = self.missed_tokens.get(stats.miss_reason, 0) + missed


class TenantCollector(Collector):
    """The `skippy_tenant_*` counters, read from the tenants' totals at scrape time."""

    def __init__(self, tenants: dict[str, TenantTotals]) -> None:
        self.tenants = tenants

    def collect(self) -> Iterator[Metric]:
        families = {
            "skippy_tenant_requests": ("Engine requests ended, by tenant", lambda t: t.requests),
            "skippy_tenant_prompt_tokens": ("Prompt tokens of ended requests, by tenant", lambda t: t.prompt_tokens),
            "skippy_tenant_cached_prompt_tokens": (
                "Prompt tokens served from the cache, by tenant", lambda t: t.cached_tokens
            ),
            "skippy_tenant_refused": (
                "Requests refused for a tenant past --tenant-max-requests (429)", lambda t: t.refused
            ),
        }
        for name, (doc, value) in families.items():
            family = CounterMetricFamily(name, doc, labels=["tenant"])
            for tenant, totals in sorted(self.tenants.items()):
                family.add_metric([tenant], value(totals))
            yield family


class EngineCollector(Collector):
    """The engine's lanes, queue, cell pool, cache and state store, read at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        c = s.cache.resident
        store = s.cache.store
        n = s.cache.counters
        gauges = {
            "skippy_lanes_total": ("Execution lanes", s.lanes_total),
            "skippy_lanes_busy": ("Lanes running a request", s.lanes_busy),
            "skippy_queue_depth": ("Requests waiting for a lane", s.queue_depth),
            "skippy_engine_threads": (
                "llama.cpp threads the next step runs with (fewer while other processes keep cores busy)", s.threads
            ),
            "skippy_cpu_others_cores": (
                "Cores' worth of this process's CPUs that other processes used lately", s.cpu_others
            ),
            "skippy_kv_cells_total": ("KV cells in the pool (n_ctx)", s.n_ctx),
            "skippy_kv_cells_used": ("KV cells held by lanes and cache entries", s.used_cells),
            "skippy_kv_cells_reserved": ("KV cells reserved by running requests", s.reserved_cells),
            "skippy_cache_resident_entries": ("Resident prefix cache entries", c.entries),
            "skippy_cache_resident_tokens": (
                "Resident entries' tokens summed (a token entries share counts for each)", c.resident_tokens
            ),
            "skippy_cache_resident_cells": (
                "Distinct KV cells resident entries hold (what the resident token cap counts)",
                c.resident_cells,
            ),
            "skippy_cache_resident_bytes": ("Estimated KV bytes of resident entries", c.estimated_bytes),
            "skippy_cache_max_entries": ("Entry budget", c.max_entries),
            "skippy_cache_max_resident_tokens": ("Resident token cap (0: none)", c.max_resident_tokens),
            "skippy_cache_max_bytes": ("Byte cap (0: none)", c.max_bytes),
            "skippy_store_pages": (
                "Entries this server put into the state store", store.pages if store is not None else 0
            ),
            "skippy_store_pending": (
                "Exported states waiting for the store's writer", store.pending if store is not None else 0
            ),
            "skippy_store_restore_buffer_bytes": (
                "Bytes of the buffer restores are joined into, kept for the next restore",
                store.restore_buffer_bytes if store is not None else 0,
            ),
            "skippy_store_dedup_ratio": (
                "Bytes stored on behalf of entries / bytes held (chunks shared by prefixes count once)",
                store.chunks.dedup_ratio if store is not None else 0.0,
            ),
            "skippy_cache_recoverable_miss_ratio": (
                "Prompt tokens missed on evicted prefixes / all missed tokens: how much a bigger cache would help",
                n.missed_tokens.get("evicted", 0) / missed if (missed := sum(n.missed_tokens.values())) else 0.0,
            ),
            "skippy_cache_lookup_hit_ratio": (
                "Lookups that reused a cached prefix / lookups",
                n.hits / n.lookups if n.lookups else 0.0,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "skippy_cache_lookups": ("Requests that looked up a prefix", n.lookups),
            "skippy_cache_hits": ("Lookups that reused a cached prefix (resident or restored)", n.hits),
            "skippy_cache_records": ("Prefix entries recorded", c.records),
            "skippy_cache_evictions": ("Entries evicted (budgets, free-cell pressure, idleness)", c.evictions),
            "skippy_cache_uncacheable": ("Records refused as larger than a budget", c.uncacheable),
            "skippy_cache_restores": (
                "Lookups served by restoring a state from the store (also in skippy_cache_hits)", n.restores
            ),
            "skippy_cache_disk_restores": ("Restores that read at least one chunk from disk", n.disk_restores),
            "skippy_cache_remote_restores": (
                "Restores that used chunks fetched from the shared tier", n.remote_restores
            ),
            "skippy_cache_restored_tokens": ("Tokens restored from the store", n.restore_tokens),
            "skippy_cache_restore_shared_tokens": (
                "Of the tokens restored, those shared with a resident entry's cells rather than imported",
                n.restore_shared_tokens,
            ),
            "skippy_cache_restore_seconds": ("Time spent restoring from the store", n.restore_ms / 1000),
            "skippy_cache_demotions": (
                "Entries whose state went to the store (evicted, or too large for the pool)", n.demotions
            ),
            "skippy_cache_store_drops": (
                "Evicted entries the store's writer was too far behind to take", n.store_drops
            ),
            "skippy_cache_idle_evictions": (
                "Entries evicted for sitting unused while the pool decoded idle_tokens tokens",
                n.idle_evictions,
            ),
            "skippy_cache_restore_failures": (
                "Restores that failed (a chunk gone or quarantined, a state llama.cpp refused): misses",
                n.restore_failures,
            ),
            "skippy_cache_inflight_joins": (
                "Requests that shared the cells of a prefix another running request was prefilling",
                n.joins,
            ),
            "skippy_cache_inflight_join_tokens": (
                "Prompt tokens those requests shared instead of prefilling them again", n.join_tokens
            ),
            "skippy_placement_pad_tokens": (
                "Exact mode: pad cells imported so that steps land on the 64-cell grid", s.placement.pad_tokens
            ),
            "skippy_placement_unaligned_steps": (
                "Exact mode: steps that could not be placed on the grid (their output may not be bit-exact)",
                s.placement.unaligned_steps,
            ),
            "skippy_placement_relocations": (
                "Exact mode: lanes moved down the pool for want of free cells past their own",
                s.placement.relocations,
            ),
            "skippy_engine_steps": ("Engine steps (one llama_decode each)", s.steps),
            "skippy_engine_decode_failures": ("llama_decode calls that failed", s.decode_failures),
            "skippy_engine_lookup_guesses": (
                "Lone decode steps that decoded a guessed next token in their spare row (prompt lookup)",
                s.guesses,
            ),
            "skippy_engine_lookup_guesses_taken": (
                "Of those, steps whose guess was the sampled token: two tokens from one step", s.guesses_taken
            ),
            "skippy_engine_forced_tokens_fed": (
                "Tokens a grammar forced, fed in the decode step of the token before them (jump-forward)",
                s.forced_fed,
            ),
            "skippy_engine_forced_tokens_taken": (
                "Of those, tokens sampling picked (the rest had their cells taken back)", s.forced_taken
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        misses = CounterMetricFamily(
            "skippy_cache_misses", "Requests that reused less than all but their last prompt token, by why not more",
            labels=["reason"],
        )
        missed = CounterMetricFamily(
            "skippy_cache_missed_tokens", "Prompt tokens those requests prefilled, by why they were not reused",
            labels=["reason"],
        )
        for reason, count in sorted(n.misses.items()):
            misses.add_metric([reason], count)
            missed.add_metric([reason], n.missed_tokens.get(reason, 0))
        yield misses
        yield missed
        yield from _store_metrics(store)
        yield from _remote_metrics(s.remote)


def _store_metrics(store: StoreStats | None) -> Iterator[Metric]:
    """The store's tiers, labelled tier="ram" / tier="disk" (zeros without a store)."""
    chunks = store.chunks if store is not None else None
    disk = chunks.disk if chunks is not None else None
    tiers = {
        "ram": (chunks.ram_chunks, chunks.ram_bytes, chunks.ram_max_bytes, chunks.ram_hits) if chunks else (0,) * 4,
        "disk": (disk.chunks, disk.bytes, disk.max_bytes, chunks.disk_hits) if disk and chunks else (0,) * 4,
    }
    families = [
        GaugeMetricFamily("skippy_store_chunks", "Chunks held, per tier", labels=["tier"]),
        GaugeMetricFamily("skippy_store_bytes", "Bytes held, per tier", labels=["tier"]),
        GaugeMetricFamily("skippy_store_max_bytes", "Byte budget, per tier (0: tier off)", labels=["tier"]),
        CounterMetricFamily("skippy_store_hits", "Chunks read (verified), per tier", labels=["tier"]),
    ]
    for tier, values in tiers.items():
        for family, value in zip(families, values, strict=True):
            family.add_metric([tier], value)
    yield from families
    bonus = GaugeMetricFamily(
        "skippy_store_eviction_bonus",
        "LRFU: turnovers a chunk used twice stays longer, as the tier's shadow books chose lately",
        labels=["tier"],
    )
    for tier, value in (("ram", chunks.ram_eviction_bonus if chunks else None),
                        ("disk", disk.eviction_bonus if disk else None)):
        if value is not None:
            bonus.add_metric([tier], value)
    yield bonus
    counters = {
        "skippy_store_misses": ("Chunk reads that found nothing", chunks.misses if chunks else 0),
        "skippy_store_quarantined": (
            "Chunks that failed verification, moved aside and served as misses", chunks.quarantined if chunks else 0
        ),
        "skippy_store_disk_write_failures": ("Disk writes that failed (full, read-only)", disk.write_failures if disk else 0),
        "skippy_store_disk_skipped": (
            "Chunks not written: over the disk budget or the filesystem's free-space reserve",
            disk.skipped_full if disk else 0,
        ),
    }
    for name, (doc, value) in counters.items():
        yield CounterMetricFamily(name, doc, value=value)


def _remote_metrics(remote: RemoteStats | None) -> Iterator[Metric]:
    """The shared tier (Redis/Valkey); nothing without one."""
    if remote is None:
        return
    yield GaugeMetricFamily("skippy_remote_up", "1 while the shared tier answers, 0 while its breaker is open",
                            value=int(remote.up))
    yield GaugeMetricFamily("skippy_remote_pending_bytes", "Chunk bytes waiting to be written to the shared tier",
                            value=remote.pending_bytes)
    yield GaugeMetricFamily("skippy_remote_turnover_seconds",
                            "The shared tier's turnover: keys held over keys evicted per second "
                            "(0 until it evicts)",
                            value=remote.turnover_s)
    counters = {
        "skippy_remote_lookups": ("Prompts looked up on the shared tier", remote.lookups),
        "skippy_remote_lookups_skipped": ("Lookups skipped while the shared tier was down", remote.lookups_skipped),
        "skippy_remote_hits": ("Chunks fetched from the shared tier and verified", remote.hits),
        "skippy_remote_misses": ("Lookups whose run of chunks ended on one the shared tier lacked", remote.misses),
        "skippy_remote_rejected": ("Fetched values that failed verification (never imported)", remote.rejected),
        "skippy_remote_writes": ("Chunks written to the shared tier", remote.writes),
        "skippy_remote_present": ("Chunks not sent: the shared tier held them already", remote.present),
        "skippy_remote_dropped": ("Chunk writes dropped: queue full or the tier down", remote.dropped),
        "skippy_remote_errors": ("Round trips that failed (timeouts, refused connections)", remote.errors),
    }
    for name, (doc, value) in counters.items():
        yield CounterMetricFamily(name, doc, value=value)
    moved = CounterMetricFamily("skippy_remote_bytes", "Bytes moved to and from the shared tier",
                                labels=["direction"])
    moved.add_metric(["in"], remote.bytes_in)
    moved.add_metric(["out"], remote.bytes_out)
    yield moved
    buckets, total = [], 0
    for bound, count in zip((*RTT_BUCKETS, float("inf")), remote.rtt_counts, strict=True):
        total += count
        buckets.append((floatToGoString(bound), total))
    yield HistogramMetricFamily("skippy_remote_round_trip_seconds", "Round trips to the shared tier",
                                buckets=buckets, sum_value=remote.rtt_sum)


class RequestCounter:
    """ASGI middleware: count each HTTP request by endpoint and final status."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception before the response started

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                ignored = scope.get("state", {}).get("ignored_fields")
                if ignored:
                    # Named, so a client can see what this server did not act on; counted by name
                    # (the names are the request models' own, never a client's text).
                    message["headers"] = [*message.get("headers", []),
                                          (b"x-skippy-ignored", ",".join(ignored).encode("ascii"))]
                    endpoint = self.metrics.endpoint_label(scope["path"])
                    for name in ignored:
                        self.metrics.ignored_fields.labels(endpoint, name).inc()
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.requests.labels(self.metrics.endpoint_label(scope["path"]), str(status)).inc()
