"""What a prompt's last partial block costs computed row by row (exact mode's kernel for it) or tiled.

    PYTHONPATH=src .venv/bin/python benchmarks/tail_kernels.py [--repeats 7] [--tail 20]

Four lanes share a 576-token prefix (prefilled once, copied with `seq_cp`),
like tenants' later requests after a cached system prompt. Each repeat then
computes every lane's next TAIL rows (the new question) and trims them off
again, four ways, in rotating order:
- one lane, row by row: its TAIL rows alone in a step, as exact mode computes
  a prompt's last partial block;
- one lane, tiled: the same rows plus pad rows of a spare sequence up to 64,
  the fewest rows a tiled step holds;
- four lanes, row by row: one step per lane, one after the other (exact mode:
  a lane's rows are not topped up past `batching.JOIN_ROWS`);
- four lanes, tiled: the four lanes' rows in one step, as llama-server
  batches its slots.
Prints the median milliseconds of each. A tiled row's floats do not depend
on what shares its step (`tiled_rows.py`), but exact mode fixes each row's
kernel from the request alone (exact.py): tiling the last block would make a
lone request pay the pad rows, every time.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.native import Batch
from skippy_cache.runtime.pool import CellPool

PREFIX = 576
LANES = (0, 1, 2, 3)
PAD_SEQ = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tail", type=int, default=20, help="new rows per lane (under 64)")
    args = parser.parse_args()
    if not 0 < args.tail < 64:
        parser.error("--tail must be from 1 to 63")
    engine = Engine(EngineConfig(cache_dir=None, deterministic=False), start=False)
    pool, rng, batch = engine.pool, random.Random(7), Batch(512)
    prefix = [rng.randrange(1000, 20000) for _ in range(PREFIX)]
    tails = {seq: [rng.randrange(1000, 20000) for _ in range(args.tail)] for seq in LANES}
    step(pool, batch, [(LANES[0], prefix[:512], 0)])
    step(pool, batch, [(LANES[0], prefix[512:], 512)])
    for seq in LANES[1:]:
        pool.copy(LANES[0], seq, PREFIX)

    def lone_row_by_row() -> None:
        step(pool, batch, [(0, tails[0], PREFIX)])

    def lone_tiled() -> None:
        step(pool, batch, [(0, tails[0], PREFIX), (PAD_SEQ, [0] * (64 - args.tail), 0)])

    def four_row_by_row() -> None:
        for seq in LANES:
            step(pool, batch, [(seq, tails[seq], PREFIX)])

    def four_tiled() -> None:
        runs = [(seq, tails[seq], PREFIX) for seq in LANES]
        if 4 * args.tail < 64:
            runs.append((PAD_SEQ, [0] * (64 - 4 * args.tail), 0))
        step(pool, batch, runs)

    cases = {
        "one lane, row by row": lone_row_by_row,
        "one lane, tiled (pad rows up to 64)": lone_tiled,
        "four lanes, row by row (a step each)": four_row_by_row,
        "four lanes, tiled (one step)": four_tiled,
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for repeat in range(args.repeats):
            names = list(cases)
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                t0 = time.perf_counter()
                cases[name]()
                times[name].append((time.perf_counter() - t0) * 1000)
                for seq in LANES:
                    pool.trim(seq, PREFIX)
                pool.free(PAD_SEQ)
        print(f"{args.tail} new rows per lane after a {PREFIX}-token shared prefix, {args.repeats} repeats:")
        for name, values in times.items():
            print(f"  {name:40s} median {statistics.median(values):7.1f} ms "
                  f"(min {min(values):.1f}, max {max(values):.1f})")
    finally:
        engine.close()


def step(pool: CellPool, batch: Batch, runs: list[tuple[int, list[int], int]]) -> None:
    """One `llama_decode` of these (sequence, tokens, first position) runs; a lane's last row gives logits."""
    batch.clear()
    for seq, tokens, p0 in runs:
        batch.add(seq, tokens, p0, seq != PAD_SEQ)
    if pool.decode(batch, [(seq, p0, p0 + len(tokens)) for seq, tokens, p0 in runs]) != 0:
        raise RuntimeError("llama_decode failed")


if __name__ == "__main__":
    main()
