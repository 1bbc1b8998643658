"""Figures from raw measurements: the rows of the report's table, one value per target (for the
replicas workload, one per configuration).

A figure over failed requests uses only the successful ones; the failures get their own row
per workload, so a fast-looking figure built on few successes is visible as such. A value is
None where nothing was measured (every request failed, or the server reports no usage).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from skippy_cache.bench.agent import APIS as AGENT_APIS
from skippy_cache.bench.run import AGENT, REPLICAS, TRACE, Measurement, Sizes, Span
from skippy_cache.bench.targets import LLAMA_SERVER


@dataclass(frozen=True, slots=True)
class Figure:
    """One table row. `better`: "lower", "higher", or "" (no direction: the ratio is not shown)."""

    workload: str
    name: str
    unit: str
    better: str
    values: dict[str, float | None]

    def to_json(self) -> dict[str, object]:
        return {
            "workload": self.workload,
            "name": self.name,
            "unit": self.unit,
            "better": self.better,
            "values": self.values,
        }


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ttfts(ms: list[Measurement]) -> list[float]:
    return [m.ttft_ms for m in ms if m.ok and m.ttft_ms is not None]


def _totals(ms: list[Measurement]) -> list[float]:
    return [m.total_ms for m in ms if m.ok]


def _cached_share(ms: list[Measurement]) -> float | None:
    """Cached prompt tokens over prompt tokens, in percent, over requests that report both."""
    pairs = [
        (m.cached_tokens, m.prompt_tokens)
        for m in ms
        if m.ok and m.cached_tokens is not None and m.prompt_tokens
    ]
    if not pairs:
        return None
    return 100.0 * sum(c for c, _ in pairs) / sum(p for _, p in pairs)


def _mean_prompt(ms: list[Measurement]) -> float | None:
    counts = [m.prompt_tokens for m in ms if m.ok and m.prompt_tokens]
    return statistics.fmean(counts) if counts else None


Row = tuple[str, str, str, float | None]  # (name, unit, better, value)


def _group(ms: list[Measurement], group: str) -> list[Measurement]:
    return [m for m in ms if m.group == group]


def _rows(workload: str, ms: list[Measurement], spans: list[Span], sizes: Sizes) -> list[Row]:
    """One target's figures for one workload, in table order (the same order for every target)."""
    rows: list[Row] = []
    if workload == "warm":
        for size in sizes.warm_prompt_tokens:
            cold, hot = _ttfts(_group(ms, f"P={size} cold")), _ttfts(_group(ms, f"P={size} warm"))
            rows += [
                (f"P={size}: prompt tokens", "tok", "", _mean_prompt(_group(ms, f"P={size} cold"))),
                (f"P={size}: cold TTFT", "ms", "lower", percentile(cold, 50)),
                (f"P={size}: warm TTFT median", "ms", "lower", percentile(hot, 50)),
                (f"P={size}: warm TTFT min", "ms", "lower", percentile(hot, 0)),
                (f"P={size}: warm TTFT max", "ms", "lower", percentile(hot, 100)),
                (
                    f"P={size}: warm median / cold",
                    "x",
                    "lower",
                    _over(percentile(hot, 50), percentile(cold, 50)),
                ),
                (f"P={size}: warm cached share", "%", "higher", _cached_share(_group(ms, f"P={size} warm"))),
            ]
    elif workload == "tenants":
        for group in ("round 1", "later rounds"):
            ttfts = _ttfts(_group(ms, group))
            rows += [(f"{group}: TTFT p{q}", "ms", "lower", percentile(ttfts, q)) for q in (50, 90)]
        rows += [
            ("later rounds: cached share", "%", "higher", _cached_share(_group(ms, "later rounds"))),
            ("requests per second", "req/s", "higher", _rate(spans, ms, "tenants")),
        ]
    elif workload == "chat":
        for turn in range(1, sizes.chat_turns + 1):
            group = _group(ms, f"turn {turn}")
            rows += [
                (f"turn {turn}: TTFT p50", "ms", "lower", percentile(_ttfts(group), 50)),
                (f"turn {turn}: cached share", "%", "higher", _cached_share(group)),
            ]
        rows += [
            ("all turns: cached share", "%", "higher", _cached_share(ms)),
            # What a busy machine costs shows here first: every turn's prefill and every reply token.
            ("all turns: wall time", "s", "lower", _wall_s(spans, "chat", ms[0].target) if ms else None),
        ]
    elif workload == AGENT:
        rows += _agent_rows(ms, sizes)
    elif workload == TRACE:
        ttfts = _ttfts(ms)
        rows += [
            ("prompt tokens", "tok", "", _mean_prompt(ms)),
            ("TTFT p50", "ms", "lower", percentile(ttfts, 50)),
            ("TTFT p90", "ms", "lower", percentile(ttfts, 90)),
            ("cached share", "%", "higher", _cached_share(ms)),
        ]
    elif workload == "zero":
        rows += [
            ("TTFT p50", "ms", "lower", percentile(_ttfts(ms), 50)),
            ("TTFT p90", "ms", "lower", percentile(_ttfts(ms), 90)),
            ("requests per second", "req/s", "higher", _rate(spans, ms, "zero")),
            ("prompt tokens per second", "tok/s", "higher", _token_rate(spans, ms)),
        ]
    rows.append(("failed requests", "count", "", float(sum(not m.ok for m in ms))))
    return rows


def _agent_rows(ms: list[Measurement], sizes: Sizes) -> list[Row]:
    """Per API: the first step alone and of the agents that follow, then each later step's TTFT
    p50 and p90, all later steps pooled, and the cached shares."""
    rows: list[Row] = []
    for api in AGENT_APIS:
        first, others = _group(ms, f"{api} step 1, agent 1"), _group(ms, f"{api} step 1, agents 2+")
        later = [m for step in range(2, sizes.agent_steps + 1) for m in _group(ms, f"{api} step {step}")]
        rows += [
            (f"{api}: step 1, agent 1: TTFT", "ms", "lower", percentile(_ttfts(first), 50)),
            (f"{api}: step 1, agents 2+: TTFT p50", "ms", "lower", percentile(_ttfts(others), 50)),
            (f"{api}: steps 2+: TTFT p50", "ms", "lower", percentile(_ttfts(later), 50)),
            (f"{api}: steps 2+: TTFT p90", "ms", "lower", percentile(_ttfts(later), 90)),
            # What an agent waits for: it can act once the whole call is in.
            (f"{api}: steps 2+: whole reply p50", "ms", "lower", percentile(_totals(later), 50)),
        ]
        for step in range(2, sizes.agent_steps + 1):
            ttfts = _ttfts(_group(ms, f"{api} step {step}"))
            rows += [(f"{api}: step {step}: TTFT p{q}", "ms", "lower", percentile(ttfts, q)) for q in (50, 90)]
        rows += [
            (f"{api}: steps 2+: cached share", "%", "higher", _cached_share(later)),
            (f"{api}: all steps: cached share", "%", "higher", _cached_share([*first, *others, *later])),
        ]
    return rows


def figures(
    measurements: list[Measurement],
    spans: list[Span],
    labels: list[str],
    sizes: Sizes,
    workloads: Sequence[str],
    *,
    predicted: Mapping[str, float] | None = None,
) -> list[Figure]:
    """Every workload's figures; a target that took no part in a workload is left out of its rows.
    `predicted`: the trace workload's cached share as `skippy-cache replay` predicts it, per target."""
    out: list[Figure] = []
    for workload in workloads:
        per_target = {
            label: [m for m in measurements if m.workload == workload and m.target == label]
            for label in labels
        }
        rows = {label: _rows(workload, ms, spans, sizes) for label, ms in per_target.items() if ms}
        if not rows:
            continue
        first = next(iter(rows.values()))
        for i, (name, unit, better, _) in enumerate(first):
            out.append(Figure(workload, name, unit, better, {label: r[i][3] for label, r in rows.items()}))
        if workload == TRACE and predicted:
            out.append(Figure(workload, "cached share, as the replay predicts", "%", "", dict(predicted)))
    return out


def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _wall_s(spans: list[Span], workload: str, label: str) -> float:
    return sum(s.wall_ms for s in spans if s.workload == workload and s.target == label) / 1000


def _rate(spans: list[Span], ms: list[Measurement], workload: str) -> float | None:
    """Successful requests per second of wall time (failures do not count as served)."""
    served = sum(m.ok for m in ms)
    if not served:
        return None  # nothing served: "n/a", not a rate of zero that reads like a slow server
    wall = _wall_s(spans, workload, ms[0].target)
    return served / wall if wall > 0 else None


def _token_rate(spans: list[Span], ms: list[Measurement]) -> float | None:
    if not any(m.ok for m in ms) or any(m.ok and m.prompt_tokens is None for m in ms):
        return None  # no usage from this server: a partial sum would understate it
    wall = _wall_s(spans, ms[0].workload, ms[0].target)
    return sum(m.prompt_tokens or 0 for m in ms if m.ok) / wall if wall > 0 else None


def overheads(figs: list[Figure], on: str, off: str) -> dict[str, float | None]:
    """The cache's cost on the zero workload, in percent: throughput lost and TTFT p50 added."""

    def value(name: str, label: str) -> float | None:
        return next((f.values.get(label) for f in figs if f.workload == "zero" and f.name == name), None)

    rate_on, rate_off = value("requests per second", on), value("requests per second", off)
    ttft_on, ttft_off = value("TTFT p50", on), value("TTFT p50", off)
    return {
        "throughput_loss_pct": 100 * (1 - rate_on / rate_off) if rate_on and rate_off else None,
        "ttft_p50_overhead_pct": 100 * (ttft_on / ttft_off - 1) if ttft_on and ttft_off else None,
    }


@dataclass(frozen=True, slots=True)
class Goal:
    """One goal a run is checked against: `met` None where a side of it was not measured."""

    name: str
    want: str
    got: str
    met: bool | None

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "want": self.want, "got": self.got, "met": self.met}


def goals(figs: list[Figure], sizes: Sizes, reference: str, off: str | None, peers: list[str]) -> list[Goal]:
    """The goals against the reference and the peers, checked on this run's figures (the largest warm prompt)."""

    def value(workload: str, name: str, label: str) -> float | None:
        return next((f.values.get(label) for f in figs if f.workload == workload and f.name == name), None)

    out: list[Goal] = []
    size = max(sizes.warm_prompt_tokens)
    cold, hot = (
        value("warm", f"P={size}: cold TTFT", reference),
        value("warm", f"P={size}: warm TTFT median", reference),
    )
    if cold is not None or hot is not None:
        ok = hot / cold <= 1 / 50 if hot is not None and cold else None
        got = f"{hot:.1f} / {cold:.1f} ms = 1/{cold / hot:.0f}" if hot and cold else "n/a"
        out.append(Goal(f"warm P={size}: warm hit vs cold", "<= 1/50", got, ok))
        peer_hits = [v for p in peers
                     if p != reference and (v := value("warm", f"P={size}: warm TTFT median", p)) is not None]
        if peer_hits and hot is not None:
            best = min(peer_hits)
            out.append(
                Goal(f"warm P={size}: warm hit vs fastest peer", "<= 1x", f"{hot / best:.2f}x", hot <= best)
            )
    later = value("tenants", "later rounds: TTFT p50", reference)
    lcp = value("tenants", "later rounds: TTFT p50", "llama-cpp-python")
    if later is not None and lcp:
        out.append(
            Goal(
                "tenants: later-round p50 vs llama-cpp-python",
                "<= 1/10",
                f"{later:.1f} / {lcp:.1f} ms = 1/{lcp / later:.1f}",
                later <= lcp / 10,
            )
        )
    if off is not None:
        loss = overheads(figs, reference, off)["throughput_loss_pct"]
        if loss is not None:
            out.append(Goal("zero: throughput lost to the cache", "<= 3%", f"{loss:+.1f}%", loss <= 3))
    live = value(TRACE, "cached share", reference)
    predicted = value(TRACE, "cached share, as the replay predicts", reference)
    if live is not None and predicted is not None:
        out.append(Goal("trace: live cached share vs the replay's", "within 5 points",
                        f"{live:.1f}% vs {predicted:.1f}%", abs(live - predicted) <= 5))
    if LLAMA_SERVER in peers:
        out += _against_llama_server(value, sizes, reference)
    return out


def _against_llama_server(
    value: Callable[[str, str, str], float | None], sizes: Sizes, reference: str
) -> list[Goal]:
    """Where users compare us with llama-server: at most its TTFT (half of it on hits), at least its throughput."""
    out: list[Goal] = []

    def compare(workload: str, name: str, want: float, what: str, higher: bool = False) -> None:
        ours, theirs = value(workload, name, reference), value(workload, name, LLAMA_SERVER)
        if ours is None or theirs is None or theirs == 0:
            return
        ratio = ours / theirs
        if higher:
            out.append(Goal(f"{what} vs llama-server", f">= {want:g}x", f"{ratio:.2f}x", ratio >= want))
        else:
            out.append(Goal(f"{what} vs llama-server", f"<= {want:g}x", f"{ratio:.2f}x", ratio <= want))

    for turn in range(1, sizes.chat_turns + 1):
        compare("chat", f"turn {turn}: TTFT p50", 1.0 if turn == 1 else 0.5, f"chat turn {turn} TTFT p50")
    compare("chat", "all turns: cached share", 1.0, "chat cached share", higher=True)
    size = max(sizes.warm_prompt_tokens)
    compare("warm", f"P={size}: cold TTFT", 1.0, f"warm P={size} cold TTFT")
    compare("warm", f"P={size}: warm TTFT median", 0.5, f"warm P={size} warm hit")
    compare("tenants", "later rounds: TTFT p50", 0.5, "tenants later-round p50")
    compare("tenants", "later rounds: TTFT p90", 0.5, "tenants later-round p90")
    compare("zero", "requests per second", 1.0, "zero throughput", higher=True)
    for api in AGENT_APIS:
        compare(AGENT, f"{api}: step 1, agents 2+: TTFT p50", 0.5, f"agent {api} step 1 of agents 2+ p50")
        compare(AGENT, f"{api}: steps 2+: TTFT p50", 0.75, f"agent {api} steps 2+ p50")
        compare(AGENT, f"{api}: steps 2+: TTFT p90", 1.0, f"agent {api} steps 2+ p90")
        compare(AGENT, f"{api}: all steps: cached share", 1.0, f"agent {api} cached share", higher=True)
    return out


#: The replicas workload's two kinds of traffic: (group prefix, first group, name of the rest).
_REPLICA_TRAFFIC = (("tenants", "round 1", "later rounds"), ("chat", "turn 1", "later turns"))
#: The replicas workload's goals: later-round TTFT p50 with the shared tier at most this many
#: times the single server's, and replicas without it at least this many times slower.
SHARED_VS_SINGLE = 1.5
ALONE_VS_SHARED = 5.0


def _from_remote(ms: list[Measurement]) -> float | None:
    """Requests whose reused state came from the shared tier, in percent of those that say where."""
    said = [m for m in ms if m.ok and m.cache_source is not None]
    return 100.0 * sum(m.cache_source == "remote" for m in said) / len(said) if said else None


def _later(ms: list[Measurement], traffic: str, first: str) -> list[Measurement]:
    """The requests of `traffic` after its first round (tenants) or turn (chat)."""
    return [m for m in ms if m.group.startswith(f"{traffic}: ") and m.group != f"{traffic}: {first}"]


def _replica_rows(ms: list[Measurement]) -> list[Row]:
    """One configuration's figures: per traffic, the first round's p50, then the later rounds'."""
    rows: list[Row] = []
    for traffic, first, rest in _REPLICA_TRAFFIC:
        later = _later(ms, traffic, first)
        opening = _ttfts(_group(ms, f"{traffic}: {first}"))
        rows += [
            (f"{traffic} {first}: TTFT p50", "ms", "lower", percentile(opening, 50)),
            (f"{traffic} {rest}: TTFT p50", "ms", "lower", percentile(_ttfts(later), 50)),
            (f"{traffic} {rest}: TTFT p90", "ms", "lower", percentile(_ttfts(later), 90)),
            (f"{traffic} {rest}: cached share", "%", "higher", _cached_share(later)),
            (f"{traffic} {rest}: served from the shared tier", "%", "", _from_remote(later)),
        ]
    rows.append(("failed requests", "count", "", float(sum(not m.ok for m in ms))))
    return rows


def replica_figures(measurements: list[Measurement], configurations: list[str]) -> list[Figure]:
    """The replicas workload's rows, one value per configuration (its measurements' `target`)."""
    rows = {
        name: _replica_rows([m for m in measurements if m.workload == REPLICAS and m.target == name])
        for name in configurations
    }
    if not rows:
        return []
    first = next(iter(rows.values()))
    return [
        Figure(REPLICAS, name, unit, better, {c: r[i][3] for c, r in rows.items()})
        for i, (name, unit, better, _) in enumerate(first)
    ]


def replica_goals(figs: list[Figure], shared: str, alone: str, single: str) -> list[Goal]:
    """The goals for replicas sharing a tier, on later-round TTFT p50 of each traffic."""
    out: list[Goal] = []
    for traffic, _, rest in _REPLICA_TRAFFIC:
        row = f"{traffic} {rest}: TTFT p50"
        values = next((f.values for f in figs if f.workload == REPLICAS and f.name == row), {})
        with_tier, without, one = values.get(shared), values.get(alone), values.get(single)
        if with_tier and one:
            ratio = with_tier / one
            got = f"{with_tier:.0f} / {one:.0f} ms = {ratio:.2f}x"
            name = f"replicas {traffic}: later p50, {shared} vs {single}"
            out.append(Goal(name, f"<= {SHARED_VS_SINGLE:g}x", got, ratio <= SHARED_VS_SINGLE))
        if with_tier and without:
            ratio = without / with_tier
            got = f"{without:.0f} / {with_tier:.0f} ms = {ratio:.2f}x"
            name = f"replicas {traffic}: later p50, {alone} vs {shared}"
            out.append(Goal(name, f">= {ALONE_VS_SHARED:g}x", got, ratio >= ALONE_VS_SHARED))
    return out
