"""One bench run's shared state: the sizes, the targets, the client, and every measurement taken.

The workloads (workloads.py) only call `Run.request`, which sends one streamed request, records
its `Measurement` whatever happened, and advances the progress bar. A request may go to one
`Target` or to a `Replicas` group, which hands it to one of its servers by the request's index.
"""

from __future__ import annotations

import csv
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from skippy_cache.bench.client import BenchClient, Reply
from skippy_cache.bench.targets import Target
from skippy_cache.sizing.trace import TraceRequest

#: The default workloads, run on the targets, in this order.
WORKLOADS = ("warm", "tenants", "chat", "zero")
#: Run only when asked for: four agents' histories need a larger n_ctx than the others
#: (`agent_context`), on every server.
AGENT = "agent"
#: Starts its own servers (replicas.py) and is run only when asked for: it needs redis-server
#: and restarts servers for each of its configurations.
REPLICAS = "replicas"
#: Run only when asked for, with `--trace PATH`: a Mooncake-format trace's requests, in order.
TRACE = "trace"
ALL_WORKLOADS = (*WORKLOADS, AGENT, TRACE, REPLICAS)


@dataclass(frozen=True, slots=True)
class Sizes:
    """The workloads' parameters for a full run (`FULL`) or a smoke run's (`QUICK`). Token sizes are aims."""

    warm_prompt_tokens: tuple[int, ...] = (128, 2000)
    warm_repeats: int = 10
    tenants: int = 8
    tenant_system_tokens: int = 600
    tenant_question_words: int = 12
    tenant_rounds: int = 3
    concurrency: int = 4
    chat_conversations: int = 4
    chat_turns: int = 6
    chat_system_tokens: int = 150
    chat_user_tokens: int = 60
    chat_max_tokens: int = 24
    zero_prompts: int = 16  # per block, per target
    zero_blocks: int = 2  # blocks alternate target order (ABBA) so drift hits each target alike
    zero_prompt_tokens: int = 512
    zero_max_tokens: int = 16
    agents: int = 4
    agent_steps: int = 8
    #: The shared system prompt and tool list, in tokens.
    agent_system_tokens: int = 4000
    #: A tool result's size, drawn per step in this range.
    agent_result_tokens: tuple[int, int] = (100, 400)
    #: Room for one call and its arguments.
    agent_max_tokens: int = 64
    #: The trace workload: its first requests sent, and the tokens each 512-token block of the trace
    #: becomes (a multiple of 64: the server's chunk, so the replay names the same chunks).
    trace_requests: int = 120
    trace_block_tokens: int = 64
    trace_max_tokens: int = 8
    #: Each request is sent at its trace time times this, answered or not (None: one at a time, each
    #: sent when the last is answered).
    trace_time_scale: float | None = None

    @property
    def agent_context(self) -> int:
        """n_ctx the agent workload needs: every agent's whole history at once, as a server whose
        slots share no cells holds them."""
        per_step = self.agent_max_tokens + self.agent_result_tokens[1] + 32
        return self.agents * (self.agent_system_tokens + self.agent_steps * per_step)


FULL = Sizes()
QUICK = Sizes(
    warm_prompt_tokens=(128, 256),
    warm_repeats=3,
    tenants=3,
    tenant_system_tokens=160,
    tenant_rounds=2,
    concurrency=2,
    chat_conversations=2,
    chat_turns=3,
    chat_system_tokens=60,
    chat_user_tokens=20,
    chat_max_tokens=4,
    zero_prompts=3,
    zero_blocks=2,
    zero_prompt_tokens=96,
    zero_max_tokens=4,
    agents=2,
    agent_steps=3,
    agent_system_tokens=600,
    agent_result_tokens=(30, 80),
    agent_max_tokens=48,
    trace_requests=12,
    trace_max_tokens=2,
)


@dataclass(frozen=True, slots=True)
class Measurement:
    """One request as sent and as answered; `group` is the figure it feeds ("P=2000 warm", "turn 3")."""

    workload: str
    target: str
    group: str
    seq: int
    ok: bool
    ttft_ms: float | None
    total_ms: float
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    error: str | None
    #: Where skippy-cache took the reused state from (`skippy_cache.source`; None: not said).
    cache_source: str | None = None
    #: The replicas workload: which of the configuration's servers answered (0-based).
    replica: int | None = None
    #: skippy-cache's own restore time within the TTFT (`skippy_cache.restore_ms`; None: not said).
    restore_ms: float | None = None
    #: skippy-cache's wait for a lane and admission-to-first-token time (`skippy_cache.queue_ms`,
    #: `prefill_ms`; None: not said).
    queue_ms: float | None = None
    prefill_ms: float | None = None
    #: When it was sent, in seconds since the run began: which requests overlapped, for the timeline.
    sent_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


#: The timeline's columns (`write_timeline`): every request, in the order they were answered.
TIMELINE_COLUMNS = ("seq", "workload", "target", "group", "sent_s", "ok", "queue_ms", "prefill_ms",
                    "restore_ms", "ttft_ms", "total_ms", "prompt_tokens", "cached_tokens", "completion_tokens",
                    "cache_source", "error")


def write_timeline(path: Path, measurements: list[Measurement]) -> None:
    """Every request as one CSV row: when it was sent, its wait for a lane, its prefill, where its
    cache hit came from, its TTFT. A tail is read from this, not guessed from percentiles."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=TIMELINE_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for m in measurements:
            writer.writerow({k: round(v, 1) if isinstance(v, float) else v for k, v in m.to_json().items()})


@dataclass(frozen=True, slots=True)
class Span:
    """Wall time of a batch of requests on one target (throughput figures divide by it)."""

    workload: str
    target: str
    group: str
    wall_ms: float
    requests: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Replicas:
    """Servers measured as one: request i goes to server i mod N (the replicas workload's configurations)."""

    label: str
    members: list[Target]

    def member(self, index: int) -> tuple[int, Target]:
        """The server that takes the request with this index, and its number."""
        n = index % len(self.members)
        return n, self.members[n]


@dataclass(slots=True)
class Run:
    client: BenchClient
    targets: list[Target]
    sizes: Sizes
    seed: int
    #: Set by `calibrate` before any workload: prompt tokens per generated word.
    tokens_per_word: float = 1.1
    #: Set by `calibrate`: what it measured, for the JSON.
    calibration: dict[str, object] = field(default_factory=dict)
    #: Called after each request with (workload, target label, reply).
    on_request: Callable[[str, str, Reply], None] = lambda *_: None
    measurements: list[Measurement] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    #: The trace workload's requests (`--trace`), and per skippy-cache target the cached share (%)
    #: `skippy-cache replay` predicts for them under that server's own budgets.
    trace: list[TraceRequest] = field(default_factory=list)
    predicted: dict[str, float] = field(default_factory=dict)
    #: The model's KV bytes per token, for the replay's budgets (set when the trace workload runs).
    kv_bytes_per_token: int = 1
    #: `time.perf_counter()` when the run began: the timeline's zero.
    started: float = field(default_factory=time.perf_counter)

    def targets_for(self, workload: str) -> list[Target]:
        """The cache-off twin exists only to measure the cache's overhead: the zero workload."""
        return [t for t in self.targets if workload == "zero" or t.kind != "skippy-cache-off"]

    async def request(
        self,
        workload: str,
        target: Target | Replicas,
        group: str,
        path: str,
        body: dict[str, Any],
        index: int = 0,
    ) -> Reply:
        """Send one request and record it; `index` picks the server of a `Replicas` target."""
        replica, server = target.member(index) if isinstance(target, Replicas) else (None, target)
        if server.model_id is not None:
            body = {"model": server.model_id, **body}
        sent = time.perf_counter() - self.started
        reply = await self.client.stream(server.url, path, body)
        self.measurements.append(
            Measurement(
                workload,
                target.label,
                group,
                len(self.measurements),
                reply.ok,
                reply.ttft_ms,
                reply.total_ms,
                reply.prompt_tokens,
                reply.cached_tokens,
                reply.completion_tokens,
                reply.error,
                reply.cache_source,
                replica,
                reply.restore_ms,
                reply.queue_ms,
                reply.prefill_ms,
                sent,
            )
        )
        self.on_request(workload, target.label, reply)
        return reply

    def span(
        self, workload: str, target: Target | Replicas, group: str, started: float, requests: int
    ) -> None:
        """Record the wall time since `started` (a `time.perf_counter()` value)."""
        self.spans.append(
            Span(workload, target.label, group, (time.perf_counter() - started) * 1000, requests)
        )


def planned_requests(workload: str, sizes: Sizes, n_targets: int) -> int:
    """Requests a workload sends to one target (the progress bar's total)."""
    if workload == "warm":
        return len(sizes.warm_prompt_tokens) * (1 + sizes.warm_repeats) * n_targets
    if workload == "tenants":
        return sizes.tenants * sizes.tenant_rounds * n_targets
    if workload == "chat":
        return sizes.chat_conversations * sizes.chat_turns * n_targets
    if workload == "zero":
        return sizes.zero_prompts * sizes.zero_blocks * n_targets
    if workload == AGENT:  # n_targets: the (target, API) pairs
        return sizes.agents * sizes.agent_steps * n_targets
    if workload == TRACE:
        return sizes.trace_requests * n_targets
    if workload == REPLICAS:  # n_targets: its configurations, each sent the tenants and chat traffic
        return (planned_requests("tenants", sizes, 1) + planned_requests("chat", sizes, 1)) * n_targets
    raise ValueError(f"unknown workload {workload!r} (known: {', '.join(ALL_WORKLOADS)})")
