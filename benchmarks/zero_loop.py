"""The bench's zero workload in process, every step traced: where a stream of distinct prompts spends its time.

    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/zero_loop.py [--off] [--fast] [--prompts 32]

Four clients in a closed loop (each sends its next prompt when its last one is
done, as `skippy-cache bench` does) send distinct ~512-token prompts and ask
for 16 tokens each. Prints requests per second and TTFT p50, then for the
steps: the KV view they walked (median cells: one past the highest used cell,
`CellMap.view`), their time in `llama_decode` by kind (tiled prefill steps of
64 rows or more; steps of rows computed one at a time, decode steps among
them), the engine thread's time between steps, and the placement's counts.
`--off` turns the cache off. Alternate runs and compare medians: one run moves
by 5 to 10% on a 2-core machine.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

from runtime_bench import text_tokens

from skippy_cache.config import StageKvCacheConfig, StageKvCacheMode
from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.native import Batch
from skippy_cache.runtime.pool import CellPool
from skippy_cache.runtime.requests import GenerationRequest

CLIENTS = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--off", action="store_true", help="cache off")
    parser.add_argument("--fast", action="store_true", help="fast mode (default: exact mode)")
    parser.add_argument("--prompts", type=int, default=32)
    args = parser.parse_args()

    steps: list[tuple[float, int, int, float]] = []  # (start, rows, view, ms)
    decode = CellPool.decode

    def traced(self: CellPool, batch: Batch, runs: list) -> int:
        t0 = time.perf_counter()
        status = decode(self, batch, runs)
        steps.append((t0, batch.n_tokens, self.cells.view, (time.perf_counter() - t0) * 1000))
        return status

    CellPool.decode = traced  # type: ignore[method-assign]
    cache = StageKvCacheConfig(mode=StageKvCacheMode.DISABLED) if args.off else StageKvCacheConfig()
    engine = Engine(EngineConfig(cache_dir=None, deterministic=not args.fast, cache=cache))
    try:
        prompts = [text_tokens(engine, 512, seed=9000 + i) for i in range(args.prompts)]
        queue, lock, ttft = list(prompts), threading.Lock(), []

        def client() -> None:
            while True:
                with lock:
                    if not queue:
                        return
                    prompt = queue.pop()
                ttft.append(engine.generate(GenerationRequest(tokens=prompt, max_tokens=16)).stats.ttft_ms)

        steps.clear()
        started = time.perf_counter()
        clients = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
        wall = time.perf_counter() - started
        placement = engine.placement.stats
    finally:
        engine.close()

    label = ("fast" if args.fast else "exact") + (", cache off" if args.off else "")
    print(f"{label}: {args.prompts / wall:.3f} req/s, TTFT p50 {statistics.median(ttft):.0f} ms, {len(steps)} steps, "
          f"view median {statistics.median(view for _, _, view, _ in steps):.0f} cells")
    kinds = {
        "tiled prefill (64 rows or more)": [s for s in steps if s[1] >= 64],
        "rows one at a time (2-63 rows)": [s for s in steps if s[1] < 64],
        "  of which decode (5 rows or fewer)": [s for s in steps if s[1] <= 5],
    }
    for name, picked in kinds.items():
        rows, ms = sum(s[1] for s in picked), sum(s[3] for s in picked)
        print(f"  {name}: {len(picked)} steps, {rows} rows, {ms / 1000:.1f} s, {ms / max(rows, 1):.2f} ms a row")
    between = sum(max(0.0, b[0] - a[0] - a[3] / 1000) for a, b in zip(steps, steps[1:]))
    print(f"  between steps: {between:.1f} s; pads {placement.pad_tokens} cells, steps in rooms "
          f"{placement.room_steps}, relocations {placement.relocations}, unaligned steps {placement.unaligned_steps}")


if __name__ == "__main__":
    main()
