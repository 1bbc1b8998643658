"""Claude Code and Codex CLI, the clients people run, from npm (pinned in tests/clients), against a
live server on the default model: each runs a one-line prompt twice.

Checked: every request either client sends is answered (no 4xx: the fields and tool shapes they
send this month are accepted), the run ends, and the second run reuses its agent prompt (system
prompt and tools) from the cache. Codex must exit 0 with an answer, and so must Claude Code with
a short system prompt (`--bare`). A 135M model with greedy decoding past its 8,192-token training
context does not always end a reply to Claude Code's full ~12,000-token prompt, so that run may
instead stop on Claude Code's own output limit; that is the model, not the protocol, and is the
one other ending allowed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer, run_own_server

from skippy_cache.server import ServerSettings

pytestmark = [pytest.mark.model, pytest.mark.timeout(2400)]

BIN = Path(__file__).parents[1] / "clients" / "node_modules" / ".bin"
PROMPT = "Say hello."
#: Seconds one client run may take: a cold agent prompt is 9,000 to 12,000 tokens.
RUN_LIMIT = 1100


@pytest.fixture(scope="module")
def agent_server() -> Iterator[LiveServer]:
    # Greedy for requests that set no temperature (neither client sets one): the answer is the
    # same every run, not a draw that may ramble into the output limit.
    yield from run_own_server(ServerSettings(ctx_size=32768, lanes=2, queue_size=8, default_temperature=0.0))


def counters(server: LiveServer) -> dict[str, float]:
    """The server's request and prompt-token counters, from /metrics."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for name, labels, value in re.findall(r"^(skippy_\w+_total)(\{[^}]*\})? (\S+)$", text, re.MULTILINE):
        out[name + (labels or "")] = float(value)
    return out


def delta(before: dict[str, float], after: dict[str, float], prefix: str) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if k.startswith(prefix) and v != before.get(k, 0.0)}


def run_twice(server: LiveServer, command: list[str], env: dict[str, str], cwd: Path) -> list[tuple[
        subprocess.CompletedProcess, dict[str, float]]]:
    """The command run twice; each run with the counters it moved."""
    runs = []
    for _ in range(2):
        before = counters(server)
        done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=RUN_LIMIT,
                              stdin=subprocess.DEVNULL, check=False)
        runs.append((done, delta(before, counters(server), "skippy_")))
    return runs


def check_served_and_reused(runs: list[tuple[subprocess.CompletedProcess, dict[str, float]]],
                            endpoint: str) -> None:
    for done, moved in runs:
        statuses = {k: v for k, v in moved.items() if k.startswith("skippy_requests_total") and endpoint in k}
        assert statuses and all('status="200"' in k for k in statuses), (statuses, done.stdout, done.stderr)
    _, second = runs[1]
    prompt, cached = second["skippy_prompt_tokens_total"], second.get("skippy_cached_prompt_tokens_total", 0.0)
    # The agent prompt is nearly all of each request: a run that misses it reuses little.
    assert cached >= 0.8 * prompt, second


#: A model catalog entry (Codex's `model_catalog_json`) as users write one for a local model; with
#: `apply_patch_tool_type: freeform` Codex sends apply_patch as a custom tool with a Lark grammar.
CODEX_CATALOG = {"models": [{
    "slug": "skippy-cache", "display_name": "skippy-cache", "description": "A local model",
    "default_reasoning_level": "medium", "supported_reasoning_levels": [{"effort": "medium", "description": "medium"}],
    "shell_type": "shell_command", "visibility": "list", "supported_in_api": True, "priority": 0,
    "base_instructions": "You are a coding agent.", "supports_reasoning_summaries": False,
    "default_reasoning_summary": "none", "support_verbosity": False, "apply_patch_tool_type": "freeform",
    "truncation_policy": {"mode": "bytes", "limit": 10000}, "context_window": 32768, "max_context_window": 32768,
    "effective_context_window_percent": 95, "supports_parallel_tool_calls": False,
    "experimental_supported_tools": [], "input_modalities": ["text"]}]}


@pytest.mark.parametrize("catalog", [False, True], ids=["default-metadata", "catalog-freeform-apply-patch"])
def test_codex_cli_answers_twice_and_the_second_run_reuses_its_prompt(agent_server: LiveServer,
                                                                      tmp_path: Path, catalog: bool) -> None:
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    config = 'model = "skippy-cache"\nmodel_provider = "skippy"\n'
    if catalog:
        (home / ".codex" / "models.json").write_text(json.dumps(CODEX_CATALOG))
        config += f'model_catalog_json = {json.dumps(str(home / ".codex" / "models.json"))}\n'
    (home / ".codex" / "config.toml").write_text(
        config + '\n[model_providers.skippy]\nname = "skippy"\n'
        f'base_url = "{agent_server.url}/v1"\nwire_api = "responses"\nenv_key = "SKIPPY_KEY"\n')
    work = tmp_path / "work"
    work.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home / ".codex"), "SKIPPY_KEY": "x"}
    runs = run_twice(agent_server, [str(BIN / "codex"), "exec", "--skip-git-repo-check", PROMPT], env, work)
    for done, _ in runs:
        answer = done.stdout.strip()
        assert done.returncode == 0 and answer, (done.stdout, done.stderr)
    check_served_and_reused(runs, "/v1/responses")


def claude_env(server: LiveServer, home: Path) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "HOME": str(home), "ANTHROPIC_BASE_URL": server.url,
            "ANTHROPIC_AUTH_TOKEN": "x", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256", "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}


def test_claude_code_is_answered_twice_and_the_second_run_reuses_its_prompt(agent_server: LiveServer,
                                                                            tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    runs = run_twice(agent_server, [str(BIN / "claude"), "-p", PROMPT], claude_env(agent_server, tmp_path), work)
    for done, _ in runs:
        answered = done.returncode == 0 and done.stdout.strip()
        cut = "exceeded the 256 output token maximum" in done.stdout + done.stderr
        assert answered or cut, (done.returncode, done.stdout, done.stderr)
    check_served_and_reused(runs, "/v1/messages")


def test_claude_code_with_a_prompt_the_model_was_trained_for_answers_twice(agent_server: LiveServer,
                                                                           tmp_path: Path) -> None:
    """`--bare` with no tools and a one-line system prompt: a prompt of a few dozen tokens, which
    the default model answers and ends. Claude Code then sends its harness-context turn empty."""
    work = tmp_path / "work"
    work.mkdir()
    command = [str(BIN / "claude"), "-p", "--bare", "--tools", "", "--system-prompt",
               "You are a helpful assistant. Answer in one short sentence.", PROMPT]
    runs = run_twice(agent_server, command, claude_env(agent_server, tmp_path), work)
    for done, _ in runs:
        assert done.returncode == 0 and done.stdout.strip(), (done.returncode, done.stdout, done.stderr)
    check_served_and_reused(runs, "/v1/messages")
