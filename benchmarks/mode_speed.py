"""One request at a time: cold 2,000-token TTFT, then a 70-token suffix after it, in one mode.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/mode_speed.py fast|deterministic [THREADS]

Three rounds with fresh prompts; prints the medians. Run it once per mode (and
on another checkout with PYTHONPATH=OTHER/src:benchmarks) to compare.
"""

from __future__ import annotations

import statistics
import sys

from runtime_bench import text_tokens

from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.requests import GenerationRequest


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "fast"
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else None
    engine = Engine(EngineConfig(cache_dir=None, deterministic=mode == "deterministic", threads=threads))
    cold, hit = [], []
    try:
        for r in range(3):
            base = text_tokens(engine, 2000, seed=500 + r)
            cold.append(engine.generate(GenerationRequest(tokens=base, max_tokens=1)).stats.ttft_ms)
            suffix = base + text_tokens(engine, 70, seed=600 + r)
            hit.append(engine.generate(GenerationRequest(tokens=suffix, max_tokens=1)).stats.ttft_ms)
    finally:
        engine.close()
    print(f"{mode}: cold 2,000-token TTFT median {statistics.median(cold):,.0f} ms; "
          f"+70-token suffix after it {statistics.median(hit):,.0f} ms")


if __name__ == "__main__":
    main()
