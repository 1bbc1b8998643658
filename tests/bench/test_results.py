"""The bench's summary files and the Markdown rendered from them (pure: no server, no model)."""

from __future__ import annotations

import json
from pathlib import Path

from skippy_cache.bench.results import (
    at_a_glance,
    headline_table,
    latest_against_peers,
    load_summaries,
    machine,
    results_page,
    write_summary,
)


def _summary(created: str, peers: tuple[str, ...] = ("llama-server",)) -> dict:
    labels = ("skippy-cache", *peers)
    values = {label: 100.0 * (i + 1) for i, label in enumerate(labels)}
    sizes = {"warm_prompt_tokens": [128], "chat_turns": 3}
    figures = [
        {"workload": "warm", "name": "P=128: cold TTFT", "unit": "ms", "better": "lower", "values": values},
        {"workload": "warm", "name": "P=128: warm TTFT median", "unit": "ms", "better": "lower",
         "values": {label: 2.5 for label in labels}},
        {"workload": "warm", "name": "failed requests", "unit": "count", "better": "",
         "values": {label: float(i) for i, label in enumerate(labels)}},
        *({"workload": "chat", "name": f"turn {t}: TTFT p50", "unit": "ms", "better": "lower",
           "values": {label: 1000.0 + t for label in labels}} for t in (1, 2, 3)),
        {"workload": "chat", "name": "all turns: cached share", "unit": "%", "better": "higher",
         "values": {"skippy-cache": 78.41, **{p: None for p in peers}}},
    ]
    return {
        "schema": 1, "created": created,
        "command": "/x/src/skippy_cache/__main__.py bench --peer llama-server --llama-server /opt/llama-server",
        "machine": {"cpu": "AMD EPYC", "arch": "x86_64", "features": ["avx2", "avx512f"], "logical_cpus": 2,
                    "cores_used": 2, "os": "Linux", "load": {"before": [0.12, 0, 0], "after": [1, 1, 1]}},
        "versions": {"skippy_cache": "0.1.0", "llama_cpp_python": "0.3.36", "python": "3.11.7",
                     "commit": "abc"},
        "config": {"workloads": ["warm", "chat"], "sizes": sizes, "reference": "skippy-cache"},
        "targets": [{"label": label, "kind": label,
                     "command": ["/usr/bin/python3", "-m", "x", "/m/model.gguf"],
                     "error": None} for label in labels],
        "figures": figures, "goals": [{"name": "g", "want": "<= 1x", "got": "0.5x", "met": True}],
        "zero_overhead": None, "failed_requests": 1, "replicas": None,
    }


def test_headline_table_puts_servers_side_by_side_with_ratios() -> None:
    lines = headline_table(_summary("2026-12-05T01:00:00")).splitlines()
    assert lines[0] == "| workload | figure | skippy-cache | llama-server |"
    assert lines[2] == ("| warm 128 | cold TTFT; warm hit (median) | 100 ms; 2.5 ms "
                        "| 200 ms (2.00x); 2.5 ms (1.00x) |")
    assert "| chat | turns 2-3 TTFT p50, ms | 1,002 / 1,003 | 1,002 / 1,003 |" in lines
    # A figure the peer does not report is n/a, not a zero; failures are summed over workloads.
    assert "| chat | cached share, all turns | 78.4% | n/a |" in lines
    assert lines[-1] == "| all | failed requests | 0 | 1 |"
    # Workloads the run left out have no rows.
    assert not any(line.startswith(("| tenants", "| zero")) for line in lines)


def test_results_page_names_command_machine_and_versions_without_local_paths() -> None:
    page = results_page(_summary("2026-12-05T01:00:00"), Path("benchmarks/results/a.json"), [Path("b.json")])
    assert "`skippy-cache bench --peer llama-server --llama-server llama-server`" in page
    assert "/x/src" not in page
    assert "AMD EPYC (x86_64; avx2, avx512f), 2 cores used, load average 0.12" in page
    assert "llama-cpp-python 0.3.36" in page and "commit abc" in page
    assert "`python -m x model.gguf`" in page and "/m/model.gguf" not in page
    assert "## warm" in page and "## chat" in page and "- `b.json`" in page


def test_the_quoted_run_is_the_newest_against_a_peer(tmp_path: Path) -> None:
    write_summary(tmp_path, _summary("2026-12-05T01:00:00"))
    write_summary(tmp_path, _summary("2026-12-05T03:00:00", peers=()))  # skippy-cache alone
    write_summary(tmp_path, _summary("2026-12-04T23:00:00"))
    found = load_summaries(tmp_path)
    assert [s["created"] for _, s in found] == sorted(s["created"] for _, s in found)
    path, newest = latest_against_peers(found)
    assert newest["created"] == "2026-12-05T01:00:00" and path.name == "2026-12-05T010000.json"
    assert latest_against_peers(found[-1:]) is None  # skippy-cache alone is no comparison
    assert json.loads(path.read_text()) == newest


def test_at_a_glance_says_faster_or_slower_per_peer() -> None:
    summary = _summary("2026-12-05T01:00:00", peers=("llama-server", "llama-cpp-python"))
    for fig in summary["figures"]:
        if fig["name"] == "turn 2: TTFT p50":
            fig["values"]["llama-server"] = 501.0  # skippy-cache 1,002 ms: half of the peer's time
    lines = at_a_glance(summary).splitlines()
    assert lines == [
        "- against **llama-server**: time to first token from 2.00x slower to 1.00x faster on chat turns "
        "2-3, 1.00x faster on chat turn 1, 1.00x faster on a warm 128-token hit, 2.00x faster on a cold "
        "128-token prompt.",
        "- against **llama-cpp-python**: time to first token 1.00x faster on chat turns 2-3, 1.00x faster on "
        "chat turn 1, 1.00x faster on a warm 128-token hit, 3.00x faster on a cold 128-token prompt.",
    ]


def test_the_machine_line_names_the_cpu_family_and_model_when_recorded() -> None:
    # A virtual machine reports "AMD EPYC" alone; family 25 model 17 (Zen 4) and family 26 (Zen 5)
    # differ in kernels and speed, so a run says which it was. Summaries written before lack them.
    summary = _summary("2026-12-05T01:00:00")
    summary["machine"] |= {"cpu_family": "25", "cpu_model": "17"}
    page = results_page(summary, Path("benchmarks/results/a.json"), [])
    assert "AMD EPYC (family 25 model 17; x86_64; avx2, avx512f), 2 cores used" in page
    recorded = machine([0.0] * 3, [0.0] * 3, 2)
    if recorded["arch"] == "x86_64":
        assert recorded["cpu_family"] and recorded["cpu_model"]
