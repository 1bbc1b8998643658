"""The soak script (benchmarks/soak.py), for seconds instead of minutes, against a live server: its checks pass."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from live_server import LiveServer, run_own_server

from skippy_cache.server import ServerSettings

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


@pytest.fixture(scope="module")
def soak_server() -> Iterator[LiveServer]:
    # A queue that holds every client and burst, with no wait limit (a 503 fails the soak, and on
    # a host running at a quarter of its speed the default 15 s limit turned most of a 20 s soak
    # into 503s), and a small body limit so bodies over it are cheap to send.
    yield from run_own_server(ServerSettings(ctx_size=2048, lanes=4, queue_size=64, max_queue_wait=0.0,
                                             cache_dir=None, fast=True, max_body_mib=1))


def test_the_soak_checks_pass(soak_server: LiveServer, tmp_path: Path) -> None:
    out = tmp_path / "soak.md"
    # The server runs in this process: its RSS is this process's.
    cmd = [sys.executable, str(SOAK), "--url", soak_server.url, "--pid", str(os.getpid()), "--minutes", "0.33",
           "--clients", "8", "--burst-every", "8", "--max-body-mib", "1", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout + done.stderr
    table = out.read_text()
    for kind in ("chat_stream", "stream_dropped", "dropped_before_first_token", "malformed_json",
                 "invalid_utf8", "body_over_limit", "same_prompt"):
        assert f"| {kind}" in table
    assert "FAILED" not in table
    assert "| same_prompt                  |      0 |" not in table, table
