"""Claude Code and Codex CLI against a live server: what a repeated run costs against the first.

    make clients && .venv/bin/python benchmarks/agent_clients.py [--rounds N] [-- SERVE ARGS...]

Starts `skippy-cache serve` (ctx 32768, greedy by default, plus SERVE ARGS), then per client runs
its one-line prompt `--rounds` + 1 times, the first cold. For each run prints its wall time, the
requests it sent, their prompt and cached tokens, and the mean time to first token over its
requests (from the server's own TTFT histogram), then the ratio of the first run's TTFT to the
median of the repeated runs'. The clients come from tests/clients (pinned).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / "tests" / "clients" / "node_modules" / ".bin"
PROMPT = "Say hello."


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.findall(r"^(skippy_(?:requests_total\{[^}]*\}|prompt_tokens_total|cached_prompt_tokens_total|"
                       r"time_to_first_token_seconds_(?:sum|count))) (\S+)$", text, re.MULTILINE)
    return {name: float(value) for name, value in found}


def codex(url: str, home: Path) -> tuple[list[str], dict[str, str]]:
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text(
        'model = "skippy-cache"\nmodel_provider = "skippy"\n\n[model_providers.skippy]\nname = "skippy"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "SKIPPY_KEY"\n')
    env = {"HOME": str(home), "CODEX_HOME": str(home / ".codex"), "SKIPPY_KEY": "x"}
    return [str(BIN / "codex"), "exec", "--skip-git-repo-check", PROMPT], env


def claude(url: str, home: Path) -> tuple[list[str], dict[str, str]]:
    env = {"HOME": str(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_AUTH_TOKEN": "x",
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256", "DISABLE_TELEMETRY": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}
    return [str(BIN / "claude"), "-p", PROMPT], env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="repeated runs after the first (default 2)")
    parser.add_argument("--clients", default="codex,claude")
    parser.add_argument("serve", nargs="*", help="extra `skippy-cache serve` arguments (after --)")
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        server = subprocess.Popen([sys.executable, "-m", "skippy_cache", "serve", "--port", str(port),
                                   "--ctx-size", "32768", "--default-temperature", "0",
                                   "--cache-dir", str(Path(tmp) / "cache"), *args.serve],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    sys.exit("the server did not start")
                time.sleep(0.5)
            print(f"{'client':8} {'run':>3} {'rc':>3} {'wall s':>8} {'requests':>8} {'prompt':>8} {'cached':>8} "
                  f"{'TTFT s':>8}")
            for name in args.clients.split(","):
                command, env = {"codex": codex, "claude": claude}[name](url, Path(tmp) / name)
                work = Path(tmp) / f"{name}-work"
                work.mkdir()
                ttfts = []
                for k in range(args.rounds + 1):
                    before = counters(url)
                    start = time.monotonic()
                    done = subprocess.run(command, env={**os.environ, **env}, cwd=work, capture_output=True,
                                          text=True, stdin=subprocess.DEVNULL, check=False)
                    wall = time.monotonic() - start
                    moved = {key: value - before.get(key, 0.0) for key, value in counters(url).items()}
                    requests = moved["skippy_time_to_first_token_seconds_count"]
                    ttft = moved["skippy_time_to_first_token_seconds_sum"] / max(requests, 1)
                    ttfts.append(ttft)
                    print(f"{name:8} {k + 1:>3} {done.returncode:>3} {wall:>8.1f} {requests:>8.0f} "
                          f"{moved['skippy_prompt_tokens_total']:>8.0f} "
                          f"{moved.get('skippy_cached_prompt_tokens_total', 0):>8.0f} {ttft:>8.2f}", flush=True)
                warm = statistics.median(ttfts[1:])
                print(f"{name:8} first run's mean TTFT / repeated runs' median: {ttfts[0]:.2f} / {warm:.2f} = "
                      f"{ttfts[0] / warm:.1f}x")
        finally:
            server.terminate()
            server.wait(30)


if __name__ == "__main__":
    main()
