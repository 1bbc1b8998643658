"""The open-loop bench: arrival clocks, the figures per rate (percentiles, goodput, saturation, goals),
its options, and one tiny live run against a real skippy-cache server."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import pytest
from rich.console import Console
from test_bench_smoke import TINY

from skippy_cache.bench import BenchConfig, TargetSpec, bench
from skippy_cache.bench.arrivals import arrival_times, read_trace
from skippy_cache.bench.cli import add_arguments, config_from_args, reference_label
from skippy_cache.bench.curves import SLO, OpenRequest, open_goals, percentile, rate_point, saturation_rate
from skippy_cache.bench.openloop import OPEN_WORKLOADS, OpenLoop
from skippy_cache.bench.targets import LLAMA_SERVER_SPLIT, SKIPPY, Target, server_command


def request(i: int, *, ok: bool = True, status: str = "ok", ttft: float | None = 100.0, total: float = 500.0,
            tokens: int | None = 5, group: str = "hit", target: str = "a", rate: float = 1.0,
            workload: str = "tenants", due: float | None = None) -> OpenRequest:
    due = float(i) if due is None else due
    return OpenRequest(workload, target, rate, i, group, due, due, ok, status, ttft, total, 100, 50, tokens)


def test_poisson_arrivals_keep_their_rate_and_are_reproducible() -> None:
    times = arrival_times("poisson", 4.0, 4000, "k")
    assert times[0] == 0 and all(b >= a for a, b in itertools.pairwise(times))
    assert 3.8 < (len(times) - 1) / times[-1] < 4.2
    assert times == arrival_times("poisson", 4.0, 4000, "k")
    assert times != arrival_times("poisson", 4.0, 4000, "other")


def test_bursts_arrive_together_at_the_mean_rate() -> None:
    assert arrival_times("burst", 2.0, 7, "k", burst=3) == [0, 0, 0, 1.5, 1.5, 1.5, 3.0]


def test_a_trace_keeps_its_gaps_scaled_to_the_rate(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps({"timestamp": t, "input_length": 10, "hash_ids": [1]})
                              for t in (3000, 0, 1000)) + "\n")
    trace = read_trace(path)
    assert trace == [0.0, 1.0, 3.0]  # sorted, in seconds: gaps 1 and 2, mean 1.5
    assert arrival_times("trace", 2.0, 5, "k", trace=trace) == pytest.approx([0, 1 / 3, 1, 4 / 3, 2])
    plain = tmp_path / "seconds.txt"
    plain.write_text("0\n0.5\n\nbad\n")
    with pytest.raises(ValueError, match=r"seconds.txt:4"):
        read_trace(plain)


def test_percentiles_interpolate() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def test_a_rate_point_counts_the_lost_and_only_good_requests_as_goodput() -> None:
    slo = SLO(ttft_ms=1000, tpot_ms=100)
    requests = [
        request(0, group="cold", ttft=900),  # good
        request(1, ttft=1500),  # too slow to first token
        request(2, ttft=100, total=100 + 4 * 150),  # 150 ms per token after the first
        request(3, ok=False, status="503", ttft=None, total=5),
        request(4, ok=False, status="error", ttft=None, total=5),
        request(5, ttft=50, tokens=1, total=60),  # one token: no TPOT, good
    ]
    p = rate_point(requests, slo)
    assert (p.requests, p.answered, p.rejected, p.failed, p.lost) == (6, 4, 1, 1, 2)
    assert requests[2].tpot_ms == pytest.approx(150)
    assert requests[5].tpot_ms is None
    assert p.hit_ttft_p50 == pytest.approx(percentile([1500, 100, 50], 50))
    # From the first arrival (0 s) to the last answer (5 s + 60 ms).
    assert p.duration_s == pytest.approx(5.06)
    assert p.goodput == pytest.approx(2 / 5.06)
    assert p.throughput == pytest.approx(4 / 5.06)
    assert p.offered == pytest.approx(1.0)  # six arrivals over five seconds
    assert p.cached_share == pytest.approx(0.5)


def point(rate: float, p99: float, *, lost: int = 0, target: str = "a", goodput: float = 1.0,
          workload: str = "tenants", hit: float | None = None):
    rs = [request(i, rate=rate, target=target, workload=workload, ttft=p99, due=i / 100) for i in range(100)]
    rs += [request(100 + i, ok=False, status="503", rate=rate, target=target, workload=workload) for i in range(lost)]
    p = rate_point(rs, SLO())
    from dataclasses import replace
    return replace(p, goodput=goodput, hit_ttft_p50=p99 if hit is None else hit)


def test_saturation_is_the_last_rate_before_the_tail_or_the_losses_blow_up() -> None:
    assert saturation_rate([point(1, 100), point(2, 900), point(4, 1100)]) == (2, True)
    assert saturation_rate([point(1, 100), point(2, 150), point(4, 200, lost=2)]) == (2, True)
    assert saturation_rate([point(1, 100), point(2, 150, lost=1)]) == (2, False)  # 1 in 101 is within 1%
    assert saturation_rate([point(4, 100), point(1, 100)]) == (4, False)
    assert saturation_rate([point(1, 100, lost=50)]) == (None, True)
    # Answers that come out far slower than the requests came in: the queue only grew.
    slow = [request(i, rate=8, due=i / 8, ttft=100, total=i * 1000.0) for i in range(40)]
    assert saturation_rate([point(1, 100), rate_point(slow, SLO())]) == (1, True)


def test_goals_hold_against_the_peer_with_the_best_goodput() -> None:
    points = [
        point(1, 100, hit=40), point(2, 120, hit=45, goodput=3.0),
        point(1, 120, target="slow", hit=90, goodput=1.0), point(2, 5000, target="slow", hit=95, goodput=0.5),
        point(1, 90, target="fast", hit=100, goodput=1.5), point(2, 110, target="fast", hit=100, goodput=1.8),
    ]
    checks = {g.name: g for g in open_goals(points, "a", ["slow", "fast"], None)}
    assert checks["tenants: best goodput vs fast"].met is True  # 3.0 >= 1.5 x 1.8
    assert checks["tenants: saturation rate vs fast"].met is True
    tail = checks["tenants: TTFT p99 up to the peer's saturation"]
    assert tail.met is False and "1/s 100 vs 90" in tail.got and "2/s" in tail.got
    assert checks["tenants: hit TTFT p50 up to the peer's saturation"].met is True
    assert checks["tenants: no request lost"].met is True
    # With `--no-skippy --url a=... --url fast=...` the reference is one of the URL targets: never its own peer.
    checks = {g.name: g for g in open_goals(points, "a", ["a", "fast"], None)}
    assert "tenants: best goodput vs fast" in checks and "tenants: best goodput vs a" not in checks


def test_the_reference_is_the_skippy_cache_measured_not_a_peer() -> None:
    peer = Target(LLAMA_SERVER_SPLIT, LLAMA_SERVER_SPLIT, "http://127.0.0.1:1")
    old, new = Target("old", "url", "http://127.0.0.1:2"), Target("new", "url", "http://127.0.0.1:3")
    ours = Target(SKIPPY, "skippy-cache", "http://127.0.0.1:4")
    # `--no-skippy --url old=... --url new=... --peer llama-server-split` starts the peer first.
    assert reference_label(parse("--no-skippy", "--url", "old=http://x"), [peer, old, new]) == "old"
    assert reference_label(parse(), [peer, ours, old]) == SKIPPY
    assert reference_label(parse("--reference", "new"), [peer, old, new]) == "new"
    assert reference_label(parse("--no-skippy", "--peer", LLAMA_SERVER_SPLIT), [peer]) == LLAMA_SERVER_SPLIT


def parse(*argv: str) -> BenchConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_open_loop_options(tmp_path: Path) -> None:
    config = parse("--arrivals", "poisson", "--rates", "2,0.5,2", "--requests", "9")
    assert config.workloads == list(OPEN_WORKLOADS)
    assert config.open_loop is not None
    assert (config.open_loop.rates, config.open_loop.requests) == ((0.5, 2.0), 9)
    assert parse("--arrivals", "burst", "--rate", "3", "--workloads", "chat").open_loop.rates == (3.0,)
    assert parse().open_loop is None
    trace = tmp_path / "t.txt"
    trace.write_text("0\n1\n2\n")
    assert parse("--arrivals", "trace", "--trace", str(trace)).open_loop.trace == [0.0, 1.0, 2.0]
    for bad, said in ((["--rates", "1"], "need --arrivals"),
                      (["--arrivals", "poisson", "--workloads", "warm"], "open loop runs"),
                      (["--arrivals", "poisson", "--rates", "1,x"], "expected numbers"),
                      (["--arrivals", "poisson", "--rates", "0"], "positive"),
                      (["--arrivals", "trace"], "go together")):
        with pytest.raises(ValueError, match=said):
            parse(*bad)


def test_the_split_llama_server_gives_each_slot_its_own_cells(tmp_path: Path) -> None:
    cmd = server_command(LLAMA_SERVER_SPLIT, 8090, Path("/m.gguf"), 8192, tmp_path / "llama-server")
    assert "-np 4" in " ".join(cmd) and "--kv-unified" not in cmd


@pytest.mark.model
@pytest.mark.timeout(300)
def test_an_open_loop_run_measures_every_workload_and_rate(tmp_path: Path) -> None:
    plan = OpenLoop("burst", (1.0, 8.0), requests=6, burst=3)
    config = BenchConfig(specs=[TargetSpec("skippy-cache", "skippy-cache")], workloads=list(OPEN_WORKLOADS),
                         sizes=TINY, ctx_size=2048, out_dir=tmp_path, results_dir=tmp_path / "results",
                         timeout_s=60, open_loop=plan)
    outcome = bench(config, Console(quiet=True, width=150))
    doc = json.loads(outcome.json_path.read_text())
    assert outcome.png_path.stat().st_size > 0
    assert {(p["workload"], p["rate"]) for p in doc["points"]} == {(w, r) for w in OPEN_WORKLOADS for r in (1, 8)}
    assert doc["failed_requests"] == 0
    requests = doc["requests"]
    assert len(requests) == 3 * 2 * 6
    # Bursts of 3 arrive together; a tenant's request after the first burst (when its system
    # prompt was computed) reuses it. (Of two tenants, the first burst already asks one twice:
    # whether that one shares the rows in flight depends on when it is admitted.)
    tenants = [r for r in requests if r["workload"] == "tenants" and r["rate"] == 1]
    assert [r["due_s"] for r in tenants] == [0, 0, 0, 3, 3, 3]
    assert [r["group"] for r in tenants] == ["cold", "cold", "hit", "hit", "hit", "hit"]
    assert all(r["cached_tokens"] > 0 for r in tenants if r["due_s"] > 0)
    # A chat turn is sent only after the previous turn of its conversation was answered.
    chat = {r["index"]: r for r in requests if r["workload"] == "chat" and r["rate"] == 8}
    conversations = TINY.chat_conversations * 2
    for i, r in chat.items():
        if i >= conversations:
            before = chat[i - conversations]
            assert r["sent_s"] >= before["sent_s"] + before["total_ms"] / 1000 - 1e-3
            assert r["cached_tokens"] > 0
