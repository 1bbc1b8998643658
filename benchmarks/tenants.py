"""What one tenant can learn from another's cache, and what one tenant's flood costs another.

    .venv/bin/python benchmarks/tenants.py [--prompts 12] [--flood 12]

Starts `skippy-cache serve` (default settings, default model, no disk tier)
with a key file of two user tenants, alice and bob, then:

- timing: for each of `--prompts` new prompts (~600 tokens), alice sends it
  twice, then bob sends it once. Prints the TTFT p50 / p90 of alice's first
  (cold) and second (hit) requests and of bob's, and bob's cached tokens.
  Isolation holds when bob's TTFT is alice's cold one, not her hit.
- flood: alice sends `--flood` requests at once (`--tenant-max-requests`
  defaults to 16: pass --limit to change it) while bob sends one request
  per second for the duration. Prints alice's answered and refused (429)
  counts and bob's TTFT p50 / max against bob alone on an idle server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

from skippy_cache.server.tenants import hash_key

ALICE, BOB = "sk-bench-alice", "sk-bench-bob"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(keys: Path, limit: int | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = [sys.executable, "-m", "skippy_cache", "serve", "--port", str(port), "--api-keys", str(keys),
            "--cache-dir", "none"]
    if limit is not None:
        args += ["--tenant-max-requests", str(limit)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKIPPY_")}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.25)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def ttft(client: openai.AsyncOpenAI, prompt: str, max_tokens: int = 8) -> tuple[float, int]:
    """Seconds to the first streamed token, and the cached prompt tokens the request reports."""
    t0 = time.perf_counter()
    first = None
    cached = 0
    stream = await client.completions.create(model="skippy-cache", prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return (first if first is not None else time.perf_counter() - t0), cached


def text(i: int) -> str:
    return (f"Document {i} ({time.time_ns()}). " + "Tenants share a server but never a cache. " * 60
            + "What does it say?")


async def timing(url: str, prompts: int) -> None:
    alice = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=ALICE, max_retries=0, timeout=300)
    bob = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=BOB, max_retries=0, timeout=300)
    await ttft(alice, "warm up")
    cold, hit, other, bob_cached = [], [], [], []
    for i in range(prompts):
        prompt = text(i)
        cold.append((await ttft(alice, prompt))[0])
        hit.append((await ttft(alice, prompt))[0])
        seconds, cached = await ttft(bob, prompt)
        other.append(seconds)
        bob_cached.append(cached)
    print(f"timing, {prompts} prompts of ~600 tokens: TTFT p50 / p90 in ms")
    for name, values in (("alice cold", cold), ("alice again (hit)", hit), ("bob, same prompt", other)):
        print(f"  {name:<18} {statistics.median(values) * 1000:7.0f} / {pct(values, 0.9) * 1000:7.0f}")
    print(f"  bob's cached tokens: {sorted(set(bob_cached))}")
    print(f"  bob / alice cold (p50): {statistics.median(other) / statistics.median(cold):.2f}; "
          f"bob / alice hit: {statistics.median(other) / statistics.median(hit):.1f}")


async def flood(url: str, requests: int) -> None:
    alice = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=ALICE, max_retries=0, timeout=600)
    bob = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=BOB, max_retries=0, timeout=600)
    alone = [(await ttft(bob, f"Question {i}: name a colour.", 16))[0] for i in range(5)]

    async def ask(i: int) -> str:
        try:
            await alice.completions.create(model="skippy-cache", prompt=f"Flood {i}: " + "count on. " * 50,
                                           max_tokens=64, temperature=0)
            return "answered"
        except openai.RateLimitError:
            return "refused"
        except openai.APIStatusError as exc:
            return f"HTTP {exc.status_code}"

    t0 = time.perf_counter()
    tasks = [asyncio.create_task(ask(i)) for i in range(requests)]
    during = []
    while not all(t.done() for t in tasks):
        during.append((await ttft(bob, f"Question {len(during)}: name a colour.", 16))[0])
        await asyncio.sleep(max(0.0, 1.0 - during[-1]))
    outcomes = [t.result() for t in tasks]
    print(f"flood: alice sends {requests} at once ({time.perf_counter() - t0:.1f} s to drain)")
    print(f"  alice: {outcomes.count('answered')} answered, {outcomes.count('refused')} refused (429), "
          f"{len(outcomes) - outcomes.count('answered') - outcomes.count('refused')} other")
    print(f"  bob TTFT p50 / max in ms: alone {statistics.median(alone) * 1000:.0f} / {max(alone) * 1000:.0f}, "
          f"during the flood {statistics.median(during) * 1000:.0f} / {max(during) * 1000:.0f} "
          f"({len(during)} requests)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--flood", type=int, default=12)
    parser.add_argument("--limit", type=int, default=None, help="--tenant-max-requests (default: the server's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.txt"
        keys.write_text(f"{hash_key(ALICE)} alice user\n{hash_key(BOB)} bob user\n")
        proc, url = start(keys, args.limit)
        try:
            asyncio.run(timing(url, args.prompts))
            asyncio.run(flood(url, args.flood))
        finally:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
