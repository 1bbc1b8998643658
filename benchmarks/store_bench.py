"""The state store's figures: restart, dedup, restore vs prefill, partial restore.

    .venv/bin/python benchmarks/store_bench.py [--runs 5] [--model PATH]

1. Restart: a live server (`serve --cache-dir DIR`) answers a 2,000-token prompt
   cold, then warm (a resident hit, which marks it worth keeping); once its
   chunks are on disk the server is killed with SIGKILL and restarted on the
   same directory, and the prompt is sent again. Request time with max_tokens 1
   (time to first token plus one HTTP round trip), medians over --runs prompts.
2. Dedup: 8 tenants x a 600-token system prompt with distinct questions, 3
   rounds; and a 6-turn chat: every entry leaves the pool for the store. Bytes
   held vs the sum of whole-entry payloads (what a store of whole states holds).
3. Restore vs prefill per 1,000 tokens, from RAM and from disk.
4. Partial restore: 300 tokens of a 2,000-token entry: bytes read vs the entry.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.requests import GenerationRequest

WORDS = ["system", "assistant", "policy", "user", "tool", "answer", "question", "context", "memory", "river",
         "garden", "planet", "number", "letter", "window", "silver", "engine", "careful", "summary", "document"]


def text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def tokens(engine: Engine, n: int, seed: int) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        out += engine.tokenize(" " + text(300, seed + len(out)), add_special=False)
    return out[:n]


# -- 1. restart ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cache_dir: Path, model: Path | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # Fast mode, as the README's figures from this script were measured.
    cmd = [sys.executable, "-m", "skippy_cache", "serve", "--fast", "--port", str(port),
           "--cache-dir", str(cache_dir), "--log-level", "warning"]
    cmd += ["--model", str(model)] if model else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKIPPY_")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.2)


def timed(url: str, prompt: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0},
                   timeout=300)
    ms = (time.perf_counter() - t0) * 1000
    r.raise_for_status()
    return ms, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def on_disk(url: str, pages: int) -> None:
    deadline = time.monotonic() + 120
    while True:
        store = httpx.get(f"{url}/v1/cache", timeout=10).json()["store"]
        if store["pages"] >= pages and store["pending"] == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"not stored: {store}")
        time.sleep(0.1)


def restart(runs: int, model: Path | None) -> None:
    prompts = [text(1840, seed=100 + i) for i in range(runs)]  # about 2,000 tokens each
    cold, warm, after, cached = [], [], [], []
    with tempfile.TemporaryDirectory() as d:
        proc, url = start(Path(d), model)
        for i, p in enumerate(prompts):
            ms, _ = timed(url, p)
            cold.append(ms)
            ms, _ = timed(url, p)
            warm.append(ms)
            on_disk(url, i + 1)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc, url = start(Path(d), model)
        for p in prompts:
            ms, hit = timed(url, p)
            after.append(ms)
            cached.append(hit)
        proc.terminate()
        proc.wait(60)
    c, w, a = (statistics.median(x) for x in (cold, warm, after))
    print(f"1. restart ({runs} prompts of ~2,000 tokens; request time with max_tokens 1, medians)")
    print(f"   cold {c:,.1f} ms   warm resident {w:,.1f} ms   after SIGKILL + restart {a:,.1f} ms "
          f"(cached {min(cached)}..{max(cached)} tokens)")
    print(f"   after restart = 1/{c / a:,.0f} of cold, {a / w:.1f}x warm resident\n")


# -- 2-4. in-process -----------------------------------------------------------------------------


def run(engine: Engine, toks: list[int], max_tokens: int = 1):
    return engine.generate(GenerationRequest(tokens=toks, max_tokens=max_tokens))


def settle(engine: Engine) -> None:
    """Reused entries exported (the engine does it when idle), every entry out of the pool into the
    store, and the writer done."""
    while engine.call(lambda: engine.cache.persist_left):
        time.sleep(0.02)
    engine.call(engine.cache.drop_resident)
    assert engine.cache.store is not None and engine.cache.store.drain(120)


def dedup(model: Path | None, chunk_tokens: int) -> None:
    print(f"2. dedup (every entry leaves the pool for the store; chunks of {chunk_tokens} tokens)")
    for name in ("tenants", "chat"):
        engine = Engine(EngineConfig(model_path=model, deterministic=False, host_cache_bytes=4 << 30,
                                     chunk_tokens=chunk_tokens))
        try:
            if name == "tenants":
                systems = [tokens(engine, 600, 1000 + k) for k in range(8)]
                for r in range(3):
                    for k, system in enumerate(systems):
                        run(engine, system + tokens(engine, 16, 5000 + 100 * r + k))
                        settle(engine)
            else:
                history = tokens(engine, 150, 7000)
                for turn in range(6):
                    history += tokens(engine, 60, 7100 + turn)
                    done = run(engine, history, max_tokens=24)
                    history += list(done.tokens)
                    settle(engine)
            chunks = engine.stats().cache.store.chunks
            whole = chunks.logical_bytes
            print(f"   {name:8} whole-entry payloads {whole / 2**20:8.1f} MiB, held {chunks.physical_bytes / 2**20:7.1f}"
                  f" MiB: {chunks.dedup_ratio:.1f}x less ({engine.stats().cache.store.pages} entries)")
        finally:
            engine.close()
    print()


def restore_vs_prefill(runs: int, model: Path | None) -> None:
    print("3. restore vs prefill, per 1,000 tokens (medians; 2,000-token prompts)")
    with tempfile.TemporaryDirectory() as d:
        for tier, cfg in (("RAM", dict(host_cache_bytes=4 << 30)),
                          ("disk", dict(host_cache_bytes=0, cache_dir=Path(d), disk_reserve_bytes=0))):
            engine = Engine(EngineConfig(model_path=model, deterministic=False, **cfg))
            try:
                prefill, restore = [], []
                for i in range(runs):
                    p = tokens(engine, 2001, 9000 + i)
                    cold = run(engine, p)
                    prefill.append(cold.stats.ttft_ms / 2)
                    run(engine, p)  # a resident hit: worth keeping (to disk too)
                    settle(engine)
                    before = engine.stats().cache.counters
                    warm = run(engine, p)
                    after = engine.stats().cache.counters
                    assert warm.stats.cached_tokens == len(p) and after.restores == before.restores + 1
                    restore.append((after.restore_ms - before.restore_ms) / (len(p) / 1000))
                pm, rm = statistics.median(prefill), statistics.median(restore)
                note = " (files in the page cache)" if tier == "disk" else ""
                print(f"   {tier:5} restore {rm:8.1f} ms   prefill {pm:9.1f} ms   restore is {pm / rm:,.0f}x faster{note}")
            finally:
                engine.close()
    print()


def partial(model: Path | None) -> None:
    engine = Engine(EngineConfig(model_path=model, deterministic=False, host_cache_bytes=4 << 30))
    try:
        p = tokens(engine, 2000, 11000)
        run(engine, p)
        settle(engine)
        store = engine.stats().cache.store
        entry_bytes = store.chunks.logical_bytes
        before = store.chunks
        done = run(engine, p[:300] + tokens(engine, 40, 11001))
        after = engine.stats().cache.store.chunks
        reads = (after.ram_hits + after.disk_hits) - (before.ram_hits + before.disk_hits)
        chunk_bytes = entry_bytes * store.chunk_tokens / 2000
        print(f"4. partial restore: {done.stats.cached_tokens} of 2,000 tokens reused; read {reads} chunks "
              f"(~{reads * chunk_bytes / 2**20:.1f} MiB) of the entry's {entry_bytes / 2**20:.1f} MiB")
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--only", choices=["restart", "dedup", "restore", "partial"], default=None)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} at start\n")
    if args.only in (None, "restart"):
        restart(args.runs, args.model)
    if args.only in (None, "dedup"):
        dedup(args.model, args.chunk_tokens)
    if args.only in (None, "restore"):
        restore_vs_prefill(args.runs, args.model)
    if args.only in (None, "partial"):
        partial(args.model)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
