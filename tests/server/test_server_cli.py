"""The README's run command as a subprocess: `python -m skippy_cache serve` answers, then SIGTERM exits 0;
what it stored on disk survives a SIGKILL.

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
from pathlib import Path

import httpx
import openai
import pytest
from metric_docs import undocumented

pytestmark = pytest.mark.timeout(300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env() -> dict[str, str]:
    """No SKIPPY_* from the developer's shell may change what the test runs."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SKIPPY_")}


class Served:
    """`python -m skippy_cache serve ARGS` as a subprocess, its output collected."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "skippy_cache", "serve", "--port", str(self.port), *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.log: list[str] = []
        self._reader = threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True)  # type: ignore[arg-type]
        self._reader.start()

    @property
    def text(self) -> str:
        return "".join(self.log)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 180
        while True:
            assert self.proc.poll() is None, "the server exited:\n" + self.text
            assert time.monotonic() < deadline, "the server never answered /health:\n" + self.text
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=120, max_retries=0)

    def cache(self) -> dict:
        return httpx.get(f"{self.url}/v1/cache", timeout=10).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._reader.join(10)


@pytest.mark.model
def test_serve_answers_then_drains_on_sigterm(tmp_path: Path) -> None:
    # The default disk tier lives under $XDG_CACHE_HOME: point it at a directory of the test's own.
    server = Served("--ctx-size", "2048", env={**clean_env(), "XDG_CACHE_HOME": str(tmp_path)})
    proc = server.proc
    try:
        server.wait_ready()
        client = server.client()
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
        assert proc.wait(timeout=120) == 0, server.text
    finally:
        server.stop()
    text = server.text
    # The one start-up block: model, pool, derived cache budgets, the store's tiers.
    for needle in ("skippy-cache server", "model ", "digest ", "n_ctx 2048", "lanes", "n_seq_max",
                   "mode lookup-record", "max entries 64", "token cap none", "reserved sequences 0..7",
                   "min_tokens 64", "stride 128", "record limit 2", "store     chunks of 64 tokens, evicted lrfu",
                   f"disk {tmp_path / 'skippy-cache'}", "weights   CPU_Mapped 92 MiB (",
                   "test decode passed in a child process", "chat template: GGUF tokenizer.chat_template"):
        assert needle in text, f"{needle!r} missing from the start-up log:\n{text}"
    # The test decode's verdict is remembered under the cache directory.
    assert list((tmp_path / "skippy-cache" / "weight-probes").glob("*.json"))


PROMPT = "Restart test. " + " ".join(f"Clause {i} of the agreement binds the parties." for i in range(60))


@pytest.mark.model
def test_reused_prefixes_survive_sigkill_and_a_second_server_on_the_dir_is_refused(tmp_path: Path) -> None:
    args = ("--ctx-size", "2048", "--cache-dir", str(tmp_path))
    first = Served(*args, env=clean_env())
    try:
        first.wait_ready()
        client = first.client()
        cold = client.completions.create(model="skippy-cache", prompt=PROMPT, max_tokens=1, temperature=0)
        n = cold.usage.prompt_tokens
        assert n > 512, n
        warm = client.completions.create(model="skippy-cache", prompt=PROMPT, max_tokens=1, temperature=0)
        assert warm.usage.prompt_tokens_details.cached_tokens == n
        # Reused once: the idle server exports it, and the store's writer puts its chunks on disk.
        deadline = time.monotonic() + 60
        while not ((store := first.cache()["store"])["pages"] >= 1 and store["pending"] == 0
                   and store["chunks"]["disk"]["chunks"] >= 3):
            assert time.monotonic() < deadline, f"never written to disk: {store}"
            time.sleep(0.1)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(30)
    finally:
        first.stop()

    second = Served(*args, env=clean_env())
    try:
        second.wait_ready()
        assert "found" in second.text and "chunks" in second.text
        again = second.client().completions.create(model="skippy-cache", prompt=PROMPT, max_tokens=1,
                                                    temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == n
        assert again.choices[0].text == cold.choices[0].text  # sampled from the stored logits
        counters = second.cache()["counters"]
        assert (counters["restores"], counters["disk_restores"]) == (1, 1)

        # A third server on the same directory refuses to start, and says why.
        out = subprocess.run(
            [sys.executable, "-m", "skippy_cache", "serve", "--port", str(free_port()), *args],
            env=clean_env(), capture_output=True, text=True, timeout=120,
        )
        assert out.returncode == 2, out.stdout + out.stderr
        assert str(tmp_path) in out.stderr and "--cache-dir" in out.stderr
    finally:
        second.stop()


def test_malformed_setting_exits_2_naming_it() -> None:
    out = subprocess.run([sys.executable, "-m", "skippy_cache", "serve", "--ctx-size", "lots"],
                         env=clean_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--ctx-size" in out.stderr


def serve_fails(*args: str) -> str:
    """`serve ARGS` must exit 2 with one line that says what is wrong, and no traceback; returns that line."""
    argv = [sys.executable, "-m", "skippy_cache", "serve", "--cache-dir", "none", *args]
    out = subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("skippy-cache serve: error: ")]
    assert len(errors) == 1, out.stderr
    return errors[0]


def test_missing_model_exits_2_naming_it() -> None:
    assert "--model /nonexistent/model.gguf: not found" in serve_fails("--model", "/nonexistent/model.gguf")


def test_a_directory_as_the_model_exits_2_naming_it(tmp_path: Path) -> None:
    assert f"--model {tmp_path}: is a directory" in serve_fails("--model", str(tmp_path))


@pytest.mark.parametrize("content", [b"hello, not a model\n", b"GGUF\x03\x00\x00\x00" + b"\x00" * 9],
                         ids=["text", "truncated"])
def test_a_file_that_is_not_a_gguf_exits_2_naming_it(tmp_path: Path, content: bytes) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(content)
    line = serve_fails("--model", str(model))
    assert f"--model {model}: not a GGUF model file" in line


@pytest.mark.model
def test_a_cache_dir_that_cannot_be_made_exits_2_naming_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    line = serve_fails("--cache-dir", str(tmp_path / "file" / "store"))
    assert f"--cache-dir {tmp_path / 'file' / 'store'}: cannot keep the disk tier there" in line
    assert "--cache-dir none" in line


@pytest.mark.model
def test_a_cache_dir_other_users_can_write_exits_2_naming_it(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    line = serve_fails("--cache-dir", str(shared))
    assert f"cache directory {shared} is writable by other users (mode 0777)" in line
    assert f"chmod 700 {shared}" in line and "--cache-dir" in line
    assert not (shared / "lock").exists() and not (shared / "v1").exists()


@pytest.mark.model
def test_a_shared_tier_without_a_shared_secret_exits_2_naming_the_setting() -> None:
    # Each replica's own secret would fail every chunk another wrote: the tier would share nothing.
    line = serve_fails("--remote-cache", "redis://127.0.0.1:1")
    assert "--remote-cache needs --cache-secret-file" in line and "openssl rand -hex 32" in line


@pytest.mark.model
def test_a_cache_dir_keeps_its_secret_across_restarts(tmp_path: Path) -> None:
    # Chunks on disk verify after a restart only if the secret they were sealed with is still there.
    cache = tmp_path / "cache"
    texts = []
    for _ in range(2):
        server = Served("--ctx-size", "2048", "--cache-dir", str(cache), env=clean_env())
        try:
            server.wait_ready()
        finally:
            server.stop()
        assert (cache / "secret").stat().st_mode & 0o777 == 0o600
        texts.append((cache / "secret").read_text())
    assert texts[0] == texts[1] and len(texts[0].strip()) == 64


@pytest.mark.parametrize(("mode", "words"), [(0o644, "is open to other users (mode 0644)"),
                                             (0o600, "needs at least 32 bytes")])
def test_an_unsafe_or_short_secret_file_exits_2_naming_it(tmp_path: Path, mode: int, words: str) -> None:
    path = tmp_path / "secret"
    path.write_text("short\n" if mode == 0o600 else "x" * 64)
    path.chmod(mode)
    line = serve_fails("--cache-secret-file", str(path))
    assert "--cache-secret-file" in line and str(path) in line and words in line


def test_a_port_in_use_exits_2_before_the_model_loads() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert f"--port {port}: 127.0.0.1:{port} is already in use" in serve_fails("--port", str(port))


def test_an_unknown_host_exits_2_naming_it() -> None:
    assert "--host no-such-host.invalid: not an address of this machine" in serve_fails(
        "--host", "no-such-host.invalid")


def test_a_config_file_that_is_a_directory_exits_2_naming_it(tmp_path: Path) -> None:
    assert f"config file {tmp_path}: cannot read it" in serve_fails("--config", str(tmp_path))


def test_a_missing_tls_ca_file_exits_2_naming_it(tmp_path: Path) -> None:
    line = serve_fails("--remote-cache", "rediss://127.0.0.1:1", "--remote-cache-tls-ca", str(tmp_path / "ca.pem"))
    assert f"--remote-cache-tls-ca {tmp_path / 'ca.pem'}: cannot read it" in line


@pytest.mark.model
def test_a_builtin_chat_template_serves_chat_and_is_named_at_start() -> None:
    server = Served("--ctx-size", "2048", "--cache-dir", "none", "--chat-template", "gemma", env=clean_env())
    try:
        server.wait_ready()
        client = server.client()
        question = " ".join(["Tell me about the weather in the mountains in early spring, please."] * 6)
        out = client.chat.completions.create(
            model="skippy-cache", messages=[{"role": "user", "content": question}], max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason in ("stop", "length")
        # The chat's prompt was llama.cpp's gemma rendering: the same text as a completion is the
        # same tokens, an exact repeat of the chat's prompt, served whole from the cache.
        raw = client.completions.create(
            model="skippy-cache", prompt=f"<start_of_turn>user\n{question}<end_of_turn>\n<start_of_turn>model\n",
            max_tokens=1, temperature=0)
        assert raw.usage.prompt_tokens == out.usage.prompt_tokens
        assert raw.usage.prompt_tokens_details.cached_tokens == raw.usage.prompt_tokens
    finally:
        server.stop()
    assert "chat template: llama.cpp built-in 'gemma' (--chat-template)" in server.text


def test_an_unknown_chat_template_exits_2_naming_the_choices() -> None:
    line = serve_fails("--chat-template", "gemmaa")
    assert "--chat-template='gemmaa' is neither a Jinja file nor one of llama.cpp's built-in templates" in line
    assert "gemma, " in line


def test_a_malformed_weight_repack_exits_2_naming_it() -> None:
    assert "--weight-repack='always'" in serve_fails("--weight-repack", "always")


def test_help_explains_every_option() -> None:
    out = subprocess.run([sys.executable, "-m", "skippy_cache", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    for flag in ("--model", "--host", "--port", "--ctx-size", "--lanes", "--cache-mode", "--max-entries",
                 "--max-bytes", "--min-tokens", "--stride", "--record-limit", "--api-key", "--queue-size",
                 "--fast", "--config"):
        assert flag in out.stdout


SHARED = "Shared tier test. " + " ".join(f"Rule {i} of the house applies to every guest." for i in range(60))


@pytest.mark.model
def test_two_servers_on_one_redis_share_a_prefix(tmp_path: Path, redis_with_password, cache_secret_file) -> None:
    # One server has the password in its URL, the other reads it from a file; neither logs it.
    password_file = tmp_path / "redis-password"
    password_file.write_text("s3cret-pw\n")
    bare = redis_with_password.url.replace(":s3cret-pw@", "")
    common = ("--ctx-size", "2048", "--cache-dir", "none", "--cache-secret-file", str(cache_secret_file))
    first = Served(*common, "--remote-cache", redis_with_password.url, env=clean_env())
    second = Served(*common, "--remote-cache", bare, "--remote-cache-password-file", str(password_file),
                    env=clean_env())
    try:
        first.wait_ready()
        second.wait_ready()
        cold = first.client().completions.create(model="skippy-cache", prompt=SHARED, max_tokens=1,
                                                 temperature=0)
        n = cold.usage.prompt_tokens
        assert n > 512, n
        # The first server shares its new entry at once; wait until its writer sent every chunk of it
        # (the chunks before the last prompt token, and the tail with the rest and the logits).
        chunks = (n - 1) // first.cache()["budgets"]["chunk_tokens"] + 1
        deadline = time.monotonic() + 60
        while not ((remote := first.cache()["remote"])["writes"] >= chunks and remote["pending_bytes"] == 0):
            assert time.monotonic() < deadline, f"never written to the shared tier: {remote}"
            time.sleep(0.1)

        again = second.client().completions.create(model="skippy-cache", prompt=SHARED, max_tokens=1,
                                                   temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == n
        said = again.model_extra["skippy_cache"]
        assert said["source"] == "remote" and said["matched_tokens"] == n
        assert again.choices[0].text == cold.choices[0].text  # sampled from the stored logits
        report = second.cache()
        assert report["remote"]["up"] and report["remote"]["hits"] == chunks
        assert report["counters"]["remote_restores"] == 1
        metrics = httpx.get(f"{second.url}/metrics", timeout=10).text
        assert f"skippy_remote_hits_total {chunks}.0" in metrics
        assert "skippy_remote_round_trip_seconds_bucket" in metrics
        assert not undocumented(metrics), "add them to the metrics table of docs/serving/endpoints.md"
    finally:
        first.stop()
        second.stop()
    for server in (first, second):
        assert "s3cret" not in server.text, "a credential reached the log"
        assert f"shared redis://127.0.0.1:{redis_with_password.port}/0" in server.text


@pytest.mark.model
@pytest.mark.parametrize("mode", [(), ("--fast",)], ids=["exact", "fast"])
def test_a_chat_turn_on_another_server_reuses_the_previous_reply(
    redis_server, cache_secret_file, mode: tuple[str, ...]
) -> None:
    # Behind a round-robin balancer a chat's next turn lands on the other replica: it reuses the
    # history up to where the reply it resends ended, not only up to the last whole chunk.
    common = ("--ctx-size", "2048", "--cache-dir", "none", "--remote-cache", redis_server.url,
              "--cache-secret-file", str(cache_secret_file), *mode)
    first, second = Served(*common, env=clean_env()), Served(*common, env=clean_env())
    try:
        first.wait_ready()
        second.wait_ready()
        messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": "Name one rule."}]
        turn = first.client().chat.completions.create(model="skippy-cache", messages=messages, max_tokens=12,
                                                      temperature=0)
        assert turn.choices[0].finish_reason == "length"
        # Cut at max_tokens: the entry holds the prompt and every reply token but the last.
        held = turn.usage.prompt_tokens + turn.usage.completion_tokens - 1
        assert held % first.cache()["budgets"]["chunk_tokens"]
        messages += [{"role": "assistant", "content": turn.choices[0].message.content},
                     {"role": "user", "content": "And another?"}]
        # The request ended once its state was on the shared tier: no wait here.
        nxt = second.client().chat.completions.create(model="skippy-cache", messages=messages, max_tokens=1,
                                                      temperature=0)
        said = nxt.model_extra["skippy_cache"]
        assert (said["source"], said["matched_tokens"]) == ("remote", held), said
    finally:
        first.stop()
        second.stop()


@pytest.mark.model
@pytest.mark.parametrize("mode", [(), ("--fast",)], ids=["exact", "fast"])
def test_a_system_prompt_another_server_computed_is_restored_to_its_end(
    redis_server, cache_secret_file, mode: tuple[str, ...]
) -> None:
    # Users of one system prompt ask their own questions, round-robin over two replicas. The
    # second replica restores the system prompt to its end, not only to the last whole chunk.
    common = ("--ctx-size", "2048", "--cache-dir", "none", "--remote-cache", redis_server.url,
              "--cache-secret-file", str(cache_secret_file), *mode)
    first, second = Served(*common, env=clean_env()), Served(*common, env=clean_env())
    try:
        first.wait_ready()
        second.wait_ready()

        def ask(server: Served, question: str) -> dict:
            messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": question}]
            answer = server.client().chat.completions.create(model="skippy-cache", messages=messages,
                                                             max_tokens=1, temperature=0)
            return {**answer.model_extra["skippy_cache"], "prompt_tokens": answer.usage.prompt_tokens}

        ask(first, "Name one rule.")
        said = ask(second, "Which rule matters most?")
        chunk = second.cache()["budgets"]["chunk_tokens"]
        assert said["source"] == "remote" and said["matched_tokens"] % chunk, said
        # Past the system message: the user turn's few template tokens and the question.
        assert said["prompt_tokens"] - said["matched_tokens"] < 16, said
    finally:
        first.stop()
        second.stop()
