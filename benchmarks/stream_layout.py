"""What one unified KV pool and separate decode steps cost distinct prompts, against llama-server's ways.

    PYTHONPATH=src .venv/bin/python benchmarks/stream_layout.py [--requests 16] [--repeats 2]

The zero workload without any cache, straight on `llama_decode`: 4 lanes, each
request a distinct 512-token prompt and 16 greedy tokens, the next request on a
lane as soon as it ends. Four ways, alternated, medians:

- `unified, separate`: one pool of 4 x 2,048 cells for all lanes (skippy-cache's
  layout), and a step is either one lane's 256-row prefill chunk or every
  decoding lane's next row, a lone row with a pad row (skippy-cache's steps);
- `split, separate`: the same steps, each lane in a stream of its own 2,048
  cells (llama-server without `--kv-unified`);
- `unified, mixed` and `split, mixed`: each step holds every decoding lane's row
  and fills the rest of a 512-row batch with prompt rows (llama-server's steps).

Prints requests per second, time to first token and time per output token.
Then what a hit's prefix costs to hand to another lane in each layout: a
600-token sequence shared in one pool (`llama_memory_seq_cp`, cell tags only)
or copied into another stream (`llama_state_seq_get_data`, then `set_data`).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import dataclass, field

from skippy_cache.runtime.gguf_info import default_model_path
from skippy_cache.runtime.native import Batch, ContextParams, NativeContext, NativeModel

LANES, STREAM_CELLS, PROMPT, OUTPUT, CHUNK, BATCH = 4, 2048, 512, 16, 256, 512


@dataclass
class Lane:
    seq: int
    prompt: list[int] = field(default_factory=list)
    done: int = 0  # prompt rows computed
    out: int = 0  # tokens sampled
    start: float = 0.0
    first: float = 0.0


@dataclass
class Run:
    seconds: float
    ttft: list[float]
    tpot: list[float]


def context(model: NativeModel, *, unified: bool) -> NativeContext:
    """4 lanes and a pad sequence, in one pool of their cells or a stream of 2,048 cells each."""
    return NativeContext(model, ContextParams(n_ctx=(LANES + 1) * STREAM_CELLS, n_batch=BATCH,
                                              n_seq_max=LANES + 1, n_threads=os.cpu_count() or 1,
                                              kv_unified=unified))


def run(model: NativeModel, *, unified: bool, mixed: bool, requests: int, seed: int) -> Run:
    ctx = context(model, unified=unified)
    rng, batch, pad = random.Random(seed), Batch(BATCH), LANES
    lanes = [Lane(i) for i in range(LANES)]
    ttft: list[float] = []
    tpot: list[float] = []
    sent = 0

    def admit(lane: Lane) -> None:
        nonlocal sent
        ctx.seq_rm(lane.seq)
        lane.prompt = [rng.randrange(1000, 40000) for _ in range(PROMPT)]
        lane.done, lane.out, lane.start = 0, 0, time.perf_counter()
        sent += 1

    for lane in lanes:
        admit(lane)
    begin = time.perf_counter()
    prefill_last = False
    while any(lane.prompt for lane in lanes):
        decoding = [lane for lane in lanes if lane.prompt and lane.done == PROMPT]
        prefilling = [lane for lane in lanes if lane.prompt and lane.done < PROMPT]
        batch.clear()
        rows: list[tuple[Lane, int]] = []
        take_prefill = prefilling and (mixed or not decoding or not prefill_last)
        if mixed or not take_prefill:
            for lane in decoding:
                rows.append((lane, batch.add(lane.seq, [rng.randrange(1000, 40000)], PROMPT + lane.out - 1, True)))
            if not mixed and len(rows) == 1:
                batch.add(pad, [1], 0, False)
        if take_prefill:
            lane = prefilling[0]
            room = BATCH - batch.n_tokens if mixed else CHUNK
            n = min(room, PROMPT - lane.done)
            last = lane.done + n == PROMPT
            row = batch.add(lane.seq, lane.prompt[lane.done:lane.done + n], lane.done, last)
            lane.done += n
            if last:
                rows.append((lane, row))
        prefill_last = bool(take_prefill)
        if (code := ctx.decode(batch)) != 0:
            raise RuntimeError(f"llama_decode returned {code} on {batch.n_tokens} rows")
        ctx.seq_rm(pad)
        now = time.perf_counter()
        for lane, _ in rows:
            lane.out += 1
            if lane.out == 1:
                lane.first = now
                ttft.append(now - lane.start)
            if lane.out == OUTPUT:
                tpot.append((now - lane.first) / (OUTPUT - 1))
                if sent < requests:
                    admit(lane)
                else:
                    lane.prompt = []
    seconds = time.perf_counter() - begin
    ctx.close()
    return Run(seconds, ttft, tpot)


def handover_ms(model: NativeModel, *, unified: bool, tokens: int = 600, repeats: int = 9) -> float:
    """Median ms to give sequence 1 what sequence 0 holds (`tokens` of prompt)."""
    ctx = context(model, unified=unified)
    rng, batch = random.Random(0), Batch(BATCH)
    prompt = [rng.randrange(1000, 40000) for _ in range(tokens)]
    for start in range(0, tokens, BATCH):
        batch.clear()
        batch.add(0, prompt[start:start + BATCH], start, False)
        if ctx.decode(batch) != 0:
            raise RuntimeError("llama_decode failed")
    times = []
    for _ in range(repeats):
        ctx.seq_rm(1)
        begin = time.perf_counter()
        if unified:
            ctx.seq_cp(0, 1, -1, -1)
        elif not ctx.state_seq_set(1, ctx.state_seq_get(0)):
            raise RuntimeError("llama_state_seq_set_data refused the copy")
        times.append((time.perf_counter() - begin) * 1000)
    ctx.close()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model = NativeModel(default_model_path(), use_extra_bufts=False)
    ways = [(u, m) for m in (False, True) for u in (True, False)]
    results: dict[tuple[bool, bool], list[Run]] = {way: [] for way in ways}
    for repeat in range(args.repeats):
        for unified, mixed in ways if repeat % 2 == 0 else ways[::-1]:
            results[(unified, mixed)].append(
                run(model, unified=unified, mixed=mixed, requests=args.requests, seed=repeat))
    base = statistics.median(args.requests / r.seconds for r in results[(True, False)])
    print(f"{'way':<20} {'req/s':>7} {'vs ours':>8} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12}")
    for unified, mixed in ways:
        runs = results[(unified, mixed)]
        rate = statistics.median(args.requests / r.seconds for r in runs)
        ttft = statistics.median(t for r in runs for t in r.ttft) * 1000
        tpot = statistics.median(t for r in runs for t in r.tpot) * 1000
        name = f"{'unified' if unified else 'split'}, {'mixed' if mixed else 'separate'}"
        print(f"{name:<20} {rate:>7.3f} {rate / base:>7.2f}x {ttft:>12,.0f} {tpot:>12.1f}")
    print(f"a 600-token prefix to another lane: shared in one pool {handover_ms(model, unified=True):.2f} ms, "
          f"copied into its stream {handover_ms(model, unified=False):.2f} ms")


if __name__ == "__main__":
    main()
