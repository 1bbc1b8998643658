"""`skippy-cache replay` as a user runs it: its outputs, its errors, the KV size and prefill rate it finds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from skippy_cache.sizing.cli import UsageError, kv_bytes_per_token, parse_capacity
from skippy_cache.sizing.trace import TraceError, parse_trace


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "skippy_cache", "replay", *args], capture_output=True, text=True,
                          timeout=300)


def write_trace(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    # Three turns of one chat over a shared system block, then a stranger; 16-token blocks.
    return write_trace(tmp_path / "trace.jsonl", [
        {"timestamp": 0, "input_length": 40, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 60_000, "input_length": 70, "output_length": 5, "hash_ids": [0, 1, 3, 4, 5]},
        {"timestamp": 120_000, "input_length": 100, "output_length": 5, "hash_ids": [0, 1, 3, 4, 6, 7, 8]},
        {"timestamp": 180_000, "input_length": 20, "output_length": 5, "hash_ids": [9, 10]},
    ])


FAST = ("--block-tokens", "16", "--kv-bytes-per-token", "2", "--prefill-rate", "1000")


def test_json_gives_every_figure(trace: Path) -> None:
    out = run(str(trace), *FAST, "--ram", "100 blocks", "--json")
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    # Turn 2 reuses blocks 0-1 (32 tokens), turn 3 blocks 0-1 and 3-4 (64): 96 of 230 prompt tokens.
    assert figures["requests"] == 4 and figures["input_tokens"] == 230
    assert figures["hit_ratio"]["ram"] == pytest.approx(96 / 230, abs=1e-6)
    assert figures["hit_ratio_total"] == figures["infinite_cache_bound"]
    assert figures["ram_bytes"] == 100 * 16 * 2
    assert figures["restored_bytes_per_request"] == 96 * 2 / 4
    assert figures["prefill_seconds_saved"] == pytest.approx(0.1, abs=0.05)


def test_the_table_names_the_tiers_and_the_bound(trace: Path) -> None:
    out = run(str(trace), *FAST, "--ram", "2 blocks", "--disk", "1KiB", "--replicas", "2")
    assert out.returncode == 0, out.stderr
    for words in ("hit ratio from disk", "hit ratio, all tiers", "infinite-cache bound", "requests per replica"):
        assert words in out.stdout


def test_a_window_counts_only_its_requests(trace: Path) -> None:
    out = run(str(trace), *FAST, "--window", "2:", "--json")
    figures = json.loads(out.stdout)
    assert figures["requests"] == 2 and figures["hit_ratio_total"] == pytest.approx(64 / 120, abs=1e-6)


def test_plot_draws_the_curves(trace: Path, tmp_path: Path) -> None:
    png = tmp_path / "curves.png"
    out = run(str(trace), *FAST, "--plot", str(png), "--json")
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curves = json.loads(out.stdout)["plot"]["curves"]
    assert set(curves) == {"lru", "lrfu", "offline optimum"}


@pytest.mark.parametrize(("args", "says"), [
    (("--ram", "12 parsecs"), "unknown unit 'parsecs'"),
    (("--ram", "lots"), "capacity 'lots'"),
    (("--window", "30:10"), "FROM < TO"),
    (("--replicas", "0"), "must be positive"),
])
def test_a_bad_option_is_one_line_and_exit_2(trace: Path, args: tuple[str, ...], says: str) -> None:
    out = run(str(trace), *FAST, *args)
    assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr


def test_a_bad_trace_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [1]}\nnot json\n')
    out = run(str(path), *FAST)
    assert out.returncode == 2 and f"{path}:2: not a trace request" in out.stderr
    out = run(str(tmp_path / "absent.jsonl"), *FAST)
    assert out.returncode == 2 and "cannot read it" in out.stderr


def test_hash_ids_must_match_the_block_size() -> None:
    with pytest.raises(TraceError, match="make 2 blocks of 512, but there are 1 hash_ids"):
        list(parse_trace(['{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}']))


def test_capacities_in_tokens_blocks_and_bytes() -> None:
    assert parse_capacity("4096", kv_bytes_per_token=10, block_tokens=512) == 40_960
    assert parse_capacity("2 blocks", kv_bytes_per_token=10, block_tokens=512) == 10_240
    assert parse_capacity("1.5GiB", kv_bytes_per_token=10, block_tokens=512) == 3 << 29
    assert parse_capacity("2 MB", kv_bytes_per_token=10, block_tokens=512) == 2_000_000


def test_the_default_models_kv_size_per_token() -> None:
    # SmolLM2-135M: 30 layers x 3 KV heads x (64 + 64) dims x 2 bytes.
    assert kv_bytes_per_token(None) == 30 * 3 * 128 * 2


def test_a_model_that_is_no_gguf_file_is_a_usage_error(tmp_path: Path) -> None:
    bad = tmp_path / "notes.gguf"
    bad.write_text("not a model")
    with pytest.raises(UsageError, match="not a GGUF model file"):
        kv_bytes_per_token(bad)
    with pytest.raises(UsageError, match="not found"):
        kv_bytes_per_token(tmp_path / "missing.gguf")


@pytest.mark.model
def test_the_prefill_rate_is_measured_here_by_default(trace: Path) -> None:
    out = run(str(trace), "--block-tokens", "16", "--json")
    assert out.returncode == 0, out.stderr
    # Measured, so any positive rate: a bound near this machine's rate failed under a parallel test run.
    assert json.loads(out.stdout)["prefill_rate_tokens_per_s"] > 1
