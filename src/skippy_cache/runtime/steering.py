"""Deterministic mode's placement: each lane's cells on the 64-token alignment grid.

llama.cpp's CPU flash-attention kernel gives bit-identical logits only when a
token's cell agrees with its position modulo 64 and a sequence's cells stay in
position order (placement.py). The allocator is first-fit from a moving head,
so before a lane's chunk is decoded, the free cells the allocator would reach
before the lane's aligned target are filled with pad tokens of a spare
sequence, and the pad sequence is freed once no lane runs.

Pads are imported, not computed: a state of zeroed rows goes in through
`llama_state_seq_set_data`, which places its cells exactly where a decode of
as many tokens would (the first free cells from the allocator's head). No
other sequence attends to them, so their rows never matter, and a pad of a
thousand cells costs a copy of a few MiB instead of a thousand tokens' prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from skippy_cache.placement import aligned_target, pad_needed
from skippy_cache.runtime.batching import Planned
from skippy_cache.runtime.pool import CellPool
from skippy_cache.stateformat import Layout, join

#: Pad attempts per step: each import of pads may move the allocator's head,
#: so the pad count is recomputed a few times before giving up on alignment.
_PAD_ROUNDS = 4


@dataclass(slots=True)
class PlacementStats:
    #: Pad cells imported to steer placement.
    pad_tokens: int = 0
    #: Steps that could not be placed on the alignment grid (not bit-exact).
    unaligned_steps: int = 0


class FreePlacement:
    """Fast mode: cells go wherever llama.cpp's allocator finds room."""

    def __init__(self) -> None:
        self.stats = PlacementStats()

    def before_decode(self, planned: list[Planned], evict_one: Callable[[], bool]) -> None:
        pass

    def release(self, seq_id: int, lanes_left: int) -> None:
        pass


class AlignedPlacement:
    """Deterministic mode: one lane at a time, its cells on the grid."""

    def __init__(self, pool: CellPool, pad_seq: int, layout: Layout) -> None:
        self.pool = pool
        self.pad_seq = pad_seq
        self.layout = layout
        #: The cell of position 0 for each lane (position p sits at base + p).
        self._bases: dict[int, int] = {}
        self.stats = PlacementStats()

    def before_decode(self, planned: list[Planned], evict_one: Callable[[], bool]) -> None:
        """Steer the step's one run (deterministic mode decodes one lane per step)."""
        (item,) = planned
        lane = item.lane
        self.steer(lane.seq_id, item.p0, item.p1 - item.p0, lane.reserve - item.p0, evict_one)

    def steer(self, seq_id: int, p0: int, n_tokens: int, remaining: int, evict_one: Callable[[], bool]) -> bool:
        """Make the lane's next `n_tokens` (from position `p0`) land on cells aligned with their positions.

        The lane's own cells form one run whose first cell is congruent to its
        first position mod 64 and lies after the cells it copied from the
        cache; `remaining` cells are kept free for the rest of its run, evicting
        cache entries (`evict_one`) when no such run exists. False when none
        exists even with the cache empty: the step still runs, but is not
        bit-exact (counted in `unaligned_steps`).
        """
        cells = self.pool.cells
        base = self._bases.get(seq_id)
        if base is None:
            while (target := aligned_target(cells, cells.last_cell(seq_id), p0, remaining)) is None:
                if not evict_one():
                    self.stats.unaligned_steps += 1
                    return False
            base = self._bases[seq_id] = target - p0
        for _ in range(_PAD_ROUNDS):
            pad = pad_needed(cells, base + p0, n_tokens)
            if pad == 0:
                return True
            if not self._import_pad(pad):
                break
        self.stats.unaligned_steps += 1
        return False

    def release(self, seq_id: int, lanes_left: int) -> None:
        """A lane finished; with no lane left, the pad cells are freed too."""
        self._bases.pop(seq_id, None)
        if lanes_left == 0:
            self.pool.free(self.pad_seq)

    def _import_pad(self, count: int) -> bool:
        """`count` more pad cells; the import clears the pad sequence first, so its old cells come back too."""
        total = self.pool.cells.seq_len(self.pad_seq) + count
        payload = join(self.layout, [bytes(total * self.layout.token_bytes)], total, seq_id=self.pad_seq)
        if not self.pool.restore(self.pad_seq, payload, total):
            return False
        self.stats.pad_tokens += count
        return True
