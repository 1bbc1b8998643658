"""Tenants through `skippy-cache serve` subprocesses: isolation on disk after a restart and through
Redis, and a key revoked by SIGHUP without dropping the requests in flight."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from test_server_cli import Served, clean_env

from skippy_cache.server.tenants import hash_key

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

ALICE, BOB, ROOT = "sk-alice-1", "sk-bob-2", "sk-root-4"
#: A prompt past a whole stored chunk, so a restart or another replica can restore it.
PROMPT = "Tenant isolation across restarts and replicas. " + "A shared cache is a side channel. " * 40


def keys(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "keys.txt"
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def all_keys(tmp_path: Path) -> Path:
    return keys(tmp_path, f"{hash_key(ALICE)} alice user", f"{hash_key(BOB)} bob user",
                f"{hash_key(ROOT)} ops admin")


def client(server: Served, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, timeout=120, max_retries=0)


def ask(server: Served, key: str) -> tuple[int, str]:
    out = client(server, key).completions.create(model="skippy-cache", prompt=PROMPT, max_tokens=1, temperature=0)
    return out.usage.prompt_tokens_details.cached_tokens, out.model_extra["skippy_cache"]["source"]


def admin_cache(server: Served) -> dict:
    return httpx.get(f"{server.url}/v1/cache", headers={"Authorization": f"Bearer {ROOT}"}, timeout=10).json()


def test_isolation_holds_on_disk_after_a_restart(tmp_path: Path) -> None:
    args = ("--ctx-size", "2048", "--api-keys", str(all_keys(tmp_path)), "--cache-dir", str(tmp_path / "cache"))
    first = Served(*args, env=clean_env())
    try:
        first.wait_ready()
        ask(first, ALICE)
        assert ask(first, ALICE)[0] > 0  # reused: its chunks belong on disk when it leaves
    finally:
        first.proc.send_signal(signal.SIGTERM)  # a drained stop writes the store's queue out
        first.proc.wait(120)
        first.stop()
    second = Served(*args, env=clean_env())
    try:
        second.wait_ready()
        assert ask(second, BOB) == (0, "none"), "bob never reaches alice's chunks on disk"
        matched, source = ask(second, ALICE)
        assert matched > 0 and source == "disk"
    finally:
        second.stop()


def test_isolation_holds_through_redis(tmp_path: Path, redis_server, cache_secret_file) -> None:
    common = ("--ctx-size", "2048", "--cache-dir", "none", "--remote-cache", redis_server.url,
              "--cache-secret-file", str(cache_secret_file), "--api-keys", str(all_keys(tmp_path)))
    first = Served(*common, env=clean_env())
    second = Served(*common, env=clean_env())
    try:
        first.wait_ready()
        second.wait_ready()
        ask(first, ALICE)
        deadline = time.monotonic() + 60
        while not ((remote := admin_cache(first)["remote"])["writes"] and remote["pending_bytes"] == 0):
            assert time.monotonic() < deadline, f"never written to the shared tier: {remote}"
            time.sleep(0.1)
        assert ask(second, BOB) == (0, "none"), "bob never reaches alice's chunks on the shared tier"
        matched, source = ask(second, ALICE)
        assert matched > 0 and source == "remote"
    finally:
        first.stop()
        second.stop()


def test_a_key_revoked_by_sighup_is_refused_while_its_request_in_flight_finishes(tmp_path: Path) -> None:
    path = all_keys(tmp_path)
    server = Served("--ctx-size", "2048", "--cache-dir", "none", "--api-keys", str(path), env=clean_env())
    try:
        server.wait_ready()
        pieces: list[str] = []
        finished: list[str | None] = []

        def stream() -> None:
            chunks = client(server, ALICE).completions.create(
                model="skippy-cache", prompt="Write a long story about a lighthouse.", max_tokens=200,
                temperature=0, stream=True, logit_bias={"0": -100, "1": -100, "2": -100})  # no end of text
            for chunk in chunks:
                pieces.append(chunk.choices[0].text)
                finished.append(chunk.choices[0].finish_reason)

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 60
        while len(pieces) < 5:
            assert time.monotonic() < deadline and reader.is_alive(), "the stream never started"
            time.sleep(0.02)
        path.write_text(f"{hash_key(BOB)} bob user\n{hash_key(ROOT)} ops admin\n")
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while "key file" not in server.text:
            assert time.monotonic() < deadline, "no reload logged:\n" + server.text
            time.sleep(0.05)
        with pytest.raises(openai.AuthenticationError):
            client(server, ALICE).models.list()
        assert client(server, BOB).models.list().data
        reader.join(120)
        assert finished[-1] == "length" and len(pieces) >= 200, "the stream in flight was cut"
        # A bad file on the next SIGHUP keeps the keys in use, and says why.
        path.write_text("bob-only-two-fields bob\n")
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while "not reloaded" not in server.text:
            assert time.monotonic() < deadline, "no refusal logged:\n" + server.text
            time.sleep(0.05)
        assert f"{path}:1: expected" in server.text
        assert client(server, BOB).models.list().data
        assert server.proc.poll() is None
    finally:
        server.stop()
    for key in (ALICE, BOB, ROOT):
        assert key not in server.text, "a key reached the log"
