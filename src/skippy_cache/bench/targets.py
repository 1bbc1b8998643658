"""The servers a run measures: ones the bench starts (skippy-cache, its cache-off twin, the
llama-cpp-python and llama-server peers) and ones already running (`--url LABEL=URL`).

A server that fails to start is not fatal: its `Target` carries the error and every request to
it fails fast, so the report shows it as failures instead of the run stopping.

Every server the bench starts gets one weight layout (`weight_layout`): skippy-cache's choice on
this CPU, passed to it as `--weight-repack on|off` and to llama-server as `--no-repack` when it is
off, and to llama-cpp-python's server through `plainpeer.py`. Repacked weights run other matmul
kernels, so a peer repacking what we do not would measure kernels, not caches.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from skippy_cache.runtime import WeightLayout, available_cores, read_gguf_info
from skippy_cache.weights import WeightRepack

#: Labels of the servers the bench starts; "skippy-cache" is the reference of every ratio.
SKIPPY = "skippy-cache"
SKIPPY_OFF = "skippy-cache (cache off)"
PEERS = {
    # llama-cpp-python's server as shipped, except: threads match skippy-cache's (its default
    # generation thread count is cores // 2), and `--interrupt_requests False`: by default a
    # request arriving while another streams cuts that stream short after its next chunk, which
    # under C = 4 clients ends chat streams before their first content token.
    "llama-cpp-python": [],
    # The same with its RAM prompt cache on: it saves the whole state after each request and
    # restores the longest cached prefix, the nearest thing it has to skippy-cache's reuse.
    "llama-cpp-python-cache": ["--cache", "True"],
}
#: llama.cpp's own server (llamaserver.py finds or builds the binary).
LLAMA_SERVER = "llama-server"
#: The same with each of its 4 slots on its own stream of n_ctx / 4 cells (no --kv-unified):
#: attention then walks only the slot's own cells, which made it faster on some workloads.
LLAMA_SERVER_SPLIT = "llama-server-split"
LLAMA_SERVERS = (LLAMA_SERVER, LLAMA_SERVER_SPLIT)
PEER_KINDS = (*PEERS, *LLAMA_SERVERS)
STARTUP_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """What to measure: `kind` is "skippy-cache", "skippy-cache-off", a PEER_KINDS entry, or "url"."""

    label: str
    kind: str
    url: str | None = None


@dataclass(slots=True)
class Target:
    """A server being measured. `error` set: it never became ready (its requests fail fast)."""

    label: str
    kind: str
    url: str
    command: list[str] | None = None
    log_path: Path | None = None
    #: Set once, by `running_targets`: why the server is not answering (None: it answered).
    error: str | None = None
    #: The first id of its /v1/models, sent as each request's "model" (None: send none).
    model_id: str | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def describe(self) -> dict[str, object]:
        return {
            "label": self.label,
            "kind": self.kind,
            "url": self.url,
            "command": self.command,
            "log": str(self.log_path) if self.log_path else None,
            "error": self.error,
            "model_id": self.model_id,
        }


def parse_url_option(value: str) -> TargetSpec:
    """`LABEL=URL` or a bare URL (labelled by its host:port)."""
    label, sep, url = value.partition("=")
    if not sep or label.startswith(("http://", "https://")):
        url, label = value, value.split("://", 1)[-1].rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url {value!r}: expected LABEL=http://HOST:PORT")
    return TargetSpec(label=label.strip(), kind="url", url=url.rstrip("/").removesuffix("/v1"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weight_layout(model: Path) -> WeightLayout:
    """The layout skippy-cache's `auto` gives `model` on this CPU (checked in a child process, as a server does)."""
    from skippy_cache.runtime.weightprobe import layout_for

    return layout_for(read_gguf_info(model), WeightRepack.AUTO, cache_dir=None)


def server_command(
    kind: str, port: int, model: Path, ctx_size: int, llama_server: Path | None = None,
    store_dir: Path | None = None, *, repack: bool = True, chunk_tokens: int | None = None,
) -> list[str]:
    """How the bench starts a server; skippy-cache keeps its disk tier in `store_dir` (None: no disk tier)
    and, when given, stores chunks of `chunk_tokens` tokens.

    `repack`: whether the weights are repacked (`weight_layout`). llama-cpp-python's server cannot
    be told, so without repacking it runs through `plainpeer`.
    """
    if kind in ("skippy-cache", "skippy-cache-off"):
        cmd = [
            sys.executable,
            "-m",
            "skippy_cache",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--ctx-size",
            str(ctx_size),
            "--model",
            str(model),
            "--log-level",
            "warning",
            "--cache-dir",
            str(store_dir) if store_dir is not None and kind == "skippy-cache" else "none",
            "--weight-repack",
            "on" if repack else "off",
        ]
        if chunk_tokens is not None:
            cmd += ["--chunk-tokens", str(chunk_tokens)]
        return cmd + (["--cache-mode", "off"] if kind == "skippy-cache-off" else [])
    threads = str(available_cores())
    if kind in LLAMA_SERVERS:
        assert llama_server is not None, "the llama-server peer needs its binary (find_llama_server)"
        # As users run it for 4 concurrent clients: 4 slots over one unified pool of ctx_size
        # cells (without --kv-unified each slot gets ctx_size / 4), as many threads as skippy-cache.
        # --jinja: the GGUF's chat template through its Jinja engine, which tool calls need.
        unified = ["--kv-unified"] if kind == LLAMA_SERVER else []
        return [str(llama_server), "-m", str(model), "-c", str(ctx_size), "-np", "4", *unified, "--jinja",
                "-t", threads, "--host", "127.0.0.1", "--port", str(port), *([] if repack else ["--no-repack"])]
    return [
        sys.executable,
        "-m",
        "llama_cpp.server" if repack else "skippy_cache.bench.plainpeer",
        "--model",
        str(model),
        "--n_ctx",
        str(ctx_size),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        threads,
        "--n_threads_batch",
        threads,
        "--interrupt_requests",
        "False",
        "--verbose",
        "False",
        *PEERS[kind],
    ]


def _clean_env() -> dict[str, str]:
    """No SKIPPY_* from the user's shell may change the servers the bench compares."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SKIPPY_")}


def _tail(path: Path | None, lines: int = 8) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _wait_ready(target: Target, deadline: float) -> str | None:
    """Poll until the server answers; the error text if it exits or the deadline passes first.

    A `--url` server is asked once: it is already running or it is not.
    """
    # skippy-cache answers /health once its engine is up; llama-cpp-python loads its model before
    # it listens, so /v1/models answering means ready (and every OpenAI-compatible server has it).
    path = "/health" if target.kind.startswith("skippy") else "/v1/models"
    while time.monotonic() < deadline:
        if target.process is not None and target.process.poll() is not None:
            return f"exited with code {target.process.returncode}: {_tail(target.log_path)}"
        try:
            if httpx.get(target.url + path, timeout=5).status_code == 200:
                return None
        except httpx.HTTPError as exc:
            if target.process is None:
                return f"{type(exc).__name__}: {exc}"
        if target.process is None:
            return f"GET {path} did not answer 200"
        time.sleep(0.25)
    return f"not ready after {STARTUP_TIMEOUT_S:g} s: {_tail(target.log_path)}"


def _model_id(url: str) -> str | None:
    try:
        data = httpx.get(url + "/v1/models", timeout=10).json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return data[0].get("id") if data and isinstance(data[0], dict) else None


def stop(target: Target) -> None:
    """SIGTERM (the server drains and exits), SIGKILL if it is still running 30 s later."""
    proc = target.process
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def launch(label: str, kind: str, command: list[str], log_path: Path, port: int) -> Target:
    """Start one server in the background (its output to `log_path`); `wait_ready` waits for it."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_clean_env()
        )
    return Target(label, kind, f"http://127.0.0.1:{port}", command, log_path, process=proc)


def wait_ready(targets: list[Target]) -> None:
    """Wait for every target (one shared deadline, so servers starting together load in parallel);
    sets each one's `error` or `model_id`."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    for target in targets:
        target.error = _wait_ready(target, deadline)
        if target.error is None:
            target.model_id = _model_id(target.url)


@contextmanager
def running_targets(
    specs: list[TargetSpec], *, model: Path, ctx_size: int, log_dir: Path, llama_server: Path | None = None,
    chunk_tokens: int | None = None,
) -> Iterator[list[Target]]:
    """Start every server the specs ask for (all at once, then wait for each), stop them on exit;
    skippy-cache with chunks of `chunk_tokens` when given."""
    targets: list[Target] = []
    started = [spec for spec in specs if spec.kind != "url"]
    repack = weight_layout(model).use_extra_bufts if started else True
    try:
        for spec in specs:
            if spec.kind == "url":
                assert spec.url, f"url target {spec.label!r} has no URL (parse_url_option builds these)"
                targets.append(Target(spec.label, spec.kind, spec.url))
                continue
            port = free_port()
            log_dir.mkdir(parents=True, exist_ok=True)
            # A fresh disk tier per run: a store kept from an earlier run has seen this run's prompts.
            store_dir = Path(tempfile.mkdtemp(prefix="store-", dir=log_dir)) if spec.kind == "skippy-cache" else None
            command = server_command(spec.kind, port, model, ctx_size, llama_server, store_dir, repack=repack,
                                     chunk_tokens=chunk_tokens)
            targets.append(launch(spec.label, spec.kind, command, log_dir / f"{spec.kind}.log", port))
        wait_ready(targets)
        yield targets
    finally:
        for target in targets:
            stop(target)
        for store_dir in log_dir.glob("store-*"):
            shutil.rmtree(store_dir, ignore_errors=True)
