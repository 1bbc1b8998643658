"""The llama-server peer: how the bench finds and starts it, and the targets it is checked against.

No llama-server is built or run here (that takes minutes and a compiler); the command line, the
binary lookup and the target arithmetic are plain functions.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from rich.console import Console

from skippy_cache.bench import plainpeer
from skippy_cache.bench.llamaserver import ENV, LlamaServerError, find_llama_server
from skippy_cache.bench.run import FULL
from skippy_cache.bench.summary import Figure, goals
from skippy_cache.bench.targets import LLAMA_SERVER, SKIPPY, server_command


def executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_llama_server_runs_four_slots_over_one_unified_pool(tmp_path: Path) -> None:
    binary = executable(tmp_path / "llama-server")
    cmd = server_command(LLAMA_SERVER, 8090, Path("/m.gguf"), 8192, binary)
    assert cmd[0] == str(binary)
    joined = " ".join(cmd)
    for part in ("-m /m.gguf", "-c 8192", "-np 4", "--kv-unified", "--host 127.0.0.1", "--port 8090"):
        assert part in joined


def test_every_started_server_gets_one_weight_layout(tmp_path: Path) -> None:
    """Repacked weights run other kernels: the peer repacks exactly when skippy-cache does."""
    binary = executable(tmp_path / "llama-server")
    plain = server_command(LLAMA_SERVER, 8090, Path("/m.gguf"), 8192, binary, repack=False)
    assert plain[-1] == "--no-repack"
    assert "--no-repack" not in server_command(LLAMA_SERVER, 8090, Path("/m.gguf"), 8192, binary, repack=True)
    for repack, word in ((False, "off"), (True, "on")):
        ours = server_command(SKIPPY, 8091, Path("/m.gguf"), 8192, repack=repack)
        assert ours[ours.index("--weight-repack") + 1] == word
    # llama-cpp-python's server has no setting for it: it runs through plainpeer, which loads plain weights.
    assert server_command("llama-cpp-python", 8092, Path("/m.gguf"), 8192, repack=True)[2] == "llama_cpp.server"
    assert server_command("llama-cpp-python", 8092, Path("/m.gguf"), 8192, repack=False)[2] == \
        "skippy_cache.bench.plainpeer"
    assert plainpeer._plain_weight_params().use_extra_bufts is False
    assert plainpeer._default_params().use_extra_bufts is True  # llama.cpp's default, which it overrides


def test_binary_lookup_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    explicit = executable(tmp_path / "explicit")
    from_env = executable(tmp_path / "from-env")
    monkeypatch.setenv(ENV, str(from_env))
    console = Console(quiet=True)
    assert find_llama_server(explicit, tmp_path, console) == explicit
    assert find_llama_server(None, tmp_path, console) == from_env
    monkeypatch.setenv(ENV, str(tmp_path / "missing"))
    with pytest.raises(LlamaServerError, match="not an executable"):
        find_llama_server(None, tmp_path, console)


def _figs(ours: dict[str, float], theirs: dict[str, float]) -> list[Figure]:
    return [
        Figure(workload, name, "", "", {"skippy-cache": ours[key], LLAMA_SERVER: theirs[key]})
        for key, (workload, name) in {
            "t1": ("chat", "turn 1: TTFT p50"),
            "t2": ("chat", "turn 2: TTFT p50"),
            "share": ("chat", "all turns: cached share"),
            "p90": ("tenants", "later rounds: TTFT p90"),
            "zero": ("zero", "requests per second"),
        }.items()
    ]


def test_targets_against_llama_server() -> None:
    ours = {"t1": 1000.0, "t2": 400.0, "share": 80.0, "p90": 600.0, "zero": 0.9}
    theirs = {"t1": 1000.0, "t2": 900.0, "share": 79.0, "p90": 1100.0, "zero": 1.0}
    checks = {g.name: g.met for g in goals(_figs(ours, theirs), FULL, "skippy-cache", None, [LLAMA_SERVER])}
    assert checks["chat turn 1 TTFT p50 vs llama-server"] is True  # at most equal on turn 1
    assert checks["chat turn 2 TTFT p50 vs llama-server"] is True  # at most half on later turns
    assert checks["chat cached share vs llama-server"] is True
    assert checks["tenants later-round p90 vs llama-server"] is False  # 600 > 1100 / 2
    assert checks["zero throughput vs llama-server"] is False
    # Without llama-server in the run, none of its targets is listed.
    assert not any("llama-server" in g.name for g in goals(_figs(ours, theirs), FULL, "skippy-cache", None, []))


def test_the_reference_is_never_its_own_peer() -> None:
    # `--no-skippy --url a=... --url b=...`: both are URL targets, so both are in the peer list.
    size = max(FULL.warm_prompt_tokens)
    figs = [Figure("warm", f"P={size}: cold TTFT", "ms", "lower", {"a": 1000.0, "b": 1000.0}),
            Figure("warm", f"P={size}: warm TTFT median", "ms", "lower", {"a": 10.0, "b": 15.0})]
    checks = {g.name: g for g in goals(figs, FULL, "a", None, ["a", "b"])}
    assert checks[f"warm P={size}: warm hit vs fastest peer"].got == "0.67x"  # not 1.00x against itself
