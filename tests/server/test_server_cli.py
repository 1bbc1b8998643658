"""The README's run command as a subprocess: `python -m skippy_cache serve` answers, then SIGTERM exits 0.

(`make run` also sets up the venv, too slow for a test; this is the command it runs.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env() -> dict[str, str]:
    """No SKIPPY_* from the developer's shell may change what the test runs."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SKIPPY_")}


@pytest.mark.model
def test_serve_answers_then_drains_on_sigterm() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "skippy_cache", "serve", "--port", str(port), "--ctx-size", "2048"],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, "the server exited:\n" + "".join(log)
            assert time.monotonic() < deadline, "the server never answered /health:\n" + "".join(log)
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25)

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
        out = client.chat.completions.create(
            model="skippy-cache", messages=[{"role": "user", "content": "Hi!"}], max_tokens=4, temperature=0
        )
        assert out.choices[0].message.content is not None
        assert out.usage.prompt_tokens > 0

        # A stream in flight when SIGTERM arrives still finishes (drain).
        stream = client.completions.create(
            model="skippy-cache", prompt="Once upon a time, in a land far away,", max_tokens=12,
            temperature=0, stream=True,
        )
        first = next(iter(stream))
        proc.send_signal(signal.SIGTERM)
        rest = list(stream)
        assert [c.choices[0].finish_reason for c in [first, *rest] if c.choices][-1] in ("stop", "length")
        assert proc.wait(timeout=120) == 0, "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    reader.join(10)
    text = "".join(log)
    # The one start-up block: model, pool, derived cache budgets.
    for needle in ("skippy-cache server", "model ", "digest ", "n_ctx 2048", "lanes", "n_seq_max",
                   "mode lookup-record", "max entries 64", "token cap none", "reserved sequences 0..7",
                   "min_tokens 64", "stride 128", "record limit 2"):
        assert needle in text, f"{needle!r} missing from the start-up log:\n{text}"


def test_malformed_setting_exits_2_naming_it() -> None:
    out = subprocess.run([sys.executable, "-m", "skippy_cache", "serve", "--ctx-size", "lots"],
                         env=clean_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--ctx-size" in out.stderr


def test_missing_model_exits_1() -> None:
    argv = [sys.executable, "-m", "skippy_cache", "serve", "--model", "/nonexistent/model.gguf"]
    out = subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "model file not found" in out.stderr


def test_help_explains_every_option() -> None:
    out = subprocess.run([sys.executable, "-m", "skippy_cache", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    for flag in ("--model", "--host", "--port", "--ctx-size", "--lanes", "--cache-mode", "--max-entries",
                 "--max-bytes", "--min-tokens", "--stride", "--record-limit", "--api-key", "--queue-size",
                 "--deterministic", "--config"):
        assert flag in out.stdout
