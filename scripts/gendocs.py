"""Writes the generated parts of the README and the docs; `--check` fails if any is stale.

Each generated part sits between two markers in its file:

    <!-- generated: NAME (make docs) -->
    ...
    <!-- end generated: NAME -->

and is rendered from what it documents: the settings table from `server/settings.py`, the
benchmark figures from the newest summary in `benchmarks/results/`. Hand-written text around the
markers stays as it is. The test suite runs `--check`, so a setting added in code without
`make docs` (or a table edited by hand) fails it.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Callable
from pathlib import Path

from skippy_cache.bench import results
from skippy_cache.server.settings import options_markdown

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / results.DEFAULT_RESULTS_DIR


@functools.cache
def _latest_peer_run(workload: str = "chat") -> tuple[Path, dict, list[Path]]:
    """The newest run of `workload` against a peer; the other summaries (the agent runs' list leaves
    out the default runs, and the other way round, apart from the newest of each)."""
    summaries = results.load_summaries(RESULTS)
    found = results.latest_against_peers(summaries, workload)
    if found is None:
        raise SystemExit(f"no summary of a {workload} run against a peer server in {RESULTS}: "
                         f"run skippy-cache bench --workloads ... --peer ...")
    path, summary = found
    others = [p for p, s in summaries if p != path and workload in s["config"]["workloads"]]
    return path, summary, others


def readme_glance() -> str:
    return results.at_a_glance(_latest_peer_run()[1])


def readme_figures() -> str:
    path, summary, _ = _latest_peer_run()
    return "\n".join([
        results.headline_table(summary),
        "",
        results.run_line(summary) + " Ratio = peer / skippy-cache: on a time, above 1 means the peer "
        "is slower; on a rate (/s), that it is faster. Every figure of the run: "
        "[docs/benchmarks/results.md](docs/benchmarks/results.md).",
    ])


def results_page() -> str:
    path, summary, others = _latest_peer_run()
    return results.results_page(summary, path.relative_to(ROOT), [p.relative_to(ROOT) for p in others])


def readme_agents() -> str:
    path, summary, _ = _latest_peer_run("agent")
    return "\n".join([
        results.headline_table(summary),
        "",
        results.run_line(summary) + " Ratio = peer / skippy-cache: above 1 means the peer is slower. "
        "Every figure of the run: [docs/benchmarks/results.md](docs/benchmarks/results.md#agents).",
    ])


def agent_results() -> str:
    path, summary, others = _latest_peer_run("agent")
    return results.results_page(summary, path.relative_to(ROOT), [p.relative_to(ROOT) for p in others],
                                level=3)


#: (file, part name) -> renderer.
PARTS: dict[tuple[str, str], Callable[[], str]] = {
    ("README.md", "glance"): readme_glance,
    ("README.md", "figures"): readme_figures,
    ("README.md", "agents"): readme_agents,
    ("docs/benchmarks/results.md", "results"): results_page,
    ("docs/benchmarks/results.md", "agents"): agent_results,
    ("docs/serving/settings.md", "settings"): options_markdown,
}


def render(text: str, name: str, body: str, file: str) -> str:
    pattern = re.compile(
        rf"(<!-- generated: {re.escape(name)} \(make docs\) -->\n).*?"
        rf"(<!-- end generated: {re.escape(name)} -->)",
        re.DOTALL,
    )
    if not pattern.search(text):
        raise SystemExit(f"{file}: no markers for the generated part {name!r}")
    return pattern.sub(lambda m: m.group(1) + body.rstrip("\n") + "\n" + m.group(2), text, count=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a part is stale")
    args = parser.parse_args(argv)
    stale = []
    for (file, name), renderer in PARTS.items():
        path = ROOT / file
        text = path.read_text()
        new = render(text, name, renderer(), file)
        if new != text:
            stale.append(f"{file} ({name})")
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"stale generated docs: {', '.join(stale)}; run `make docs`", file=sys.stderr)
        return 1
    print("\n".join(f"wrote {s}" for s in stale) or "generated docs are current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
