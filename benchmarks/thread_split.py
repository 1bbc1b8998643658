"""What a replica's share of the cores costs one request: a later chat turn's TTFT on 1 thread vs 2.

    .venv/bin/python benchmarks/thread_split.py [--threads 1,2] [--runs 5] [--fast]

The replicas workload gives each of N replicas cores // N threads, the single
server all of them. A later turn restores its history (here: a 600-token
prompt it sent before, resident) and prefills only the new tokens; this
times that prefill alone, one request at a time, so the ratio is what the
thread split costs a request the cache already serves. Engines are made in
the order given, twice (A B A B), since the machine's load drifts. Prints
the median TTFT per thread count and new-token count.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from skippy_cache.runtime import Engine, EngineConfig, GenerationRequest

HISTORY_TOKENS = 600
NEW_TOKENS = (80, 120)


def tokens(engine: Engine, n: int, seed: int) -> list[int]:
    """n ordinary-text token ids (a word list tokenized), the same for a seed on every engine."""
    words = "the of and to in is was for on that with as by at from his her an are were this".split()
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < n:
        ids += engine.tokenize(" ".join(rng.choice(words) for _ in range(64)), add_special=False)
    return ids[:n]


def later_turn_ms(engine: Engine, new: int, runs: int) -> float:
    times = []
    for run in range(runs):
        history = tokens(engine, HISTORY_TOKENS, seed=1000 + run)
        engine.generate(GenerationRequest(tokens=history, max_tokens=1), timeout=300)
        prompt = history + tokens(engine, new, seed=2000 + run)
        times.append(engine.generate(GenerationRequest(tokens=prompt, max_tokens=1), timeout=300).stats.ttft_ms)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--fast", action="store_true", help="fast mode (default: exact, as serve runs)")
    args = parser.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    results: dict[int, dict[int, list[float]]] = {t: {n: [] for n in NEW_TOKENS} for t in counts}
    t0 = time.perf_counter()
    for _ in range(2):
        for threads in counts:
            engine = Engine(EngineConfig(ctx_size=4096, threads=threads, cache_dir=None, deterministic=not args.fast))
            try:
                for new in NEW_TOKENS:
                    results[threads][new].append(later_turn_ms(engine, new, args.runs))
            finally:
                engine.close()
    mode = "fast" if args.fast else "exact"
    print(f"later-turn TTFT, {HISTORY_TOKENS}-token history resident, {mode} mode, median of {args.runs} "
          f"per pass, two passes ({time.perf_counter() - t0:.0f} s)")
    for threads in counts:
        cells = ", ".join(f"+{new} new: {' / '.join(f'{ms:.0f}' for ms in results[threads][new])} ms"
                          for new in NEW_TOKENS)
        print(f"  {threads} thread(s): {cells}")


if __name__ == "__main__":
    main()
