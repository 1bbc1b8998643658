"""In-process time to first token, cache on vs off.

    .venv/bin/python benchmarks/runtime_bench.py [--runs 10] [--model PATH]

Prints medians (and min/max) of TTFT for a cold prompt (cache cleared before
each run) and a warm repeat, and a repeated-system-prompt workload: 8 system
prompts of ~600 tokens, each with a distinct short question, 3 rounds.
Every request generates one token (n_predict = 1).

Both run on the default 8,192-cell pool; tenants that leave it wait in the host tier.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.requests import GenerationRequest

WORDS = ["system", "assistant", "policy", "user", "tool", "answer", "question", "context", "memory", "river", "garden", "planet", "number", "letter", "window", "silver", "engine", "careful", "summary", "document", "history", "sequence", "model", "layer", "token", "cache", "prefix", "exact"]


def text_tokens(engine: Engine, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    tokens: list[int] = []
    while len(tokens) < n:
        tokens += engine.tokenize(" " + " ".join(rng.choice(WORDS) for _ in range(300)), add_special=False)
    return tokens[:n]


def ttft(engine: Engine, tokens: list[int]) -> tuple[float, int]:
    done = engine.generate(GenerationRequest(tokens=tokens, max_tokens=1))
    return done.stats.ttft_ms, done.stats.cached_tokens


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):9.1f} {min(values):9.1f} {max(values):9.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--ctx-size", type=int, default=8192)
    args = parser.parse_args()

    # Fast mode: the README's figures from this script were measured in it.
    engine = Engine(EngineConfig(model_path=args.model, ctx_size=args.ctx_size, deterministic=False))
    print(f"model {engine.info.model.model_id}, n_ctx {engine.info.n_ctx}, threads {engine.info.threads}, runs {args.runs}\n")
    print(f"{'prompt':>12} {'case':>5} {'median ms':>9} {'min':>9} {'max':>9}   cached")
    rows = []
    for n in (128, 2000):
        tokens = text_tokens(engine, n + 1, seed=n)
        cold = []
        for _ in range(args.runs):
            engine.clear_cache()
            cold.append(ttft(engine, tokens)[0])
        warm, cached = [], 0
        for _ in range(args.runs):
            ms, cached = ttft(engine, tokens)
            warm.append(ms)
        rows.append((n, statistics.median(cold), statistics.median(warm)))
        print(f"{n:>8}+1 {'cold':>5} {summary(cold)}   0")
        print(f"{n:>8}+1 {'warm':>5} {summary(warm)}   {cached}")
    print()
    for n, cold_ms, warm_ms in rows:
        print(f"{n}+1 tokens: warm hit is {cold_ms / warm_ms:.1f}x faster than cold (medians)")

    engine.clear_cache()
    systems = [text_tokens(engine, 600, seed=1000 + k) for k in range(8)]
    rounds: list[list[float]] = []
    hits = total = cached_tokens = prompt_tokens = 0
    start = time.perf_counter()
    for r in range(3):
        times = []
        for k, system in enumerate(systems):
            question = text_tokens(engine, 12 + (k + r) % 7, seed=5000 + 100 * r + k)
            ms, cached = ttft(engine, system + question)
            times.append(ms)
            total += 1
            hits += cached > 0
            cached_tokens += cached
            prompt_tokens += len(system) + len(question)
        rounds.append(times)
    wall = time.perf_counter() - start
    later = rounds[1] + rounds[2]
    print(f"\nrepeated system prompts: 8 x 600 tokens + a distinct question, 3 rounds, n_ctx {engine.n_ctx}")
    print(f"  round 1 TTFT median {statistics.median(rounds[0]):.1f} ms")
    print(f"  rounds 2-3 TTFT median {statistics.median(later):.1f} ms "
          f"({statistics.median(rounds[0]) / statistics.median(later):.1f}x faster)")
    print(f"  hit rate {hits}/{total} = {hits / total:.0%}, cached tokens {cached_tokens / prompt_tokens:.0%} of prompt tokens")
    print(f"  wall time {wall:.1f} s for {total} requests; {engine.stats().cache.counters.restores} hits restored from the store")
    engine.close()


if __name__ == "__main__":
    main()
