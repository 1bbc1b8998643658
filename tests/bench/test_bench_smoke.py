"""`skippy-cache bench` end to end on tiny sizes: one live skippy-cache server (a subprocess, as
users run it) and one target on a closed port. Behaviour only: every workload is in the JSON,
the dead target's requests are counted as failures while the run completes, the PNG is written.
The replicas workload runs on its own: two replicas with and without a shared Redis tier, then
one server. No timing is asserted: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from skippy_cache.bench import WORKLOADS, BenchConfig, Sizes, TargetSpec, bench, parse_url_option
from skippy_cache.bench import replay as replay_workload
from skippy_cache.bench import replicas as replicas_module
from skippy_cache.bench.cli import add_arguments, config_from_args
from skippy_cache.bench.replicas import ReplicasError, configurations, find_redis_server
from skippy_cache.bench.results import headline_table
from skippy_cache.bench.run import REPLICAS, planned_requests
from skippy_cache.bench.targets import free_port, server_command
from skippy_cache.sizing.trace import TraceRequest

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
    agents=2,
    agent_steps=2,
    agent_system_tokens=200,
    agent_result_tokens=(20, 40),
    agent_max_tokens=40,
)


#: The replicas workload on few requests that still show sharing: each tenant's system prompt is
#: longer than a few stored chunks (64 tokens), the smallest unit the shared tier holds, and three
#: tenants over two replicas put every tenant's second round on the other replica.
TINY_REPLICAS = replace(TINY, tenants=3, tenant_system_tokens=320)


@pytest.mark.model
def test_every_workload_runs_counts_failures_and_writes_outputs(tmp_path: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"  # bound then released: nothing listens there
    config = BenchConfig(
        # The bench starts skippy-cache itself (`serve` as a subprocess), as a user's run does.
        specs=[TargetSpec("skippy-cache", "skippy-cache"), parse_url_option(f"dead={closed}")],
        sizes=TINY,
        ctx_size=2048,
        out_dir=tmp_path,
        results_dir=tmp_path / "results",
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

    # The timeline: one row per request, sent time and skippy-cache's own queue and prefill times.
    assert outcome.timeline_path is not None
    with outcome.timeline_path.open() as f:
        timeline = list(csv.DictReader(f))
    assert [int(r["seq"]) for r in timeline] == [m["seq"] for m in measured]
    assert all(float(r["sent_s"]) >= 0 for r in timeline)
    served = [r for r in timeline if r["target"] == "skippy-cache"]
    assert all(r["queue_ms"] and r["prefill_ms"] and r["cache_source"] for r in served)

    # The summary kept in the repository: what ran, where, with what, and the figures; no requests.
    assert outcome.summary_path is not None
    summary = json.loads(outcome.summary_path.read_text())
    assert outcome.summary_path.parent == tmp_path / "results"
    assert summary["figures"] == doc["figures"] and "measurements" not in summary
    assert summary["machine"]["cpu"] and summary["machine"]["cores_used"] >= 1
    assert summary["versions"]["llama_cpp_python"] and summary["created"] == doc["created"]
    assert "serve" in summary["targets"][0]["command"] and summary["targets"][1]["command"] is None
    table = headline_table(summary)
    assert table.splitlines()[0] == "| workload | figure | skippy-cache | dead |"
    assert table.splitlines()[-1] == f"| all | failed requests | 0 | {len(dead)} |"


@pytest.mark.model
def test_the_agent_workload_steps_through_both_apis_and_reuses_each_step(tmp_path: Path) -> None:
    config = BenchConfig(specs=[TargetSpec("skippy-cache", "skippy-cache")], workloads=["agent"], sizes=TINY,
                         ctx_size=2048, out_dir=tmp_path, results_dir=tmp_path / "results", timeout_s=60)
    outcome = bench(config, Console(quiet=True, width=150))
    doc = json.loads(outcome.json_path.read_text())
    measured = [m for m in doc["measurements"] if m["workload"] == "agent"]
    assert all(m["ok"] for m in measured), [m["error"] for m in measured if not m["ok"]]
    groups = {m["group"] for m in measured}
    for api in ("chat", "messages"):
        assert {f"{api} step 1, agent 1", f"{api} step 1, agents 2+", f"{api} step 2"} <= groups, groups
        # Agents 2+ find the shared system prompt and tools computed; later steps, their history.
        later = [m for m in measured if m["group"] in (f"{api} step 1, agents 2+", f"{api} step 2")]
        assert all(m["cached_tokens"] > 0 for m in later), later
    names = {f["name"] for f in doc["figures"] if f["workload"] == "agent"}
    assert {"chat: steps 2+: TTFT p50", "messages: all steps: cached share", "messages: step 2: TTFT p90"} <= names


def test_the_agent_workload_asks_for_a_context_that_holds_it() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match="--ctx-size"):
        config_from_args(parser.parse_args(["--workloads", "agent"]))
    config = config_from_args(parser.parse_args(["--workloads", "agent", "--ctx-size", "32768"]))
    assert config.workloads == ["agent"]


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
    assert config.sizes.zero_blocks == 2
    six = config_from_args(parser.parse_args(["--workloads", "zero", "--zero-blocks", "6"]))
    assert six.sizes.zero_blocks == 6
    for wrong in (["--workloads", "zero", "--zero-blocks", "3"],
                  ["--workloads", "warm", "--zero-blocks", "4"]):
        with pytest.raises(ValueError, match="--zero-blocks"):
            config_from_args(parser.parse_args(wrong))
    with pytest.raises(ValueError, match="unknown"):
        config_from_args(parser.parse_args(["--workloads", "warm,nope"]))
    with pytest.raises(ValueError, match="nothing to measure"):
        config_from_args(parser.parse_args(["--no-skippy"]))

    # replicas is asked for by name, runs last, and needs no target of the run's own.
    assert REPLICAS not in WORKLOADS
    config = config_from_args(parser.parse_args(["--workloads", "replicas,chat", "--replicas", "3"]))
    assert config.workloads == ["chat", REPLICAS] and config.replicas == 3
    default = config_from_args(parser.parse_args(["--no-skippy", "--workloads", "replicas"]))
    assert default.replicas == 2 and not default.replicas_fast  # the server's default mode: exact
    assert config_from_args(parser.parse_args(["--workloads", "replicas", "--replicas-fast"])).replicas_fast
    with pytest.raises(ValueError, match="--replicas"):
        config_from_args(parser.parse_args(["--workloads", "replicas", "--replicas", "1"]))


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


@pytest.mark.model
def test_replicas_workload_shares_state_through_redis(tmp_path: Path) -> None:
    config = BenchConfig(
        specs=[],  # the workload starts its own servers
        workloads=[REPLICAS],
        sizes=TINY_REPLICAS,
        ctx_size=2048,
        out_dir=tmp_path,
        results_dir=tmp_path / "results",
        timeout_s=60,
        replicas=2,
    )
    outcome = bench(config, Console(quiet=True, width=150))

    doc = json.loads(outcome.json_path.read_text())
    measured = doc["measurements"]
    assert doc["targets"] == [] and {m["workload"] for m in measured} == {REPLICAS}
    assert all(m["ok"] for m in measured), [m["error"] for m in measured if not m["ok"]]
    assert doc["failed_requests"] == 0
    per_configuration = planned_requests(REPLICAS, TINY_REPLICAS, 1)
    for name, servers in (("shared", {0, 1}), ("alone", {0, 1}), ("single", {0})):
        ms = [m for m in measured if m["target"] == name]
        assert len(ms) == per_configuration, name
        assert {m["replica"] for m in ms} == servers, name  # round-robin over the configuration's servers
        assert all(m["cache_source"] is not None for m in ms)
        assert all(m["restore_ms"] is not None and m["restore_ms"] >= 0 for m in ms)
        assert all(m["queue_ms"] >= 0 and m["prefill_ms"] >= 0 for m in ms)
        # Chat runs in rounds: every turn t is answered before any turn t + 1 (records are in answer order).
        turns = [int(m["group"].rsplit(" ", 1)[1]) for m in ms if m["group"].startswith("chat: ")]
        assert turns == sorted(turns) and len(set(turns)) == TINY_REPLICAS.chat_turns, name

    # Tenants' second rounds land on the other replica: with the shared tier, some restore from it.
    shared = [m for m in measured if m["target"] == "shared"]
    assert any(m["cache_source"] == "remote" for m in shared)
    assert all(m["restore_ms"] > 0 for m in shared if m["cache_source"] == "remote")
    assert not any(m["cache_source"] == "remote" for m in measured if m["target"] != "shared")
    figs = {f["name"]: f["values"] for f in doc["figures"] if f["workload"] == REPLICAS}
    assert figs["tenants later rounds: cached share"]["shared"] > 0
    assert figs["tenants later rounds: served from the shared tier"]["shared"] > 0
    assert figs["tenants later rounds: served from the shared tier"]["alone"] == 0
    assert all(figs["failed requests"][name] == 0 for name in ("shared", "alone", "single"))
    assert {g["name"] for g in doc["goals"]} >= {
        "replicas tenants: later p50, shared vs single",
        "replicas tenants: later p50, alone vs shared",
    }

    part = doc["replicas"]
    assert part["mode"] == "exact"
    assert [c["name"] for c in part["configurations"]] == ["shared", "alone", "single"]
    assert part["redis"]["after_shared"]["keys"] > 0
    for c in part["configurations"]:
        commands = [t["command"] for t in c["targets"]]
        assert all(("--remote-cache" in cmd) == c["shared_tier"] for cmd in commands)
        assert all(cmd[cmd.index("--cache-dir") + 1] == "none" for cmd in commands)
        assert not any("--fast" in cmd for cmd in commands)
        # Each server's /v1/cache at the end; only the shared configuration's have a remote section.
        assert len(c["caches"]) == len(commands)
        assert all((cache["remote"] is not None) == c["shared_tier"] for cache in c["caches"])
    # Everything it started is stopped: Redis's port no longer answers.
    port = int(part["redis"]["command"][part["redis"]["command"].index("--port") + 1])
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    assert outcome.png_path.exists()


def test_replica_threads_split_the_cores() -> None:
    assert [(c.name, c.servers, c.threads, c.shared) for c in configurations(2, 2)] == [
        ("shared", 2, 1, True),
        ("alone", 2, 1, False),
        ("single", 1, 2, False),
    ]
    assert [c.threads for c in configurations(2, 8)] == [4, 4, 8]
    assert [c.threads for c in configurations(3, 8)] == [2, 2, 6]  # the same total as the replicas
    assert [c.threads for c in configurations(4, 2)] == [1, 1, 2]  # never more than the cores


def test_missing_redis_server_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replicas_module.shutil, "which", lambda _: None)
    with pytest.raises(ReplicasError, match="apt-get install redis-server"):
        find_redis_server()
    config = BenchConfig(specs=[], workloads=[REPLICAS])
    with pytest.raises(ReplicasError, match="redis-server"):
        bench(config, Console(quiet=True))


def test_replica_figures_and_goals_from_measurements() -> None:
    from skippy_cache.bench.run import Measurement
    from skippy_cache.bench.summary import replica_figures, replica_goals

    def m(target: str, group: str, ttft: float, cached: int, source: str) -> Measurement:
        return Measurement(REPLICAS, target, group, 0, True, ttft, ttft, 100, cached, 1, None, source, 0)

    ms = []
    for target, later_ttft, source in (("shared", 100.0, "remote"), ("alone", 1000.0, "none"),
                                       ("single", 80.0, "ram")):
        cached = 0 if source == "none" else 90
        ms += [m(target, "tenants: round 1", 2000.0, 0, "none"), m(target, "chat: turn 1", 900.0, 0, "none")]
        ms += [m(target, "tenants: later rounds", later_ttft, cached, source) for _ in range(2)]
        ms += [m(target, f"chat: turn {t}", later_ttft, cached, source) for t in (2, 3)]
    figs = {f.name: f.values for f in replica_figures(ms, ["shared", "alone", "single"])}
    assert figs["tenants round 1: TTFT p50"]["shared"] == 2000.0
    assert figs["chat later turns: TTFT p50"] == {"shared": 100.0, "alone": 1000.0, "single": 80.0}
    assert figs["chat later turns: cached share"]["shared"] == 90.0  # turn 1 is not a later turn
    remote = figs["tenants later rounds: served from the shared tier"]
    assert remote == {"shared": 100.0, "alone": 0.0, "single": 0.0}
    checks = {g.name: g.met for g in replica_goals(replica_figures(ms, ["shared", "alone", "single"]),
                                                   "shared", "alone", "single")}
    assert checks == {
        "replicas tenants: later p50, shared vs single": True,  # 100 / 80 = 1.25x <= 1.5x
        "replicas tenants: later p50, alone vs shared": True,  # 10x >= 5x
        "replicas chat: later p50, shared vs single": True,
        "replicas chat: later p50, alone vs shared": True,
    }


@pytest.mark.model
def test_the_trace_workload_compares_the_live_cached_share_with_the_replays(tmp_path: Path) -> None:
    # A chat of three turns over a shared system block, a stranger, and an exact repeat.
    ids = [[0, 1, 2], [0, 1, 2, 3, 4], [9, 10], [0, 1, 2, 3, 4, 5, 6], [9, 10]]
    trace = [TraceRequest(1000.0 * i, 512 * len(h) - 100, 4, tuple(h)) for i, h in enumerate(ids)]
    sizes = replace(TINY, trace_requests=len(trace), trace_max_tokens=2)
    config = BenchConfig(specs=[TargetSpec("skippy-cache", "skippy-cache")], workloads=["trace"], sizes=sizes,
                         ctx_size=2048, out_dir=tmp_path, results_dir=tmp_path / "results", timeout_s=60,
                         trace=trace)
    doc = bench(config, Console(quiet=True, width=150)).document
    measured = [m for m in doc["measurements"] if m["workload"] == "trace"]
    assert [m["ok"] for m in measured] == [True] * len(trace), [m["error"] for m in measured]
    assert [m["cached_tokens"] > 0 for m in measured] == [False, True, False, True, True]
    values = {f["name"]: f["values"]["skippy-cache"] for f in doc["figures"] if f["workload"] == "trace"}
    assert values["cached share"] > 0 and values["cached share, as the replay predicts"] > 0
    goal = next(g for g in doc["goals"] if g["name"].startswith("trace:"))
    assert goal["met"], goal


@pytest.mark.parametrize("scale", [None, 0.05])
def test_the_trace_workload_sends_in_order_or_at_the_trace_s_times_scaled(scale: float | None) -> None:
    trace = [TraceRequest(ms, 600, 1, (i,)) for i, ms in enumerate([0.0, 400.0, 1400.0])]
    events: list[tuple[str, float]] = []

    async def request(workload, target, group, path, body):
        events.append(("sent", time.perf_counter()))
        await asyncio.sleep(0.2)  # each answer takes longer than the first gap, scaled
        events.append(("answered", time.perf_counter()))

    run = SimpleNamespace(sizes=replace(TINY, trace_requests=3, trace_time_scale=scale), trace=trace, seed=0,
                          targets_for=lambda workload: [SimpleNamespace(kind="llama-server")],
                          request=request, span=lambda *args: None)
    started = time.perf_counter()
    asyncio.run(replay_workload.trace(run))
    sent = [t - started for kind, t in events if kind == "sent"]
    if scale is None:  # each after the last one's answer
        assert [kind for kind, _ in events] == ["sent", "answered"] * 3
    else:  # at 0, 20 and 70 ms, each without waiting for the answers before it
        assert [kind for kind, _ in events][:3] == ["sent"] * 3
        assert sent[1] >= 0.019 and sent[2] >= 0.069


def test_the_trace_workload_needs_its_trace(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match="--workloads trace and --trace PATH go together"):
        config_from_args(parser.parse_args(["--workloads", "trace"]))
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n')
    config = config_from_args(parser.parse_args(["--workloads", "trace", "--trace", str(path)]))
    assert config.workloads == ["trace"] and len(config.trace) == 1
    with pytest.raises(ValueError, match="multiple of 64"):
        config_from_args(parser.parse_args(["--workloads", "trace", "--trace", str(path), "--block-tokens", "32"]))
    config = config_from_args(parser.parse_args(["--workloads", "trace", "--trace", str(path),
                                                 "--block-tokens", "128", "--time-scale", "0.5"]))
    assert config.sizes.trace_block_tokens == 128 and config.sizes.trace_time_scale == 0.5
    command = server_command("skippy-cache", 1, Path("m.gguf"), 2048, chunk_tokens=128)
    assert command[command.index("--chunk-tokens") + 1] == "128"
    with pytest.raises(ValueError, match="the trace workload's"):
        config_from_args(parser.parse_args(["--time-scale", "2"]))
    path.write_text("nonsense\n")
    with pytest.raises(ValueError, match=r"--trace: .*:1: not a trace request"):
        config_from_args(parser.parse_args(["--workloads", "trace", "--trace", str(path)]))
