"""`skippy-cache replay`: options, the run, and its outputs (table, JSON, plot)."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from skippy_cache.eviction import Policy
from skippy_cache.sizing.replay import (
    Capacities,
    ReplayConfig,
    ReplayFigures,
    Routing,
    belady,
    replay,
)
from skippy_cache.sizing.sharedtier import ServerPolicy
from skippy_cache.sizing.trace import BLOCK_TOKENS, TraceError, TraceRequest, read_trace
from skippy_cache.tiers import Source

#: RAM capacities of the plot's sweep, in blocks.
SWEEP_BLOCKS = (1000, 2000, 4000, 8000, 16000, 32000, 64000)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_CAPACITY = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)
#: Prompt tokens of the prefill the default `--prefill-rate` measures.
_PROBE_TOKENS = 2048


class UsageError(ValueError):
    """A bad option: one line, exit 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="skippy-cache replay",
        description="Replay a Mooncake-format trace (JSON lines: timestamp ms, input_length, output_length, "
        "hash_ids) through the cache's own tiers and eviction policy, with no model loaded: the token hit "
        "ratio per tier for the capacities given, the infinite-cache bound, the bytes restored and the "
        "prefill time saved. Capacities: a number of tokens, 'N blocks', or bytes ('64GiB', '500MB').",
    )
    p.add_argument("trace", type=Path, help="the trace (Mooncake's, or one `serve --trace-log` wrote)")
    p.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS,
                   help=f"tokens per hash id in the trace, and per stored chunk (default {BLOCK_TOKENS})")
    p.add_argument("--ram", default="16000 blocks", help="RAM tier per replica (default '16000 blocks')")
    p.add_argument("--disk", default="0", help="disk tier per replica (default 0: none)")
    p.add_argument("--remote", default="0", help="one shared tier for all replicas (default 0: none)")
    p.add_argument("--resident", default="0",
                   help="cells each replica's llama.cpp pool keeps for cache entries, a server's cap (half its "
                        "--ctx-size); entries that share a prefix share its cells (default 0: every entry goes to "
                        "the store)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-bytes-per-token", type=int,
                    help="KV state bytes per token (default: the --model's, at f16)")
    kv.add_argument("--model", type=Path, help="a GGUF model whose KV size per token turns tokens into bytes "
                    "(default: SmolLM2-135M-Instruct, the server's default model)")
    p.add_argument("--policy", choices=[x.value for x in Policy], default=Policy.LRFU.value,
                   help="eviction policy of the RAM and disk tiers (default lrfu)")
    p.add_argument("--remote-policy", choices=[x.value for x in ServerPolicy],
                   default=ServerPolicy.VOLATILE_TTL.value,
                   help="the shared tier's maxmemory-policy (default volatile-ttl: it evicts in the "
                   "replicas' LRFU order; allkeys-lru: by LRU)")
    p.add_argument("--replicas", type=int, default=1, help="servers, each with the tiers above (default 1)")
    p.add_argument("--routing", choices=[r.value for r in Routing], default=Routing.ROUND_ROBIN.value,
                   help="which replica serves a request (default round-robin)")
    p.add_argument("--prefill-rate", type=float,
                   help="prompt tokens per second a replica prefills, for the time saved and least-loaded "
                   f"routing (default: measured here, a {_PROBE_TOKENS}-token prefill of the --model)")
    p.add_argument("--decode-rate", type=float, default=50.0,
                   help="tokens per second a replica decodes, for least-loaded routing (default 50)")
    p.add_argument("--window", metavar="FROM:TO",
                   help="count only the requests that arrive between these minutes of the trace (e.g. 0:30, "
                   "30:); those before FROM still warm the tiers")
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    p.add_argument("--plot", type=Path, metavar="PNG",
                   help="also draw the hit ratio against RAM capacity (one replica; LRU and LRFU, the bound "
                   f"and the offline optimum at {', '.join(str(b) for b in SWEEP_BLOCKS)} blocks)")
    return p


def parse_capacity(text: str, *, kv_bytes_per_token: int, block_tokens: int) -> int:
    """Bytes, from a number of tokens, 'N blocks' or a byte size."""
    m = _CAPACITY.fullmatch(text)
    if m is None:
        raise UsageError(f"capacity {text!r}: expected tokens (4096), blocks ('16000 blocks') or bytes ('8GiB')")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit in ("", "tok", "tokens"):
        return int(number * kv_bytes_per_token)
    if unit in ("block", "blocks"):
        return int(number * block_tokens * kv_bytes_per_token)
    if unit in _UNITS:
        return int(number * _UNITS[unit])
    raise UsageError(f"capacity {text!r}: unknown unit {m.group(2)!r} (tokens, blocks, B, KiB, MiB, GiB, TiB, KB, MB, "
                     "GB, TB)")


def kv_bytes_per_token(model: Path | None) -> int:
    """K and V bytes one token takes at f16 in every attention layer of the model (an estimate for models
    with sliding-window or recurrent layers, which keep less)."""
    from skippy_cache.runtime import default_model_path
    from skippy_cache.runtime.gguf_info import load_header
    from skippy_cache.runtime.startup import StartupError

    path = model or default_model_path()
    try:
        header = load_header(path)
    except StartupError as exc:  # missing, unreadable or not a GGUF file: said in one line
        raise UsageError(str(exc)) from None

    def field(key: str) -> list[int] | None:
        return list(header.integers[key]) if key in header.integers else None

    arch = header.architecture
    if arch is None:
        raise UsageError(f"--model {path}: no general.architecture; pass --kv-bytes-per-token")
    layers = (field(f"{arch}.block_count") or [0])[0]
    heads = (field(f"{arch}.attention.head_count") or [0])[0]
    kv_heads = field(f"{arch}.attention.head_count_kv") or [heads]
    embd = (field(f"{arch}.embedding_length") or [0])[0]
    k_len = (field(f"{arch}.attention.key_length") or [embd // heads if heads else 0])[0]
    v_len = (field(f"{arch}.attention.value_length") or [k_len])[0]
    per_layer = kv_heads if len(kv_heads) == layers else kv_heads[:1] * layers
    total = sum(h * (k_len + v_len) * 2 for h in per_layer)
    if total <= 0:
        raise UsageError(f"--model {path}: cannot tell its KV size from its metadata; pass --kv-bytes-per-token")
    return total


def measure_prefill_rate(model: Path | None) -> float:
    """Prompt tokens per second, the median of three cold prefills of `_PROBE_TOKENS` tokens on this machine."""
    from skippy_cache.runtime import Engine, EngineConfig, GenerationRequest

    engine = Engine(EngineConfig(model_path=model, ctx_size=2 * _PROBE_TOKENS, lanes=1, host_cache_bytes=0))
    try:
        words = engine.tokenize("The quick brown fox jumps over the lazy dog. ", add_special=False)
        tokens = (words * (_PROBE_TOKENS // len(words) + 1))[:_PROBE_TOKENS]
        rates = []
        for _ in range(3):
            done = engine.generate(GenerationRequest(tokens=tokens, max_tokens=1, record=False, lookup=False))
            rates.append(_PROBE_TOKENS / (done.stats.prefill_ms / 1000))
        return statistics.median(rates)
    finally:
        engine.close()


def window(requests: list[TraceRequest], text: str | None) -> tuple[list[TraceRequest], float]:
    """The requests up to the window's end, and the time (ms) from which they count: those before
    it only warm the tiers, as the traffic before them would have."""
    if text is None:
        return requests, 0.0
    start, sep, end = text.partition(":")
    try:
        lo = float(start or 0) * 60_000
        hi = float(end) * 60_000 if end else float("inf")
    except ValueError:
        raise UsageError(f"--window {text!r}: expected FROM:TO in minutes, e.g. 0:30 or 30:") from None
    if not sep or hi <= lo:
        raise UsageError(f"--window {text!r}: expected FROM:TO in minutes with FROM < TO")
    return [r for r in requests if r.timestamp < hi], lo


@dataclass(frozen=True, slots=True)
class Report:
    trace: str
    requests: int
    input_tokens: int
    block_tokens: int
    kv_bytes_per_token: int
    policy: str
    remote_policy: str
    replicas: int
    routing: str
    ram_bytes: int
    disk_bytes: int
    remote_bytes: int
    resident_tokens: int
    #: Share of all prompt tokens served from each tier, and from all.
    hit_ratio: dict[str, float]
    hit_ratio_total: float
    infinite_cache_bound: float
    restored_bytes_per_request: float
    remote_read_bytes_per_request: float
    remote_written_bytes_per_request: float
    prefill_rate_tokens_per_s: float
    prefill_seconds_saved: float
    prefill_seconds_saved_per_request: float
    requests_per_replica: list[int]
    replay_seconds: float


def report(args: argparse.Namespace, config: ReplayConfig, figures: ReplayFigures,
           bound: float, prefill_rate: float, seconds: float) -> Report:
    n = max(figures.requests, 1)
    caps = config.capacities
    return Report(
        trace=str(args.trace), requests=figures.requests, input_tokens=figures.input_tokens,
        block_tokens=config.block_tokens, kv_bytes_per_token=config.kv_bytes_per_token, policy=config.policy.value,
        remote_policy=config.remote_policy.value, replicas=config.replicas, routing=config.routing.value,
        ram_bytes=caps.ram_bytes, disk_bytes=caps.disk_bytes,
        remote_bytes=caps.remote_bytes, resident_tokens=caps.resident_tokens,
        hit_ratio={s.value: round(figures.ratio(s.value), 6) for s in Source if s is not Source.NONE},
        hit_ratio_total=round(figures.ratio(), 6), infinite_cache_bound=round(bound, 6),
        restored_bytes_per_request=figures.restored_bytes / n,
        remote_read_bytes_per_request=figures.remote_read_bytes / n,
        remote_written_bytes_per_request=figures.remote_written_bytes / n,
        prefill_rate_tokens_per_s=round(prefill_rate, 1),
        prefill_seconds_saved=round(figures.total_hit_tokens / prefill_rate, 1),
        prefill_seconds_saved_per_request=round(figures.total_hit_tokens / prefill_rate / n, 3),
        requests_per_replica=figures.per_replica, replay_seconds=round(seconds, 1),
    )


def render(r: Report) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{r.trace}: {r.requests:,} requests, {r.input_tokens:,} prompt tokens "
                  f"({r.replicas} replica{'s' if r.replicas != 1 else ''}, {r.routing}, {r.policy})")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("RAM / disk per replica", f"{_size(r.ram_bytes)} / {_size(r.disk_bytes)}")
    table.add_row("shared tier / resident tokens", f"{_size(r.remote_bytes)} / {r.resident_tokens:,}")
    for tier, ratio in r.hit_ratio.items():
        table.add_row(f"hit ratio from {tier}", f"{100 * ratio:.2f}%")
    table.add_row("hit ratio, all tiers", f"{100 * r.hit_ratio_total:.2f}%")
    table.add_row("infinite-cache bound", f"{100 * r.infinite_cache_bound:.2f}%")
    table.add_row("bytes restored per request", _size(r.restored_bytes_per_request))
    table.add_row("shared tier read / written per request",
                  f"{_size(r.remote_read_bytes_per_request)} / {_size(r.remote_written_bytes_per_request)}")
    table.add_row(f"prefill time saved (at {r.prefill_rate_tokens_per_s:,.0f} tok/s)",
                  f"{r.prefill_seconds_saved:,.1f} s ({r.prefill_seconds_saved_per_request:.3f} s per request)")
    if r.replicas > 1:
        table.add_row("requests per replica", ", ".join(str(x) for x in r.requests_per_replica))
    table.add_row("replayed in", f"{r.replay_seconds:.1f} s")
    Console().print(table)


def _size(nbytes: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def sweep(requests: list[TraceRequest], config: ReplayConfig, *, count_from_ms: float = 0.0) -> dict[str, list[float]]:
    """Hit ratios (%) of one replica's RAM at each of `SWEEP_BLOCKS`, for each policy and the offline optimum."""
    per_block = config.block_tokens * config.kv_bytes_per_token
    curves: dict[str, list[float]] = {}
    for policy in Policy:
        curves[policy.value] = [
            100 * replay(requests, ReplayConfig(Capacities(ram_bytes=b * per_block), config.kv_bytes_per_token,
                                                config.block_tokens, policy), count_from_ms=count_from_ms).ratio()
            for b in SWEEP_BLOCKS]
    curves["offline optimum"] = [100 * belady(requests, config.block_tokens, b * config.block_tokens,
                                              count_from_ms=count_from_ms) for b in SWEEP_BLOCKS]
    return curves


def plot(path: Path, curves: dict[str, list[float]], bound: float, block_tokens: int) -> None:
    """Hit ratio against RAM capacity, one line per curve of `sweep`, with the infinite-cache bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, ys in curves.items():
        ax.plot(SWEEP_BLOCKS, ys, marker="o", label=name, linestyle="--" if name == "offline optimum" else "-")
    ax.axhline(100 * bound, color="grey", linestyle=":", label="infinite cache")
    ax.set_xscale("log")
    ax.set_xlabel(f"RAM capacity (blocks of {block_tokens} tokens)")
    ax.set_ylabel("token hit ratio (%)")
    ax.set_title(path.stem)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.block_tokens <= 0 or args.replicas <= 0:
            raise UsageError("--block-tokens and --replicas must be positive")
        requests, count_from = window(read_trace(args.trace, args.block_tokens), args.window)
        kv = args.kv_bytes_per_token if args.kv_bytes_per_token is not None else kv_bytes_per_token(args.model)
        if kv <= 0:
            raise UsageError("--kv-bytes-per-token must be positive")

        def cap(text: str) -> int:
            return parse_capacity(text, kv_bytes_per_token=kv, block_tokens=args.block_tokens)

        resident = cap(args.resident) // kv
        prefill_rate = args.prefill_rate if args.prefill_rate is not None else measure_prefill_rate(args.model)
        if prefill_rate <= 0 or args.decode_rate <= 0:
            raise UsageError("--prefill-rate and --decode-rate must be positive")
        config = ReplayConfig(Capacities(cap(args.ram), cap(args.disk), cap(args.remote), resident), kv,
                              args.block_tokens, Policy(args.policy), args.replicas, Routing(args.routing),
                              prefill_rate, args.decode_rate, ServerPolicy(args.remote_policy))
    except (UsageError, TraceError) as exc:
        print(f"skippy-cache replay: error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    figures = replay(requests, config, count_from_ms=count_from)
    seconds = time.perf_counter() - t0
    bound = figures.bound()
    result = report(args, config, figures, bound, prefill_rate, seconds)
    out = asdict(result)
    if args.plot is not None:
        curves = sweep(requests, config, count_from_ms=count_from)
        plot(args.plot, curves, bound, config.block_tokens)
        out["plot"] = {"path": str(args.plot), "blocks": list(SWEEP_BLOCKS), "curves": curves}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        render(result)
        if args.plot is not None:
            print(f"plot: {args.plot}")
    return 0
