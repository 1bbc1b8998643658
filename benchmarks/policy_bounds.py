"""How far an eviction policy could go on a trace, given knowledge no cache has: upper bounds.

    PYTHONPATH=src .venv/bin/python benchmarks/policy_bounds.py TRACE.jsonl [--blocks 4000,16000]

One shared pool of 512-token blocks, as `skippy-cache replay --ram "N blocks"` (docs/sizing.md).
A block-level replay drives the production books (eviction.py) with the trace's clock and prints,
per capacity:

- `lru`, `lrfu`: the production policies (the same figures as `skippy-cache replay`);
- `lrfu + oracle`: LRFU with a bonus of one turnover, which a block that *will* be used again gets
  and one that will not does not: what a perfect predictor of reuse adds to LRFU;
- `turn classes (fit)`: leaves ranked by their chance of reuse given how long they have been idle
  and the class of the request that last used them (its turn in its conversation: 0, 1, 2, 3, 4+;
  how many new blocks it added: 0-1, 2-3, more), with each class's chance of a next turn and the
  distribution of gaps before it measured on the whole trace in advance: an upper bound for a
  policy that learns these signals online;
- the same, ranked by reuse chance per second of expected wait (hit density, as LHD).

A conversation's turns are found as in `sizing.replay`'s session routing: a request continues the
earlier one whose blocks it shares, when it shares at least two.
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from skippy_cache.eviction import LrfuBooks, LruBooks

BLOCK = 512


@dataclass(frozen=True, slots=True)
class Request:
    seconds: float
    input_length: int
    chunks: tuple[int, ...]  # block ids of the chunks a lookup covers (all but the tail)
    tail: tuple[int, ...]  # the tail's key: the whole prompt's ids and its length


def read(path: Path) -> list[Request]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            obj = json.loads(line)
            n = (obj["input_length"] - 1) // BLOCK
            ids = tuple(obj["hash_ids"])
            length = obj["input_length"]
            # Each request its own instant, as in `skippy-cache replay`: the timestamps repeat.
            seconds = obj["timestamp"] / 1000 + len(out) * 1e-9
            out.append(Request(seconds, length, ids[:n], (*ids, length)))
    return out


@dataclass(slots=True)
class Turns:
    """Each request's class (turn and new blocks) and, per class, the chance of a next turn and its gaps."""

    classes: list[tuple[int, int]] = field(default_factory=list)
    chance: dict[tuple[int, int], float] = field(default_factory=dict)
    gaps: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)


def turns(requests: list[Request]) -> Turns:
    owner: dict[int, int] = {}
    turn, nxt = [0] * len(requests), [None] * len(requests)
    out = Turns()
    for i, r in enumerate(requests):
        shared, parent = 0, None
        for key in r.chunks:
            if key not in owner:
                break
            shared, parent = shared + 1, owner[key]
        if parent is not None and shared >= 2:
            turn[i] = turn[parent] + 1
            if nxt[parent] is None:
                nxt[parent] = i
        new = len(r.chunks) - shared
        out.classes.append((min(turn[i], 4), 0 if new <= 1 else 1 if new <= 3 else 2))
        for key in r.chunks:
            owner[key] = i
    counts: dict[tuple[int, int], int] = {}
    gaps: dict[tuple[int, int], list[float]] = {}
    for i, c in enumerate(out.classes):
        counts[c] = counts.get(c, 0) + 1
        if nxt[i] is not None:
            gaps.setdefault(c, []).append(requests[nxt[i]].seconds - requests[i].seconds)
    for c, n in counts.items():
        out.chance[c] = len(gaps.get(c, [])) / n
        out.gaps[c] = np.sort(np.array(gaps.get(c, [])))
    return out


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.request = 0

    def __call__(self) -> float:
        return self.now


def run(requests: list[Request], blocks: int, books: object, clock: Clock) -> float:
    """Token hit ratio of one pool of `blocks` blocks under `books` (the replay's read, then write)."""
    capacity = blocks * BLOCK
    hit = total = 0
    for i, r in enumerate(requests):
        clock.now, clock.request = r.seconds, i
        run_ = 0
        for key in r.chunks:
            if key not in books:
                break
            run_ += 1
        whole = run_ == len(r.chunks) and r.tail in books
        for key in r.chunks[:run_]:
            books.touch(key)
        if whole:
            books.touch(r.tail)
        hit += r.input_length if whole else run_ * BLOCK
        total += r.input_length
        parent = None
        sizes = [BLOCK] * len(r.chunks) + [r.input_length - len(r.chunks) * BLOCK]
        for key, size in zip((*r.chunks, r.tail), sizes, strict=True):
            if key in books:
                books.touch(key)
            else:
                while books.bytes + size > capacity:
                    books.evict()
                books.add(key, size, parent=parent, tail=key == r.tail)
            parent = key
    return 100 * hit / total


class OracleLrfu(LrfuBooks):
    """LRFU whose second-use bonus goes to exactly the blocks that will be used again."""

    def __init__(self, clock: Clock, uses: dict[object, list[float]]) -> None:
        super().__init__(clock, bonuses=(1.0,))
        self._uses = uses

    def _rank(self, key: str) -> None:
        chunk = self._chunks[key]
        times = self._uses.get(key, [])
        again = bisect.bisect_right(times, chunk.last) < len(times)
        chunk.uses = 2 if again else 1  # read by LRFU's rank as "used twice"
        super()._rank(key)


class ClassBooks:
    """Leaves only (as LRFU); the victim is the lowest-scoring of 64 leaves sampled at random."""

    SAMPLE = 64

    def __init__(self, clock: Clock, fit: Turns, score: Callable[[float, np.ndarray, float], float]) -> None:
        self.clock, self.fit, self.score = clock, fit, score
        self.bytes = 0
        self._held: dict[object, list] = {}  # key -> [size, tail, parent, last, class, children]
        self._leaves: list[object] = []
        self._at: dict[object, int] = {}
        self._rng = random.Random(1)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def add(self, key: object, size: int, *, parent: object = None, tail: bool = False) -> None:
        above = self._held.get(parent)
        self._held[key] = [size, tail, parent if above is not None else None, self.clock.now,
                           self.fit.classes[self.clock.request], set()]
        self.bytes += size
        if above is not None:
            above[5].add(key)
            self._leaf(parent, False)
        self._leaf(key, True)

    def touch(self, key: object) -> None:
        held = self._held[key]
        held[3], held[4] = self.clock.now, self.fit.classes[self.clock.request]

    def evict(self) -> None:
        now = self.clock.now
        sample = [self._leaves[self._rng.randrange(len(self._leaves))] for _ in range(self.SAMPLE)]

        def value(key: object) -> float:
            size, tail, _, last, cls, _ = self._held[key]
            if tail:
                return -1.0  # the end of a prompt serves only its exact repeat
            return self.score(self.fit.chance[cls], self.fit.gaps[cls], now - last)

        victim = min(sample, key=value)
        size, _, parent, _, _, children = self._held.pop(victim)
        self.bytes -= size
        self._leaf(victim, False)
        for child in children:
            self._held[child][2] = None
        if parent is not None:
            self._held[parent][5].discard(victim)
            if not self._held[parent][5]:
                self._leaf(parent, True)

    def _leaf(self, key: object, leaf: bool) -> None:
        if leaf and key not in self._at:
            self._at[key] = len(self._leaves)
            self._leaves.append(key)
        elif not leaf and key in self._at:
            i, last = self._at.pop(key), self._leaves.pop()
            if last != key:
                self._leaves[i], self._at[last] = last, i


def reuse_chance(p: float, gaps: np.ndarray, idle: float) -> float:
    """P(a next turn | none came in `idle` seconds) = p S / (1 - p + p S), S = P(gap > idle)."""
    if not len(gaps):
        return 0.0
    s = 1 - np.searchsorted(gaps, idle) / len(gaps)
    return p * s / (1 - p + p * s)


def reuse_density(p: float, gaps: np.ndarray, idle: float) -> float:
    """That chance per second of the expected wait for it."""
    j = np.searchsorted(gaps, idle)
    if j >= len(gaps):
        return 0.0
    return reuse_chance(p, gaps, idle) / max(float(gaps[j:].mean()) - idle, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--blocks", default="4000,16000")
    args = parser.parse_args()
    requests = read(args.trace)
    fit = turns(requests)
    uses: dict[object, list[float]] = {}
    for r in requests:
        for key in (*r.chunks, r.tail):
            uses.setdefault(key, []).append(r.seconds)
    policies: dict[str, Callable[[Clock], object]] = {
        "lru": lambda clock: LruBooks(),
        "lrfu": lambda clock: LrfuBooks(clock),
        "lrfu + oracle": lambda clock: OracleLrfu(clock, uses),
        "turn classes (fit), reuse chance": lambda clock: ClassBooks(clock, fit, reuse_chance),
        "turn classes (fit), reuse density": lambda clock: ClassBooks(clock, fit, reuse_density),
    }
    capacities = [int(b) for b in args.blocks.split(",")]
    print(f"{'policy':<36}" + "".join(f"{c:>10,}" for c in capacities))
    for name, make in policies.items():
        ratios = []
        for blocks in capacities:
            clock = Clock()
            ratios.append(run(requests, blocks, make(clock), clock))
        print(f"{name:<36}" + "".join(f"{r:>9.2f}%" for r in ratios), flush=True)


if __name__ == "__main__":
    main()
