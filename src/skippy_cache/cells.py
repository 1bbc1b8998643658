"""Distinct-cell accounting for llama.cpp's unified KV pool.

With `kv_unified = true`, `llama_memory_seq_cp` does not copy: it adds the
destination sequence to the source's cells. A cache entry recorded from a lane
that itself started from a copied entry therefore shares cells with it, and
summing per-sequence lengths over-counts. llama.cpp does not report used cells
through the sequence API, so the runtime mirrors every decode, copy and removal
here and asks this ledger how many cells are in use.

A cell is named by (origin, position): the origin is the decode run that wrote
it. A sequence holds sorted, non-overlapping segments (origin, p0, p1). A cell
is used while any sequence holds it, exactly as llama.cpp frees a cell when its
last sequence leaves it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Segment:
    origin: int
    p0: int
    #: Exclusive.
    p1: int


class CellLedger:
    def __init__(self, n_cells: int) -> None:
        self.n_cells = n_cells
        self._seqs: dict[int, list[Segment]] = {}
        #: The origin each sequence is appending to. A decode extends it in
        #: place instead of opening a segment per generated token; it closes on
        #: any removal or copy into the sequence, because positions past its end
        #: may then be held by entries recorded from an earlier run.
        self._open: dict[int, int] = {}
        self._next_origin = 0
        self._used: int | None = 0

    def on_decode(self, seq_id: int, p0: int, p1: int) -> None:
        """`seq_id` wrote fresh cells at positions [p0, p1)."""
        if p1 <= p0:
            return
        segments = self._seqs.setdefault(seq_id, [])
        if segments and segments[-1].p1 > p0:
            raise ValueError(f"seq {seq_id} decodes at {p0} but already holds up to {segments[-1].p1}")
        last = segments[-1] if segments else None
        if last is not None and last.p1 == p0 and self._open.get(seq_id) == last.origin:
            segments[-1] = Segment(last.origin, last.p0, p1)
        else:
            self._next_origin += 1
            self._open[seq_id] = self._next_origin
            segments.append(Segment(self._next_origin, p0, p1))
        self._used = None

    def on_seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """`llama_memory_seq_cp(src, dst, p0, p1)`: dst joins src's cells in [p0, p1) (negative: open)."""
        lo, hi = _bounds(p0, p1)
        copied = [Segment(s.origin, max(s.p0, lo), min(s.p1, hi)) for s in self._seqs.get(src, [])]
        copied = [s for s in copied if s.p1 > s.p0]
        if not copied or src == dst:
            return
        merged: list[Segment] = []
        for seg in sorted(self._seqs.get(dst, []) + copied, key=lambda s: (s.p0, s.p1)):
            last = merged[-1] if merged else None
            if last is not None and seg.p0 < last.p1:
                if seg.origin != last.origin:
                    raise ValueError(f"seq_cp {src}->{dst}: position {seg.p0} would hold two different cells")
                # Cells dst already holds: llama.cpp adds dst to them again, a no-op.
                merged[-1] = Segment(last.origin, last.p0, max(last.p1, seg.p1))
            else:
                merged.append(seg)
        self._seqs[dst] = merged
        self._open.pop(dst, None)
        self._used = None

    def on_seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> None:
        """`llama_memory_seq_rm(seq, p0, p1)`: negative bounds are open; seq_id < 0 means every sequence."""
        if seq_id < 0:
            for seq in list(self._seqs):
                self.on_seq_rm(seq, p0, p1)
            return
        lo, hi = _bounds(p0, p1)
        if lo >= hi:
            return
        self._open.pop(seq_id, None)
        segments = self._seqs.get(seq_id)
        if not segments:
            return
        kept: list[Segment] = []
        for s in segments:
            if s.p1 <= lo or s.p0 >= hi:
                kept.append(s)
                continue
            if s.p0 < lo:
                kept.append(Segment(s.origin, s.p0, lo))
            if s.p1 > hi:
                kept.append(Segment(s.origin, hi, s.p1))
        if kept:
            self._seqs[seq_id] = kept
        else:
            del self._seqs[seq_id]
        self._used = None

    def seq_len(self, seq_id: int) -> int:
        """Positions `seq_id` holds."""
        return sum(s.p1 - s.p0 for s in self._seqs.get(seq_id, []))

    def pos_max(self, seq_id: int) -> int:
        """Mirrors `llama_memory_seq_pos_max`: -1 for an empty sequence."""
        segments = self._seqs.get(seq_id)
        return segments[-1].p1 - 1 if segments else -1

    @property
    def used_cells(self) -> int:
        if self._used is None:
            self._used = _distinct(self._seqs.values())
        return self._used

    @property
    def free_cells(self) -> int:
        return self.n_cells - self.used_cells

    def cells_freed_by_removing(self, seq_ids: set[int]) -> int:
        """Cells that removing these sequences would free: those no other sequence holds."""
        rest = [segments for seq, segments in self._seqs.items() if seq not in seq_ids]
        return self.used_cells - _distinct(rest)


def _bounds(p0: int, p1: int) -> tuple[int, int]:
    return (max(p0, 0), p1 if p1 >= 0 else 1 << 62)


def _distinct(all_segments: Iterable[list[Segment]]) -> int:
    by_origin: dict[int, list[tuple[int, int]]] = {}
    for segments in all_segments:
        for s in segments:
            by_origin.setdefault(s.origin, []).append((s.p0, s.p1))
    total = 0
    for intervals in by_origin.values():
        intervals.sort()
        cur_lo, cur_hi = intervals[0]
        for lo, hi in intervals[1:]:
            if lo > cur_hi:
                total += cur_hi - cur_lo
                cur_lo, cur_hi = lo, hi
            else:
                cur_hi = max(cur_hi, hi)
        total += cur_hi - cur_lo
    return total
