"""The sizing tables of docs/sizing.md: capacity curves and replicas, from Mooncake's public traces.

    .venv/bin/python benchmarks/sizing.py CONVERSATION.jsonl SYNTHETIC.jsonl [--out docs/assets]

The traces come from kvcache-ai/Mooncake (`FAST25-release/traces/`); they are
not part of this repository. Everything runs through `skippy_cache.sizing.replay`,
the same code as `skippy-cache replay`. Prints markdown tables:

- per trace, the token hit ratio of one shared RAM pool at 1,000 to 64,000 blocks
  of 512 tokens, under LRU and LRFU, against the offline optimum's rule and the
  infinite-cache bound; the conversation trace also split at 30 minutes (LRFU was
  tuned on the first half), and a PNG of each curve in `--out`;
- replicas (conversation trace): N = 4, 16, 64 replicas with RAM C/N each, with and
  without one shared tier of C (round-robin; the tier's server under `volatile-ttl`,
  then `allkeys-lru`), and without it under session routing, against one pool of C, at
  C = 16,000 and 64,000 blocks (`--replicas-only`: this table alone).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from skippy_cache.eviction import Policy
from skippy_cache.sizing.cli import SWEEP_BLOCKS, plot, sweep
from skippy_cache.sizing.replay import Capacities, ReplayConfig, Routing, infinite_bound, replay
from skippy_cache.sizing.sharedtier import ServerPolicy
from skippy_cache.sizing.trace import read_trace

BLOCK = 512
KV = 1  # capacities are counted in tokens here: bytes per token only scale them


def pool(requests, blocks: int, policy: Policy) -> float:
    return replay(requests, ReplayConfig(Capacities(ram_bytes=blocks * BLOCK * KV), KV, BLOCK, policy)).ratio()


def curves(name: str, requests, out: Path | None, start: float = 0.0) -> None:
    bound = infinite_bound(requests, BLOCK, count_from_ms=start)
    print(f"\n#### {name}: {len(requests):,} requests replayed, infinite-cache bound {100 * bound:.2f}%\n")
    print("| blocks | LRU | LRFU | LRFU - LRU | offline optimum |")
    print("|---:|---:|---:|---:|---:|")
    found = sweep(requests, ReplayConfig(Capacities(), KV, BLOCK), count_from_ms=start)
    for i, blocks in enumerate(SWEEP_BLOCKS):
        lru, lrfu, opt = found["lru"][i], found["lrfu"][i], found["offline optimum"][i]
        print(f"| {blocks:,} | {lru:.2f}% | {lrfu:.2f}% | {lrfu - lru:+.2f} | {opt:.2f}% |", flush=True)
    if out is not None:
        plot(out / f"sizing-{name.split(',')[0]}.png", found, bound, BLOCK)


def replicas(requests) -> None:
    print("\n#### Replicas (conversation trace), round-robin unless said\n")
    print("| C (blocks) | N | one pool of C | RAM C/N + shared C | of which local | shared read per request "
          "| the same, allkeys-lru | RAM C/N alone | RAM C/N alone, session routing |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    per_token = 23_040  # SmolLM2-135M's KV bytes per token at f16, for the network figure
    for c in (16_000, 64_000):
        single = pool(requests, c, Policy.LRFU)
        for n in (4, 16, 64):
            local = c * BLOCK * per_token // n
            with_shared = ReplayConfig(Capacities(ram_bytes=local, remote_bytes=c * BLOCK * per_token),
                                       per_token, BLOCK, Policy.LRFU, n, Routing.ROUND_ROBIN)
            shared = replay(requests, with_shared)
            lru = replay(requests, replace(with_shared, remote_policy=ServerPolicy.ALLKEYS_LRU))
            alone = replay(requests, ReplayConfig(Capacities(ram_bytes=local), per_token, BLOCK, Policy.LRFU, n,
                                                  Routing.ROUND_ROBIN))
            session = replay(requests, ReplayConfig(Capacities(ram_bytes=local), per_token, BLOCK, Policy.LRFU, n,
                                                    Routing.SESSION))
            read = shared.remote_read_bytes / shared.requests / (1 << 20)
            print(f"| {c:,} | {n} | {100 * single:.2f}% | {100 * shared.ratio():.2f}% "
                  f"({shared.ratio() / single:.2f}x) | {100 * shared.ratio('ram'):.2f}% | {read:.0f} MiB "
                  f"| {100 * lru.ratio():.2f}% ({lru.ratio() / single:.2f}x) "
                  f"| {100 * alone.ratio():.2f}% | {100 * session.ratio():.2f}% |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("conversation", type=Path)
    p.add_argument("synthetic", type=Path)
    p.add_argument("--out", type=Path, default=None, help="directory for the PNG curves (default: none)")
    p.add_argument("--replicas-only", action="store_true", help="only the replicas table")
    args = p.parse_args()
    t0 = time.perf_counter()
    conv = read_trace(args.conversation)
    if args.replicas_only:
        replicas(conv)
        print(f"\n({time.perf_counter() - t0:.0f} s)")
        return
    curves("conversation", conv, args.out)
    curves("conversation, first 30 minutes", [r for r in conv if r.timestamp < 1_800_000], None)
    curves("conversation, last 30 minutes (the first 30 warm the pool)", conv, None, start=1_800_000)
    curves("synthetic", read_trace(args.synthetic), args.out)
    replicas(conv)
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
