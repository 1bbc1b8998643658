"""Does the cache change answers? Cache on vs cache off, and batching alone, in each mode.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/fast_mode_drift.py [--tokens 24] [--model PATH]
        [--modes fast,deterministic]

The check a new user would run: 10 prompts (two long shared bases, four
tails each, then two exact repeats), greedy, `--tokens` tokens each, sent to
an engine with the cache on and to one with it off:
- one at a time, and 4 at a time (concurrent clients);
- counted: prompts whose greedy text is identical to the cache-off run's, and
  prompts whose first-token logits are identical bit for bit;
- whether the two exact repeats continue as their first run did;
- and, on the cache-off engine alone, how many texts batching 4 at a time
  moves: the drift a prefix cache cannot be blamed for.

Run it on two commits to compare planners; it prints figures, never asserts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from runtime_bench import text_tokens

from skippy_cache.config import StageKvCacheConfig, StageKvCacheMode
from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.requests import Completion, GenerationRequest


def suite(engine: Engine) -> list[list[int]]:
    prompts = []
    for family, base_len in enumerate((700, 1100)):
        base = text_tokens(engine, base_len, seed=100 + family)
        for tail in range(4):
            prompts.append(base + text_tokens(engine, 15 + 23 * tail, seed=1000 + 10 * family + tail))
    return prompts + [prompts[1], prompts[6]]


def run(engine: Engine, requests: list[GenerationRequest], at_once: int) -> list[Completion]:
    if at_once == 1:
        return [engine.generate(r) for r in requests]
    return [done for i in range(0, len(requests), at_once) for done in engine.generate_many(requests[i : i + at_once])]


def compare(label: str, got: list[Completion], reference: list[Completion]) -> None:
    texts = sum(g.tokens == r.tokens for g, r in zip(got, reference))
    logits = sum(np.array_equal(g.first_logits, r.first_logits) for g, r in zip(got, reference))
    drift = max(float(np.max(np.abs(g.first_logits - r.first_logits))) for g, r in zip(got, reference))
    hits = sum(g.stats.cached_tokens > 0 for g in got)
    print(f"  {label:<44} {texts:>2} of {len(got)} texts, {logits:>2} of {len(got)} first-token logits identical"
          f" (max |diff| {drift:.3g}; {hits} hits)")


def check(args: argparse.Namespace, deterministic: bool) -> None:
    """The whole check in one mode: cache off and on, one at a time and 4 at a time."""
    def engine(**cache: object) -> Engine:
        return Engine(EngineConfig(model_path=args.model, deterministic=deterministic,
                                   cache=StageKvCacheConfig(**cache)))  # type: ignore[arg-type]

    off = engine(mode=StageKvCacheMode.DISABLED)
    prompts = suite(off)
    requests = [GenerationRequest(tokens=p, max_tokens=args.tokens, keep_first_logits=True) for p in prompts]
    reference = run(off, requests, 1)
    off_batched = run(off, requests, 4)
    off.close()

    mode = "exact mode (the default)" if deterministic else "fast mode (--fast)"
    print(f"{mode}: {len(prompts)} prompts, greedy {args.tokens} tokens; reference: cache off, one at a time")
    compare("cache off, 4 at a time (batching alone)", off_batched, reference)
    for at_once in (1, 4):
        on = engine()
        got = run(on, requests, at_once)
        on.close()
        compare(f"cache on, {at_once} at a time", got, reference)
        # The last two prompts repeat earlier ones: their text against the first run's, same engine.
        same = sum(got[i].tokens == got[prompts.index(prompts[i])].tokens for i in (len(prompts) - 2, len(prompts) - 1))
        print(f"    exact repeats whose text equals their first run's: {same} of 2", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--modes", default="fast,deterministic", help="comma-separated: fast, deterministic")
    args = parser.parse_args()
    for mode in args.modes.split(","):
        check(args, deterministic=mode.strip() == "deterministic")


if __name__ == "__main__":
    main()
