"""A bench run's summary: the JSON kept in the repository, and the Markdown made from it.

The run's full JSON (every request) stays in `--out`. The summary is what is worth keeping
beside the code: what ran (the command, each server's command, the sizes), where (CPU model,
features, cores, load), with what (versions, the commit), when, and the figures and goals. The
README's figures table and the docs' results page are rendered from the newest summary by
`make docs`, so a figure quoted in prose cannot drift from the run it came from.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from skippy_cache.bench.agent import APIS as AGENT_APIS
from skippy_cache.bench.targets import PEER_KINDS
from skippy_cache.runtime.weightprobe import cpu_fields, cpu_flags

#: Where `skippy-cache bench` writes summaries unless told otherwise (a repository checkout's).
DEFAULT_RESULTS_DIR = Path("benchmarks/results")
#: Bumped when a field the renderers read changes meaning.
SCHEMA = 1
#: CPU features worth naming next to a figure: the ones llama.cpp's kernels (and its crashes) turn on.
_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "asimd", "sve")
_REFERENCE_LABEL = "skippy-cache"


def machine(load_before: Iterable[float], load_after: Iterable[float], cores: int) -> dict[str, Any]:
    """The machine a run measured: CPU model and features, cores used, and the load around it.

    A virtual machine's model name can be as vague as "AMD EPYC"; the family and model numbers
    (x86's `cpu family` and `model`) tell its generation, whose kernels and figures differ."""
    flags = set(cpu_flags())
    fields = cpu_fields()
    return {
        "cpu": fields.get("model name") or platform.processor() or platform.machine(),
        "cpu_family": fields.get("cpu family"),
        "cpu_model": fields.get("model"),
        "arch": platform.machine(),
        "features": [f for f in _FEATURES if f in flags],
        "logical_cpus": os.cpu_count(),
        "cores_used": cores,
        "os": platform.platform(),
        "load": {"before": list(load_before), "after": list(load_after)},
    }


def versions() -> dict[str, Any]:
    """skippy-cache, llama-cpp-python and Python versions, and the commit the run was made from."""
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "skippy_cache": version("skippy-cache"),
        "llama_cpp_python": version("llama-cpp-python"),
        "python": platform.python_version(),
        "commit": _git_commit(),
    }


def _git_commit() -> str | None:
    """The checkout's commit, with "+dirty" when it has uncommitted changes (None outside a checkout)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+dirty" if dirty else head


def summarize(document: dict[str, Any]) -> dict[str, Any]:
    """The part of a run's full JSON worth keeping: everything but the requests and spans."""
    return {
        "schema": SCHEMA,
        "created": document["created"],
        "command": shlex.join(document["command"]),
        "machine": document["machine"],
        "versions": document["versions"],
        "config": document["config"],
        "targets": [{k: t[k] for k in ("label", "kind", "command", "error")} for t in document["targets"]],
        "figures": document["figures"],
        "goals": document["goals"],
        "zero_overhead": document["zero_overhead"],
        "failed_requests": document["failed_requests"],
        "replicas": _replica_setup(document.get("replicas")),
    }


def _replica_setup(part: dict[str, Any] | None) -> dict[str, Any] | None:
    if part is None:
        return None
    configurations = part.get("configurations", [])
    return {"configurations": [{k: c.get(k) for k in ("name", "summary")} for c in configurations]}


def write_summary(results_dir: Path, summary: dict[str, Any]) -> Path:
    """`results_dir/<date>T<time>.json`, named by when the run ended, so the files sort by time."""
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = summary["created"].replace(":", "")
    path = results_dir / f"{stamp}.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    return path


def load_summaries(results_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every summary in `results_dir`, oldest first."""
    found = [(p, json.loads(p.read_text())) for p in sorted(results_dir.glob("*.json"))]
    return sorted(found, key=lambda item: item[1]["created"])


def latest_against_peers(summaries: list[tuple[Path, dict[str, Any]]],
                         workload: str = "chat") -> tuple[Path, dict[str, Any]] | None:
    """The newest summary of a run of `workload` that started a peer server (llama-server,
    llama-cpp-python): the one the README quotes for it (the default workloads' runs by "chat",
    the agent runs by "agent"). A `--url` server does not count: it may be anything, fast mode
    included."""
    for path, summary in reversed(summaries):
        if workload in summary["config"]["workloads"] and any(t["kind"] in PEER_KINDS for t in summary["targets"]):
            return path, summary
    return None


# -- Markdown ---------------------------------------------------------------------------------


def _figure(summary: dict[str, Any], workload: str, name: str) -> dict[str, float | None]:
    figures = summary["figures"]
    return next((f["values"] for f in figures if f["workload"] == workload and f["name"] == name), {})


def _ms(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.1f} ms" if value < 100 else f"{value:,.0f} ms"


def _ratio(value: float | None, reference: float | None) -> str:
    return f" ({value / reference:.2f}x)" if value is not None and reference else ""


def _labels(summary: dict[str, Any]) -> list[str]:
    return [t["label"] for t in summary["targets"]]


def headline_table(summary: dict[str, Any]) -> str:
    """The few figures a newcomer compares, one column per server, ratios against skippy-cache."""
    reference = summary["config"].get("reference") or _REFERENCE_LABEL
    sizes = summary["config"]["sizes"]
    turns = sizes["chat_turns"]
    # (workload and what of it, what the cell says, its figures with their units, how they join, ratios shown).
    rows: list[tuple[str, str, list[tuple[str, str]], str, bool]] = [
        *((f"warm {size:,}", "cold TTFT; warm hit (median)",
           [(f"P={size}: cold TTFT", "ms"), (f"P={size}: warm TTFT median", "ms")], "; ", True)
          for size in sizes["warm_prompt_tokens"]),
        ("tenants", "later rounds TTFT p50; p90",
         [("later rounds: TTFT p50", "ms"), ("later rounds: TTFT p90", "ms")], "; ", True),
        ("tenants", "later rounds cached share; req/s",
         [("later rounds: cached share", "%"), ("requests per second", "req/s")], "; ", True),
        ("chat", "turn 1 TTFT p50", [("turn 1: TTFT p50", "ms")], "", True),
        # Five turns in one cell: ratios would crowd it (the results page has them per turn).
        ("chat", f"turns 2-{turns} TTFT p50, ms",
         [(f"turn {t}: TTFT p50", "") for t in range(2, turns + 1)], " / ", False),
        ("chat", "cached share, all turns", [("all turns: cached share", "%")], "", True),
        ("zero", "TTFT p50; req/s", [("TTFT p50", "ms"), ("requests per second", "req/s")], "; ", True),
        *((f"agent {api}", "step 1 of agents 2+ TTFT p50; steps 2+ TTFT p50; p90",
           [(f"{api}: step 1, agents 2+: TTFT p50", "ms"), (f"{api}: steps 2+: TTFT p50", "ms"),
            (f"{api}: steps 2+: TTFT p90", "ms")], "; ", True) for api in AGENT_APIS),
        *((f"agent {api}", "steps 2+ whole reply p50; cached share, all steps",
           [(f"{api}: steps 2+: whole reply p50", "ms"), (f"{api}: all steps: cached share", "%")], "; ", True)
          for api in AGENT_APIS),
    ]
    workloads = set(summary["config"]["workloads"])
    rows = [row for row in rows if row[0].split()[0] in workloads]
    shown = [label for label in _labels(summary) if any(
        label in _figure(summary, row[0].split()[0], name) for row in rows for name, _ in row[2])]
    lines = ["| workload | figure | " + " | ".join(shown) + " |", "|---|---|" + "---|" * len(shown)]
    for workload, what, cells, sep, ratios in rows:
        rendered = []
        for label in shown:
            parts = [_cell(_figure(summary, workload.split()[0], name), unit, label,
                           reference if ratios and label != reference else None) for name, unit in cells]
            rendered.append(sep.join(parts) if any(parts) else "")
        lines.append(f"| {workload} | {what} | " + " | ".join(rendered) + " |")
    lines.append("| all | failed requests | " + " | ".join(_failed_by_target(summary, shown)) + " |")
    return "\n".join(lines)


def at_a_glance(summary: dict[str, Any]) -> str:
    """One line per peer: how much faster or slower skippy-cache was on the figures users compare."""
    reference = summary["config"].get("reference") or _REFERENCE_LABEL
    sizes = summary["config"]["sizes"]
    size = max(sizes["warm_prompt_tokens"])
    turns = range(2, sizes["chat_turns"] + 1)
    lines = []
    for label in [t["label"] for t in summary["targets"] if t["kind"] in PEER_KINDS]:
        def ratios(workload: str, names: Iterable[str], rate: bool = False) -> list[float]:
            out = []
            for name in names:
                values = _figure(summary, workload, name)
                ours, theirs = values.get(reference), values.get(label)
                if ours and theirs:
                    out.append(ours / theirs if rate else theirs / ours)
            return out

        parts = [
            (f"chat turns 2-{turns[-1]}", ratios("chat", [f"turn {t}: TTFT p50" for t in turns])),
            ("chat turn 1", ratios("chat", ["turn 1: TTFT p50"])),
            (f"a warm {size:,}-token hit", ratios("warm", [f"P={size}: warm TTFT median"])),
            ("tenants' later rounds (p50)", ratios("tenants", ["later rounds: TTFT p50"])),
            (f"a cold {size:,}-token prompt", ratios("warm", [f"P={size}: cold TTFT"])),
        ]
        said = ", ".join(f"{_speed(r)} on {what}" for what, r in parts if r)
        rate = ratios("zero", ["requests per second"], rate=True)
        if said or rate:
            ttft = f"time to first token {said}" if said else ""
            throughput = f"throughput {_speed(rate)} on distinct prompts" if rate else ""
            lines.append(f"- against **{label}**: " + "; ".join(p for p in (ttft, throughput) if p) + ".")
    return "\n".join(lines)


def _speed(ratios: list[float]) -> str:
    """`1.30x faster`, `1.07x slower`, or a range `1.06x to 2.42x faster` (ratio above 1: faster)."""
    def one(r: float) -> str:
        return f"{r:.2f}x faster" if r >= 1 else f"{1 / r:.2f}x slower"

    low, high = min(ratios), max(ratios)
    if len(ratios) == 1 or f"{low:.2f}" == f"{high:.2f}":
        return one(low)
    if low >= 1:
        return f"{low:.2f}x to {high:.2f}x faster"
    if high < 1:
        return f"{1 / high:.2f}x to {1 / low:.2f}x slower"
    return f"from {one(low)} to {one(high)}"


def _cell(values: dict[str, float | None], unit: str, label: str, reference: str | None) -> str:
    """One figure of one target; with its ratio to `reference` when one is given."""
    if label not in values:
        return ""
    value = values[label]
    if value is None:
        return "n/a"
    ratio = _ratio(value, values.get(reference)) if reference else ""
    if unit == "%":
        return f"{value:.1f}%"
    if unit == "req/s":
        return f"{value:.2f}/s{ratio}"
    if unit == "ms":
        return _ms(value) + ratio
    return f"{value:,.0f}"


def _failed_by_target(summary: dict[str, Any], labels: list[str]) -> list[str]:
    counts = {label: 0.0 for label in labels}
    for fig in summary["figures"]:
        if fig["name"] == "failed requests" and fig["workload"] != "replicas":
            for label, value in fig["values"].items():
                if label in counts and value is not None:
                    counts[label] += value
    return [f"{counts[label]:.0f}" for label in labels]


def run_line(summary: dict[str, Any]) -> str:
    """When, where and how a run was made, in one sentence."""
    m, v = summary["machine"], summary["versions"]
    load = m["load"]["before"][0]
    features = ", ".join(m["features"]) or "none of note"
    commit = f", commit {v['commit']}" if v.get("commit") else ""
    family = f"family {m['cpu_family']} model {m['cpu_model']}; " if m.get("cpu_family") else ""
    return (f"Run of {summary['created'].replace('T', ' ')}: `{_short_command(summary['command'])}` on "
            f"{m['cpu']} ({family}{m['arch']}; {features}), {m['cores_used']} cores used, load average "
            f"{load:.2f} at the start; skippy-cache {v['skippy_cache']}{commit}, llama-cpp-python "
            f"{v['llama_cpp_python']}, Python {v['python']}.")


def _short_command(command: str) -> str:
    """The command as a reader would type it: `skippy-cache bench ...`, with no path of this machine."""
    words = [Path(w).name if w.startswith("/") else w for w in shlex.split(command)]
    if words and words[0] in ("__main__.py", "skippy-cache"):
        words[0] = "skippy-cache"
    return shlex.join(words)


def figures_table(summary: dict[str, Any], workload: str) -> str:
    """Every figure of one workload, every target, ratios against the reference where they mean something."""
    figs = [f for f in summary["figures"] if f["workload"] == workload]
    labels = [label for label in (_labels(summary) if workload != "replicas" else
                                  [c["name"] for c in summary["replicas"]["configurations"]])
              if any(label in f["values"] for f in figs)]
    reference = summary["config"].get("reference") or _REFERENCE_LABEL
    lines = ["| figure | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for fig in figs:
        cells = []
        for label in labels:
            if label not in fig["values"]:
                cells.append("")
                continue
            value = fig["values"][label]
            text = "n/a" if value is None else _format(value, fig["unit"])
            if (value is not None and fig["better"] and workload != "replicas" and label != reference):
                text += _ratio(value, fig["values"].get(reference))
            cells.append(text)
        lines.append(f"| {fig['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _format(value: float, unit: str) -> str:
    if unit == "ms":
        return _ms(value)
    if unit == "%":
        return f"{value:.1f}%"
    if unit == "req/s":
        return f"{value:.3f}/s"
    if unit == "tok/s":
        return f"{value:,.0f}/s"
    if unit == "x":
        return f"{value:.4f}"
    return f"{value:,.0f}"


def goals_table(summary: dict[str, Any]) -> str:
    lines = ["| target | want | got | met |", "|---|---|---|---|"]
    for goal in summary["goals"]:
        met = "n/a" if goal["met"] is None else ("yes" if goal["met"] else "**no**")
        lines.append(f"| {goal['name']} | {goal['want']} | {goal['got']} | {met} |")
    return "\n".join(lines)


def targets_list(summary: dict[str, Any]) -> str:
    lines = []
    for target in summary["targets"]:
        command = "(already running)"
        if target["command"]:
            command = f"`{_short_server_command(target['command'])}`"
        error = f" (did not start: {target['error']})" if target["error"] else ""
        lines.append(f"- **{target['label']}**: {command}{error}")
    return "\n".join(lines)


def _short_server_command(command: list[str]) -> str:
    """A server's command without the machine's paths to interpreters, binaries and model files."""
    words = [Path(w).name if w.startswith("/") else w for w in command]
    if words and words[0].startswith("python"):
        words[0] = "python"
    return shlex.join(words)


def results_page(summary: dict[str, Any], path: Path, others: list[Path], level: int = 2) -> str:
    """The docs' results page body for one run (`path`), the other summaries listed by file name;
    its headings at `level` (3 for a run shown under a heading of its own)."""
    h = "#" * level
    parts = [run_line(summary), "", f"Source: `{path.as_posix()}`. Ratio = target / skippy-cache "
             "(below 1: the target is faster on a time, slower on a rate).", "", f"{h} Headline", "",
             headline_table(summary), ""]
    for workload in summary["config"]["workloads"]:
        if any(f["workload"] == workload for f in summary["figures"]):
            parts += [f"{h} {workload}", "", figures_table(summary, workload), ""]
    if summary["goals"]:
        parts += [f"{h} Targets", "", goals_table(summary), ""]
    parts += [f"{h} Servers", "", targets_list(summary), ""]
    if others:
        parts += [f"{h} Other summaries", "", "\n".join(f"- `{p.as_posix()}`" for p in reversed(others)), ""]
    return "\n".join(parts).rstrip() + "\n"
