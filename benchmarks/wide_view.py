"""What a wide KV view costs a prefill, and what smaller steps on it buy.

    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/wide_view.py steps
    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/wide_view.py LABEL [--fast]

`steps`: ms per row of 512 prompt rows prefilled in steps of 48 to 512 rows,
beside another sequence that widens the view to 1,024 .. 7,680 cells (fast
mode; medians of 3 to 12 repeats).

`LABEL`: exact mode (fast with --fast) on a pool that 8 tenants' 600-token
prompts have widened, then the zero workload (16 distinct 512-token prompts,
4 at a time) and a lone cold 2,000-token prompt: req/s, TTFT, and the ms per
row of the prefill steps of 64 rows or more. Alternate it with another
checkout (PYTHONPATH=OTHER/src) and compare medians.
"""
from __future__ import annotations

import random
import statistics
import sys
import time

import numpy as np
from planner_ab import zero
from runtime_bench import text_tokens

from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.native import Batch
from skippy_cache.runtime.pool import CellPool
from skippy_cache.runtime.requests import GenerationRequest


def steps() -> None:
    engine = Engine(EngineConfig(cache_dir=None, deterministic=False), start=False)
    pool, batch, rng = engine.pool, Batch(512), random.Random(1)

    def decode(seq: int, p0: int, n: int) -> None:
        batch.clear()
        batch.add(seq, [rng.randrange(1000, 20000) for _ in range(n)], p0, False)
        if pool.decode(batch, [(seq, p0, p0 + n)]) != 0:
            raise RuntimeError("llama_decode failed")

    decode(0, 0, 512)  # the measured sequence's first 512 cells
    decode(2, 0, 512)  # holds cells 512..1023 for the measured rows while the view widens above them
    widened = 0
    print("view   ms per row by step size (rows)")
    for view in (1024, 2048, 4096, 6144, 7680):
        while 1024 + widened < view:
            n = min(512, view - 1024 - widened)
            decode(1, widened, n)
            widened += n
        pool.free(2)
        cells = []
        for n in (48, 64, 128, 256, 512):
            runs = []
            for _ in range(max(3, 768 // n)):
                t0 = time.perf_counter()
                for p in range(512, 1024, n):
                    decode(0, p, n)
                runs.append((time.perf_counter() - t0) * 1000 / 512)
                pool.trim(0, 512)
            cells.append(f"{n}: {statistics.median(runs):4.2f}")
        decode(2, 0, 512)
        print(f"{view:5d}  " + " | ".join(cells), flush=True)
    engine.close()


def workload(label: str, fast: bool) -> None:
    traced: list[tuple[int, float]] = []
    decode = CellPool.decode

    def timed(self: CellPool, batch: Batch, runs: list) -> int:
        t0 = time.perf_counter()
        status = decode(self, batch, runs)
        traced.append((batch.n_tokens, (time.perf_counter() - t0) * 1000))
        return status

    CellPool.decode = timed  # type: ignore[method-assign]
    engine = Engine(EngineConfig(cache_dir=None, deterministic=not fast))
    try:
        systems = [text_tokens(engine, 600, seed=9100 + k) for k in range(8)]
        for i in range(0, 8, 4):
            engine.generate_many([GenerationRequest(tokens=s, max_tokens=1) for s in systems[i : i + 4]])
        # From the holders, not `CellMap.view`: an older checkout to compare with has no such property.
        view = int(engine.call(lambda: np.flatnonzero(engine.pool.cells.holders).max() + 1))
        traced.clear()
        rate, ttft = zero(engine)
        lone = engine.generate(GenerationRequest(tokens=text_tokens(engine, 2000, seed=777), max_tokens=1))
        big = [(n, ms) for n, ms in traced if n >= 64]
        per_row = sum(ms for _, ms in big) / sum(n for n, _ in big)
        print(f"{label}: view {view} after the tenants | zero {rate:.3f} req/s, TTFT p50 {ttft:.0f} ms | "
              f"lone 2,000-token TTFT {lone.stats.ttft_ms:.0f} ms | prefill steps {len(big)}, "
              f"{per_row:.2f} ms per row", flush=True)
    finally:
        engine.close()


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--fast"]
    if args[:1] == ["steps"]:
        steps()
    else:
        workload(args[0] if args else "this checkout", "--fast" in sys.argv)


if __name__ == "__main__":
    main()
