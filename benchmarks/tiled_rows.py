"""Does a row computed by llama.cpp's tiled flash-attention kernel depend on the other rows of its step?

    PYTHONPATH=src .venv/bin/python benchmarks/tiled_rows.py

A 600-token prompt's first 576 rows are prefilled alone; its last 24 rows
(with the last token's logits) then run in steps of 64 rows or more beside
other sequences' rows of different counts and orders (so the step's size, its
64-row query tiles and the threads' split all change), and once alone (24
rows: the row-by-row kernel). Prints each run's largest logit difference from
the first. Exact mode today keeps tiled steps to one lane's whole blocks and
computes a prompt's last partial block row by row; a zero in every tiled row
here says several lanes' tiled rows may share a step without moving a bit.
"""
from __future__ import annotations

import random

import numpy as np

from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.native import Batch

TAIL = 0  # the measured prompt's sequence; any other number is a companion of that many rows


def main() -> None:
    engine = Engine(EngineConfig(cache_dir=None, deterministic=False), start=False)
    pool, rng, batch = engine.pool, random.Random(5), Batch(512)
    prompt = [rng.randrange(1000, 20000) for _ in range(600)]
    companions = {seq: [rng.randrange(1000, 20000) for _ in range(128)] for seq in (2, 3, 4)}
    for p0, p1 in ((0, 512), (512, 576)):
        batch.clear()
        batch.add(0, prompt[p0:p1], p0, False)
        if pool.decode(batch, [(0, p0, p1)]) != 0:
            raise RuntimeError("llama_decode failed")

    def run(parts: list[tuple[int, int]]) -> tuple[np.ndarray, int]:
        """The tail's last-row logits with `parts` ((sequence, rows), in batch order) in its step."""
        batch.clear()
        runs, row = [], -1
        for seq, n in parts:
            if seq == TAIL:
                row = batch.add(0, prompt[576:600], 576, True)
                runs.append((0, 576, 600))
            else:
                batch.add(seq, companions[seq][:n], 0, False)
                runs.append((seq, 0, n))
        if pool.decode(batch, runs) != 0:
            raise RuntimeError("llama_decode failed")
        logits, rows = engine.ctx.logits(row).copy(), batch.n_tokens
        for seq, _ in parts:
            if seq == TAIL:
                pool.trim(0, 576)
            else:
                pool.free(seq)
        return logits, rows

    cases = {
        "tail, then 40 rows of seq 2": [(TAIL, 0), (2, 40)],
        "tail, then 40 rows of seq 3": [(TAIL, 0), (3, 40)],
        "tail, then 64 rows of seq 2": [(TAIL, 0), (2, 64)],
        "tail, then 20 of seq 2 and 30 of seq 3": [(TAIL, 0), (2, 20), (3, 30)],
        "64 rows of seq 2, then the tail": [(2, 64), (TAIL, 0)],
        "128 rows of seqs 2 and 4, the tail, 10 of seq 3": [(2, 64), (4, 64), (TAIL, 0), (3, 10)],
        "the tail alone (24 rows: row by row)": [(TAIL, 0)],
    }
    reference = None
    for name, parts in cases.items():
        logits, rows = run(parts)
        reference = logits if reference is None else reference
        print(f"{name:50s} {rows:3d} rows  max |diff| {float(np.abs(logits - reference).max()):.6f}")
    engine.close()


if __name__ == "__main__":
    main()
