"""`skippy-cache bench` end to end on tiny sizes: one live skippy-cache server (a subprocess, as
users run it) and one target on a closed port. Behaviour only: every workload is in the JSON,
the dead target's requests are counted as failures while the run completes, the PNG is written.
No timing is asserted: the machine is shared.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from skippy_cache.bench import WORKLOADS, BenchConfig, Sizes, TargetSpec, bench, parse_url_option
from skippy_cache.bench.cli import add_arguments, config_from_args
from skippy_cache.bench.targets import free_port

pytestmark = pytest.mark.timeout(240)

#: Every workload runs, each with the fewest requests that still exercise its logic (a warm
#: repeat, a later round, a second chat turn, two zero blocks in opposite target order).
TINY = Sizes(
    warm_prompt_tokens=(128,),
    warm_repeats=2,
    tenants=2,
    tenant_system_tokens=100,
    tenant_question_words=6,
    tenant_rounds=2,
    concurrency=2,
    chat_conversations=2,
    chat_turns=2,
    chat_system_tokens=40,
    chat_user_tokens=16,
    chat_max_tokens=3,
    zero_prompts=2,
    zero_blocks=2,
    zero_prompt_tokens=64,
    zero_max_tokens=2,
)


@pytest.mark.model
def test_every_workload_runs_counts_failures_and_writes_outputs(tmp_path: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"  # bound then released: nothing listens there
    config = BenchConfig(
        # The bench starts skippy-cache itself (`serve` as a subprocess), as a user's run does.
        specs=[TargetSpec("skippy-cache", "skippy-cache"), parse_url_option(f"dead={closed}")],
        sizes=TINY,
        ctx_size=2048,
        out_dir=tmp_path,
        timeout_s=60,
    )
    outcome = bench(config, Console(quiet=True, width=150))

    doc = json.loads(outcome.json_path.read_text())
    assert doc["config"]["workloads"] == list(WORKLOADS)
    assert {f["workload"] for f in doc["figures"]} == set(WORKLOADS)
    measured = doc["measurements"]
    for workload in WORKLOADS:
        for target in ("skippy-cache", "dead"):
            assert any(m["workload"] == workload and m["target"] == target for m in measured), (
                workload,
                target,
            )

    live = [m for m in measured if m["target"] == "skippy-cache"]
    dead = [m for m in measured if m["target"] == "dead"]
    assert all(m["ok"] for m in live), [m["error"] for m in live if not m["ok"]]
    assert len(dead) == len(live), "a failed request was dropped instead of counted"
    assert dead and not any(m["ok"] for m in dead)
    assert all(m["error"] for m in dead)
    assert doc["failed_requests"] == len(dead) > 0
    failures = {f["workload"]: f["values"] for f in doc["figures"] if f["name"] == "failed requests"}
    assert all(
        v["dead"] == sum(m["workload"] == w for m in dead) and v["skippy-cache"] == 0
        for w, v in failures.items()
    )
    assert next(t for t in doc["targets"] if t["label"] == "dead")["error"]

    # skippy-cache streams usage, and its warm repeats hit the cache.
    assert all(m["prompt_tokens"] and m["cached_tokens"] is not None for m in live)
    warm_hits = [m for m in live if m["group"] == "P=128 warm"]
    assert warm_hits and all(m["cached_tokens"] > 0 for m in warm_hits)

    assert outcome.png_path.exists() and outcome.png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_options_map_to_config() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(
        parser.parse_args(
            [
                "--quick",
                "--peer",
                "llama-cpp-python",
                "--url",
                "ls=http://127.0.0.1:8080/v1",
                "--workloads",
                "zero,warm",
                "--runs",
                "4",
            ]
        )
    )
    assert [(s.label, s.kind, s.url) for s in config.specs] == [
        ("skippy-cache", "skippy-cache", None),
        ("skippy-cache (cache off)", "skippy-cache-off", None),
        ("llama-cpp-python", "llama-cpp-python", None),
        ("ls", "url", "http://127.0.0.1:8080"),
    ]
    assert config.workloads == ["warm", "zero"]  # the order, whatever order was asked
    assert config.sizes.warm_repeats == 4 and config.ctx_size == 8192
    with pytest.raises(ValueError, match="unknown"):
        config_from_args(parser.parse_args(["--workloads", "warm,nope"]))
    with pytest.raises(ValueError, match="nothing to measure"):
        config_from_args(parser.parse_args(["--no-skippy"]))


def test_bench_is_imported_only_when_bench_runs() -> None:
    code = (
        "import sys, skippy_cache.__main__ as m; m.build_parser(); "
        "print(sorted(k for k in sys.modules if k.startswith(('skippy_cache.bench', 'rich', 'matplotlib'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    help_text = subprocess.run(
        [sys.executable, "-m", "skippy_cache", "bench", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "--peer" in help_text and "--url" in help_text
