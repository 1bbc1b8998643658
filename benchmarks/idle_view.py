"""What idle entries cost the steps around them: tenants, then the zero workload, in exact mode.

    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/idle_view.py IDLE_TOKENS [--fast]

IDLE_TOKENS is `EngineConfig.idle_tokens` (default 256; 0: entries leave the
pool only when their cells are needed, as exact mode once had it). Prints
tenants' later-round TTFT p50 (planner_ab.py), then zero's throughput and TTFT
p50, and for zero's steps the KV view they walked (median cells: one past the
highest used cell, `CellMap.view`), their time in `llama_decode`, and the pad
cells placement imported. Alternate values a few times and compare medians:
one run moves by 10% on a 2-core machine.
"""
from __future__ import annotations

import statistics
import sys
import time

from planner_ab import tenants, zero

from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.native import Batch
from skippy_cache.runtime.pool import CellPool


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--fast"]
    idle_tokens = int(args[0]) if args else 256
    traced: list[tuple[int, int, float]] = []
    decode = CellPool.decode

    def timed(self: CellPool, batch: Batch, runs: list) -> int:
        t0 = time.perf_counter()
        status = decode(self, batch, runs)
        traced.append((batch.n_tokens, self.cells.view, (time.perf_counter() - t0) * 1000))
        return status

    CellPool.decode = timed  # type: ignore[method-assign]
    engine = Engine(EngineConfig(cache_dir=None, deterministic="--fast" not in sys.argv, idle_tokens=idle_tokens))
    try:
        later = tenants(engine)
        traced.clear()
        pads = engine.placement.stats.pad_tokens
        rate, ttft = zero(engine)
        pads = engine.placement.stats.pad_tokens - pads
        views = [view for _, view, _ in traced]
        print(f"idle_tokens {idle_tokens}: tenants later p50 {later:.0f} ms | zero {rate:.3f} req/s, TTFT p50 "
              f"{ttft:.0f} ms | zero's {len(traced)} steps: view median {statistics.median(views):.0f} cells, "
              f"{sum(ms for *_, ms in traced) / 1000:.1f} s in llama_decode, {pads} pad cells", flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
