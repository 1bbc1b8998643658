"""In-flight prefix sharing: a new lane whose prompt starts with what another
running lane is prefilling waits for those cells and shares them.

Without it, eight users who send one new system prompt at once prefill it
eight times: none of them finds it in the cache, because the cache records a
prompt only once its prefill is done. A joining lane instead skips prefill
until the leader's cells cover the shared prefix, then joins them with a
`seq_cp`, exactly as it would join a resident entry's cells: they hold the KV
of the same tokens at the same positions in the same space (model, layout,
namespace), so sharing them is as exact as a cache hit.
"""

from __future__ import annotations

import numpy as np

from skippy_cache.exact import exact_length
from skippy_cache.runtime.lane import Lane, Phase
from skippy_cache.runtime.pool import CellPool
from skippy_cache.tiers import CacheCounters


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` have in common."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differs = np.asarray(a[:n]) != np.asarray(b[:n])
    return int(differs.argmax()) if differs.any() else n


class InflightJoins:
    """Pairs a new lane with a running lane that is computing its prefix, and hands the cells over."""

    def __init__(self, pool: CellPool, counters: CacheCounters, grid: int, *, deterministic: bool = False) -> None:
        self.pool = pool
        self.counters = counters
        #: A join ends on the record grid (so the joiner's own prefill chunks stay
        #: on it) and must save at least this many tokens over the lane's hit.
        self.grid = max(grid, 1)
        #: A joiner shares only the leader's rows computed by the kernel its own cold run would use (exact.py).
        self.deterministic = deterministic

    def join(self, lane: Lane, lanes: list[Lane]) -> bool:
        """Join `lane` to the running lane that shares the longest prefix with it, if that beats its hit.

        True when the lane now waits for its leader (phase JOIN); False when it
        prefills on its own, or its leader's cells were there already and it
        joined them at once.
        """
        best: Lane | None = None
        best_at = lane.n_past
        for other in lanes:
            if other is lane or other.phase is Phase.JOIN or other.space != lane.space:
                continue
            common = min(shared_prefix(lane.prompt, other.prompt), lane.prefill_end, other.prefill_end)
            at = common - common % self.grid
            if self.deterministic:
                at = exact_length(at, other.kernels, lane.kernels)
            if at - lane.n_past >= self.grid and at > best_at:
                best, best_at = other, at
        if best is None:
            return False
        lane.leader, lane.join_at = best, best_at
        lane.phase = Phase.JOIN
        if best.n_past >= best_at:
            self._take(lane)
            return False
        return True

    def poll(self, lanes: list[Lane]) -> list[Lane]:
        """Hand cells to the waiting lanes whose leader has computed them; the lanes that stopped waiting.

        A leader that ended before computing them (cancelled, failed) leaves
        its joiner to prefill on its own from its hit.
        """
        done = []
        for lane in lanes:
            if lane.phase is not Phase.JOIN:
                continue
            leader = lane.leader
            if leader is None or leader not in lanes:
                self._leave(lane)
            elif leader.n_past >= lane.join_at:
                self._take(lane)
            else:
                continue
            done.append(lane)
        return done

    def _take(self, lane: Lane) -> None:
        assert lane.leader is not None
        # The lane's own hit may sit on other cells than the leader's for the
        # same positions: drop it first, so each position has one cell.
        self.pool.free(lane.seq_id)
        self.pool.copy(lane.leader.seq_id, lane.seq_id, lane.join_at)
        self.counters.joins += 1
        self.counters.join_tokens += lane.join_at - lane.n_past
        lane.n_past = lane.cached_tokens = lane.join_at
        lane.cache_source = "inflight"
        lane.miss_reason = None if lane.join_at >= lane.prefill_end else "diverged"
        self._leave(lane)

    @staticmethod
    def _leave(lane: Lane) -> None:
        lane.leader = None
        lane.phase = Phase.PREFILL
