"""The trace log (no model): Mooncake's format, ids that follow shared prefixes, a salt that keeps tokens out."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from skippy_cache.server.tracelog import BLOCK_TOKENS, TraceLog, hash_ids, load_salt

SALT = bytes(range(32))


@given(st.lists(st.integers(0, 50_000), min_size=1, max_size=3000),
       st.lists(st.integers(0, 50_000), min_size=1, max_size=3000))
def test_two_prompts_share_their_first_ids_exactly_as_far_as_they_share_whole_blocks(
        a: list[int], b: list[int]) -> None:
    ids_a, ids_b = hash_ids(SALT, a, 64), hash_ids(SALT, b, 64)
    assert len(ids_a) == -(-len(a) // 64)
    for k in range(min(len(ids_a), len(ids_b))):
        assert (ids_a[k] == ids_b[k]) == (a[: 64 * (k + 1)] == b[: 64 * (k + 1)])


def test_another_salt_gives_unrelated_ids() -> None:
    tokens = list(range(2000))
    mine, theirs = hash_ids(SALT, tokens), hash_ids(bytes(32), tokens)
    assert len(mine) == len(theirs) == 4  # three whole blocks of 512 and a partial one
    assert not set(mine) & set(theirs)
    assert all(0 <= i < 2**63 for i in mine)


def test_the_salt_is_made_once_private_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl.salt"
    salt = load_salt(path)
    assert len(salt) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_salt(path) == salt
    path.write_bytes(b"short")
    with pytest.raises(ValueError, match="a trace salt is 32 bytes"):
        load_salt(path)


def test_a_line_per_request_in_mooncakes_format(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    log = TraceLog(path, started=100.0)
    tokens = [7] * (BLOCK_TOKENS + 10)
    log.write(101.5, tokens, 16, "alice")
    log.write(102.0, tokens[:BLOCK_TOKENS], 4, None)
    log.close()
    log.write(103.0, tokens, 1, None)  # after the server stopped: not logged, no error
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert first == {"timestamp": 1500, "input_length": BLOCK_TOKENS + 10, "output_length": 16,
                     "hash_ids": hash_ids(log.salt, tokens), "tenant": "alice"}
    assert second["hash_ids"] == first["hash_ids"][:1] and "tenant" not in second
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert log.salt == load_salt(tmp_path / "trace.jsonl.salt"), "the salt is kept beside the log"


@pytest.mark.parametrize("problem", ["no directory", "a bad salt"])
def test_a_trace_log_that_cannot_be_kept_stops_the_start_naming_it(tmp_path: Path, problem: str) -> None:
    path = tmp_path / "missing" / "trace.jsonl"
    if problem == "a bad salt":
        path = tmp_path / "trace.jsonl"
        (tmp_path / "trace.jsonl.salt").write_bytes(b"short")
    out = subprocess.run([sys.executable, "-m", "skippy_cache", "serve", "--trace-log", str(path), "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"skippy-cache serve: error: --trace-log {path}: " in out.stderr
    assert "Traceback" not in out.stderr and "loading model" not in out.stderr
