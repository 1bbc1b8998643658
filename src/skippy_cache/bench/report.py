"""The run's outputs: a rich table (each figure, and its ratio against the reference target),
a JSON file of every measurement, and a PNG chart of TTFT per workload and target."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from skippy_cache.bench.summary import ALONE_VS_SHARED, SHARED_VS_SINGLE, Figure

_FORMATS = {
    "ms": "{:.1f} ms",
    "s": "{:.1f} s",
    "req/s": "{:.2f}/s",
    "tok/s": "{:.0f}/s",
    "%": "{:.0f}%",
    "x": "{:.3f}",
    "count": "{:.0f}",
    "tok": "{:.0f}",
}


def _cell(fig: Figure, label: str, reference: str) -> Text:
    value = fig.values.get(label)
    if value is None:
        return Text("n/a" if label in fig.values else "-", style="dim")
    text = Text(_FORMATS.get(fig.unit, "{:g}").format(value))
    if fig.unit == "count":
        text.stylize("bold red" if value > 0 else "green")
        return text
    ref = fig.values.get(reference)
    if fig.better and label != reference and ref:
        ratio = value / ref
        good = ratio <= 1 if fig.better == "lower" else ratio >= 1
        # From the reference's side: red where the other target beats skippy-cache.
        text.append(f"  {ratio:.2f}x", style="red" if good and abs(ratio - 1) > 0.05 else "cyan")
    return text


def render_table(figs: list[Figure], labels: list[str], reference: str, title: str) -> Table:
    table = Table(
        title=title,
        caption=f"ratio = target / {reference}; n/a = not measured or not reported",
        show_lines=False,
        header_style="bold",
    )
    table.add_column("workload", style="bold")
    table.add_column("figure")
    for label in labels:
        table.add_column(label, justify="right")
    last = None
    for fig in figs:
        if last is not None and fig.workload != last:
            table.add_section()
        table.add_row(
            fig.workload if fig.workload != last else "",
            fig.name,
            *(_cell(fig, label, reference) for label in labels),
        )
        last = fig.workload
    return table


def _value(fig: Figure, label: str) -> Text:
    """A figure's value for one column, without a ratio."""
    value = fig.values.get(label)
    if value is None:
        return Text("n/a", style="dim")
    text = Text(_FORMATS.get(fig.unit, "{:g}").format(value))
    if fig.unit == "count":
        text.stylize("bold red" if value > 0 else "green")
    return text


def _ratio(fig: Figure, top: str, bottom: str) -> Text:
    """top / bottom for TTFT rows (where the replicas goals are ratios), blank for the others."""
    a, b = fig.values.get(top), fig.values.get(bottom)
    if fig.unit != "ms" or a is None or not b:
        return Text("")
    return Text(f"{a / b:.2f}x")


def render_replicas_table(
    figs: list[Figure], headers: dict[str, str], shared: str, alone: str, single: str, title: str
) -> Table:
    """The replicas workload: its configurations side by side, then the two ratios its goals are on."""
    caption = (
        f"goals on later-round TTFT p50: {shared} / {single} <= {SHARED_VS_SINGLE:g}x, "
        f"{alone} / {shared} >= {ALONE_VS_SHARED:g}x"
    )
    table = Table(title=title, caption=caption, header_style="bold")
    table.add_column("figure")
    for label in (shared, alone, single):
        table.add_column(headers.get(label, label), justify="right")
    table.add_column(f"{shared} / {single}", justify="right")
    table.add_column(f"{alone} / {shared}", justify="right")
    for fig in figs:
        table.add_row(
            fig.name,
            *(_value(fig, label) for label in (shared, alone, single)),
            _ratio(fig, shared, single),
            _ratio(fig, alone, shared),
        )
    return table


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1, default=str) + "\n")


def _chart_figures(figs: list[Figure], workload: str) -> list[Figure]:
    """The TTFT rows worth a bar: central tendencies and tails, not the warm min/max."""
    return [
        f for f in figs if f.workload == workload and f.unit == "ms" and not f.name.endswith(("min", "max"))
    ]


def write_chart(path: Path, figs: list[Figure], labels: list[str], workloads: list[str]) -> None:
    """One panel per workload, bars grouped by figure, one color per target across panels.

    The y axis is logarithmic (a warm hit is milliseconds, a cold 2,000-token prompt seconds)
    and starts at the decade below the smallest bar, so bar heights compare by decades; each
    bar carries its value.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display here; must precede pyplot
    import matplotlib.pyplot as plt

    shown = [w for w in workloads if _chart_figures(figs, w)]
    cols = 2 if len(shown) > 1 else 1
    rows = max(1, math.ceil(len(shown) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 4.6 * rows), squeeze=False)
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    for ax, workload in zip(axes.flat, shown, strict=False):
        bars = _chart_figures(figs, workload)
        present = [label for label in labels if any(f.values.get(label) for f in bars)]
        width = 0.8 / max(1, len(present))
        values = [v for f in bars for label in present if (v := f.values.get(label))]
        for i, label in enumerate(present):
            xs = [j + (i - (len(present) - 1) / 2) * width for j in range(len(bars))]
            ys = [v if (v := f.values.get(label)) else math.nan for f in bars]  # nan: no bar
            drawn = ax.bar(xs, ys, width, color=colors[label], label=label)
            ax.bar_label(
                drawn,
                labels=["" if math.isnan(y) else f"{y:.0f}" if y >= 10 else f"{y:.1f}" for y in ys],
                fontsize=6,
                rotation=90,
                padding=2,
            )
        ax.set_xticks(range(len(bars)))
        ax.set_xticklabels(
            [f.name.replace(": TTFT", "").replace("TTFT ", "") for f in bars],
            rotation=25,
            ha="right",
            fontsize=8,
        )
        ax.set_yscale("log")
        if values:
            ax.set_ylim(10 ** math.floor(math.log10(min(values))), 10 ** (math.log10(max(values)) + 0.35))
        ax.set_ylabel("TTFT, ms (log)")
        ax.set_title(workload)
        ax.grid(axis="y", which="major", alpha=0.3)
    for ax in list(axes.flat)[len(shown) :]:
        ax.set_visible(False)
    measured = {label for f in figs if f.unit == "ms" for label, v in f.values.items() if v}
    handles = [
        matplotlib.patches.Patch(
            color=colors[label], label=label if label in measured else f"{label} (no data)"
        )
        for label in labels
    ]
    fig.suptitle("skippy-cache bench: time to first token per workload and target", y=0.99, fontsize=11)
    fig.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.955),
        ncol=min(len(labels), 5),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
