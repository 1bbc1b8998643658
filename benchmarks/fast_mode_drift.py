"""How often fast mode's partial hits change greedy text, next to how often batching alone does.

    .venv/bin/python benchmarks/fast_mode_drift.py [--tokens 32] [--model PATH]

Fast mode promises bit-exact full repeats only (EXACTNESS.md): a partial hit
prefills its suffix from another offset, next to other cells, and the float
summation order moves; with the cache off, batching a prompt next to other
lanes moves it too. This prints both, on 12 prompts (4 shared prefixes of
100..1,000 tokens x 3 tails), greedy, `--tokens` tokens each:
- reference: each prompt alone on a cache-off engine;
- cache on: the prompts in order on one engine, so the second and third tail
  of each prefix hit the first one's entry (partial hits);
- batching alone: the cache-off engine, the prompts 4 at a time.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from runtime_bench import text_tokens

from skippy_cache.config import StageKvCacheConfig, StageKvCacheMode
from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.requests import GenerationRequest


def suite(engine: Engine) -> list[list[int]]:
    prompts = []
    for family, prefix_len in enumerate((100, 350, 640, 1000)):
        prefix = text_tokens(engine, prefix_len, seed=100 + family)
        for tail in range(3):
            prompts.append(prefix + text_tokens(engine, 20 + 17 * tail, seed=1000 + 10 * family + tail))
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--model", type=Path, default=None)
    args = parser.parse_args()

    off = Engine(EngineConfig(model_path=args.model, cache=StageKvCacheConfig(mode=StageKvCacheMode.DISABLED)))
    prompts = suite(off)
    requests = [GenerationRequest(tokens=p, max_tokens=args.tokens) for p in prompts]
    alone = [off.generate(r).tokens for r in requests]
    batched = [done.tokens for i in range(0, len(requests), 4) for done in off.generate_many(requests[i : i + 4])]
    off.close()

    on = Engine(EngineConfig(model_path=args.model))
    partial = changed = 0
    for request, reference in zip(requests, alone):
        done = on.generate(request)
        if 0 < done.stats.cached_tokens < len(request.tokens):
            partial += 1
            changed += done.tokens != reference
    on.close()

    moved = sum(b != a for b, a in zip(batched, alone))
    print(f"12 prompts, greedy {args.tokens} tokens, fast mode")
    print(f"  partial hits whose text differs from the prompt alone, cache off: {changed} of {partial}")
    print(f"  prompts whose text differs when batched 4 at a time, cache off:  {moved} of {len(prompts)}")


if __name__ == "__main__":
    main()
