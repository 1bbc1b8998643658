"""Open-loop figures: latency and goodput against the offered rate, per workload and server.

Each request is timed from the moment it was sent (TTFT, end to end) and per output token after
the first (TPOT); a rate's point gives their percentiles over the requests that were answered, and
counts the rest: rejected (the server said 429 or 503: it refused work it could not do in time)
and failed (anything else). Goodput is the answered requests that met the SLO per second of the
rate's run; a refused or failed request never counts as good.

A server's saturation rate is the highest offered rate before the first one at which it stopped
keeping up: p99 TTFT above `SATURATION_FACTOR` times its value at the lowest rate, more than 1%
of the requests not answered, or answers coming out slower than `KEPT_UP` times the rate the
requests arrived at (a finite run ends its queue by draining it, so past saturation its p99 is
bounded by the run's length, not by the server).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from skippy_cache.bench.summary import Goal

SATURATION_FACTOR = 10.0
#: The share of requests a rate may lose before it counts as past saturation.
LOST_SHARE = 0.01
#: Answers per second, as a share of arrivals per second, below which a server did not keep up.
KEPT_UP = 0.8
DEFAULT_SLO_TTFT_MS = 2000.0
DEFAULT_SLO_TPOT_MS = 100.0


@dataclass(frozen=True, slots=True)
class OpenRequest:
    """One open-loop request: when it was due and sent (seconds from its rate's start), and its outcome.

    `group` is "cold" for a prefix's first request, "hit" for a later one, "distinct" for the
    zero workload. `sent_s` is later than `due_s` only when a chat turn waited for its previous
    turn's answer (a conversation cannot send turn 3 before it read turn 2).
    """

    workload: str
    target: str
    rate: float
    index: int
    group: str
    due_s: float
    sent_s: float
    ok: bool
    status: str
    ttft_ms: float | None
    total_ms: float
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first; None for a reply of one token."""
        if not self.ok or self.ttft_ms is None or not self.completion_tokens or self.completion_tokens < 2:
            return None
        return (self.total_ms - self.ttft_ms) / (self.completion_tokens - 1)

    @property
    def end_s(self) -> float:
        return self.sent_s + self.total_ms / 1000

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_ms": self.tpot_ms}


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_ms: float = DEFAULT_SLO_TTFT_MS
    tpot_ms: float = DEFAULT_SLO_TPOT_MS

    def met(self, r: OpenRequest) -> bool:
        tpot = r.tpot_ms
        return r.ok and r.ttft_ms is not None and r.ttft_ms <= self.ttft_ms and (tpot is None or tpot <= self.tpot_ms)


@dataclass(frozen=True, slots=True)
class RatePoint:
    """One server's figures at one offered rate."""

    workload: str
    target: str
    rate: float
    #: The rate the requests arrived at: a short Poisson run's differs from the nominal one.
    offered: float
    requests: int
    answered: int
    rejected: int
    failed: int
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    #: TTFT p50 of the requests whose prefix the server had seen ("hit" group).
    hit_ttft_p50: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    e2e_p50: float | None
    #: Wall seconds from the first arrival to the last answer.
    duration_s: float
    throughput: float
    goodput: float
    cached_share: float | None

    @property
    def lost(self) -> int:
        return self.rejected + self.failed

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None of nothing."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def rate_point(requests: list[OpenRequest], slo: SLO) -> RatePoint:
    """The figures of one (workload, target, rate)'s requests."""
    first = requests[0]
    answered = [r for r in requests if r.ok]
    rejected = sum(not r.ok and r.status in ("429", "503") for r in requests)
    ttfts = [r.ttft_ms for r in answered if r.ttft_ms is not None]
    tpots = [t for r in answered if (t := r.tpot_ms) is not None]
    hits = [r.ttft_ms for r in answered if r.group == "hit" and r.ttft_ms is not None]
    start = min(r.due_s for r in requests)
    duration = max(max(r.end_s for r in requests) - start, 1e-9)
    span = max(r.due_s for r in requests) - start
    prompt = sum(r.prompt_tokens or 0 for r in answered)
    cached = sum(r.cached_tokens for r in answered if r.cached_tokens is not None)
    reports = any(r.cached_tokens is not None for r in answered)
    return RatePoint(
        first.workload,
        first.target,
        first.rate,
        (len(requests) - 1) / span if span > 0 else math.inf,
        len(requests),
        len(answered),
        rejected,
        len(requests) - len(answered) - rejected,
        percentile(ttfts, 50),
        percentile(ttfts, 90),
        percentile(ttfts, 99),
        percentile(hits, 50),
        percentile(tpots, 50),
        percentile(tpots, 99),
        percentile([r.total_ms for r in answered], 50),
        duration,
        len(answered) / duration,
        sum(slo.met(r) for r in requests) / duration,
        cached / prompt if reports and prompt else None,
    )


def rate_points(requests: list[OpenRequest], slo: SLO) -> list[RatePoint]:
    """One point per (workload, target, rate), in the order the requests were recorded."""
    groups: dict[tuple[str, str, float], list[OpenRequest]] = {}
    for r in requests:
        groups.setdefault((r.workload, r.target, r.rate), []).append(r)
    return [rate_point(rs, slo) for rs in groups.values()]


def saturation_rate(points: list[RatePoint]) -> tuple[float | None, bool]:
    """(highest rate kept up with, whether some measured rate was past it) for one server's points
    on one workload. (None, True): even the lowest rate was too much."""
    ordered = sorted(points, key=lambda p: p.rate)
    if not ordered:
        return None, False
    base = ordered[0].ttft_p99
    kept = None
    for p in ordered:
        lost = p.lost > LOST_SHARE * p.requests
        slow = p.ttft_p99 is None or (base is not None and p.ttft_p99 > SATURATION_FACTOR * base)
        behind = p.throughput < KEPT_UP * min(p.offered, p.rate)
        if lost or slow or behind:
            return kept, True
        kept = p.rate
    return kept, False


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def render_curves(points: list[RatePoint], labels: list[str], workload: str, slo: SLO) -> Table:
    """One workload's table: a row per rate and server."""
    mine = [p for p in points if p.workload == workload]
    lines = [("ms; arrived = the rate the requests came at; rej = 429/503 answers; "
              "goodput = answered within the SLO per second")]
    for label in labels:
        if any(p.target == label for p in mine):
            kept, past = saturation_rate([p for p in mine if p.target == label])
            said = "none" if kept is None else (f"{kept:g}/s" if past else f">= {kept:g}/s (never passed)")
            best = _best_goodput([p for p in mine if p.target == label])
            lines.append(f"{label}: saturation rate {said}, best goodput {best:.2f}/s")
    table = Table(
        title=f"{workload}: open loop (SLO: TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms)",
        header_style="bold",
        caption="\n".join(lines),
    )
    for col in ("rate/s", "arrived", "server", "ok", "rej", "fail", "TTFT p50", "p90", "p99", "hit p50",
                "TPOT p50", "p99", "cached", "req/s", "goodput"):
        table.add_column(col, justify="left" if col == "server" else "right")
    for rate in sorted({p.rate for p in mine}):
        for label in labels:
            for p in (p for p in mine if p.rate == rate and p.target == label):
                table.add_row(
                    f"{rate:g}", f"{p.offered:.2f}", label, str(p.answered), str(p.rejected), str(p.failed), _ms(p.ttft_p50),
                    _ms(p.ttft_p90), _ms(p.ttft_p99), _ms(p.hit_ttft_p50), _ms(p.tpot_p50), _ms(p.tpot_p99),
                    "-" if p.cached_share is None else f"{p.cached_share:.0%}", f"{p.throughput:.2f}",
                    f"{p.goodput:.2f}",
                )
        table.add_section()
    return table


def write_curves(path: Path, points: list[RatePoint], labels: list[str], workloads: list[str]) -> None:
    """TTFT p50 (solid) and p99 (dashed) against the offered rate, a panel per workload, a color per server.

    Both axes are logarithmic: rates double from point to point, and latencies past saturation
    grow by decades.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display here; must precede pyplot
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    shown = [w for w in workloads if any(p.workload == w for p in points)]
    fig, axes = plt.subplots(1, max(1, len(shown)), figsize=(5.6 * max(1, len(shown)), 4.4), squeeze=False)
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    for ax, workload in zip(axes.flat, shown, strict=False):
        for label in labels:
            mine = sorted((p for p in points if p.workload == workload and p.target == label), key=lambda p: p.rate)
            if not mine:
                continue
            rates = [p.rate for p in mine]
            for attr, style, name in (("ttft_p50", "-", "p50"), ("ttft_p99", "--", "p99")):
                ys = [v if (v := getattr(p, attr)) is not None else math.nan for p in mine]
                ax.plot(rates, ys, style, marker="o", markersize=3, color=colors[label], label=f"{label} {name}")
            lost = [(p.rate, p.ttft_p99) for p in mine if p.lost and p.ttft_p99 is not None]
            if lost:
                ax.scatter(*zip(*lost, strict=True), marker="x", s=50, color=colors[label])
        ax.set_xscale("log")
        ax.set_yscale("log")
        rates = sorted({p.rate for p in points if p.workload == workload})
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("offered rate, requests/s (log)")
        ax.set_ylabel("TTFT, ms (log)")
        ax.set_title(workload)
        ax.grid(which="major", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("skippy-cache bench, open loop: TTFT p50 (solid) and p99 (dashed); x = requests lost", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _best_goodput(points: list[RatePoint]) -> float:
    return max((p.goodput for p in points), default=0.0)


def open_goals(points: list[RatePoint], reference: str, peers: list[str], off: str | None) -> list[Goal]:
    """The open-loop targets, each against the peer that did best on that workload (highest goodput)."""
    checks: list[Goal] = []
    for workload in sorted({p.workload for p in points}):
        mine = {p.rate: p for p in points if p.workload == workload and p.target == reference}
        # A URL target is both the reference and a peer when the bench started no skippy-cache of its own.
        rivals = [label for label in peers
                  if label != reference and any(p.workload == workload and p.target == label for p in points)]
        if not mine or not rivals:
            continue
        theirs_all = {label: [p for p in points if p.workload == workload and p.target == label] for label in rivals}
        peer = max(rivals, key=lambda label: _best_goodput(theirs_all[label]))
        theirs = {p.rate: p for p in theirs_all[peer]}
        peer_kept, _ = saturation_rate(theirs_all[peer])
        our_kept, _ = saturation_rate(list(mine.values()))
        lost = sum(p.lost for p in mine.values())
        checks.append(Goal(f"{workload}: no request lost", "0", str(lost), lost == 0))
        checks.append(Goal(f"{workload}: saturation rate vs {peer}", ">= peer's",
                           f"{_rate(our_kept)} vs {_rate(peer_kept)}", (our_kept or 0) >= (peer_kept or 0)))
        factor = 1.5 if workload == "tenants" else 1.0
        ours, best = _best_goodput(list(mine.values())), _best_goodput(theirs_all[peer])
        checks.append(Goal(f"{workload}: best goodput vs {peer}", f">= {factor:g}x peer's",
                           f"{ours:.2f} vs {best:.2f}/s", ours >= factor * best))
        if workload == "zero":
            if off is not None:
                offs = [p for p in points if p.workload == workload and p.target == off]
                top = max((p.throughput for p in mine.values()), default=0.0)
                top_off = max((p.throughput for p in offs), default=0.0)
                cost = 100 * (1 - top / top_off) if top_off else None
                checks.append(Goal("zero: the cache's cost in peak throughput", "<= 3%",
                                   "-" if cost is None else f"{cost:.1f}%", None if cost is None else cost <= 3))
            continue
        shared = sorted(r for r in mine if r in theirs and (peer_kept is None or r <= peer_kept))
        tails = [(r, mine[r].ttft_p99, theirs[r].ttft_p99) for r in shared]
        worse = [f"{r:g}/s {a:,.0f} vs {b:,.0f}" for r, a, b in tails if a is not None and b is not None and a > b]
        checks.append(Goal(f"{workload}: TTFT p99 up to the peer's saturation", f"<= {peer}'s at every rate",
                           "; ".join(worse) or f"held at {len(tails)} rates", not worse if tails else None))
        halves = [(r, mine[r].hit_ttft_p50, theirs[r].hit_ttft_p50) for r in shared]
        over = [f"{r:g}/s {a:,.0f} vs {b:,.0f}" for r, a, b in halves if a is not None and b is not None and a > b / 2]
        checks.append(Goal(f"{workload}: hit TTFT p50 up to the peer's saturation", f"<= 1/2 {peer}'s",
                           "; ".join(over) or f"held at {len(halves)} rates", not over if halves else None))
    return checks


def _rate(r: float | None) -> str:
    return "none" if r is None else f"{r:g}/s"
