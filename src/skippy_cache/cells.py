"""A physical mirror of llama.cpp's unified KV cell pool: the one source of truth for cells.

llama.cpp does not report through its sequence API which cells are used, nor
where the next batch will land, and with `kv_unified = true` `llama_memory_seq_cp`
does not copy: the destination joins the source's cells, so summing
per-sequence lengths over-counts. The runtime therefore books every event that
changes the pool here, in every mode: a successful `llama_decode`, `seq_cp`,
`seq_rm` and `llama_state_seq_set_data`. The fast mode reads `free_cells` before
a decode; the deterministic mode also reads where the next batch will land
(`find_slot`) to steer it (placement.py).

The rules are those of llama-cpp-python 0.3.36's vendored
`src/llama-kv-cache.cpp` (one stream, no SWA), one cell at a time there,
vectorised here:
- `find_slot(ubatch, cont=false)`: from `head`, restarting at 0 when
  `head > used + 2 * n_tokens`, wrapping at the end, the first `n_tokens` free
  cells in order (not necessarily contiguous); `apply_ubatch` then sets
  `head` past the last cell given.
- `seq_rm`: removing a sequence from a cell frees the cell when no sequence is
  left on it; `head` moves back to the first cell freed when that is lower.
- `seq_cp` (same stream): the destination is added to the source's cells in the
  range; a cell it already holds is left as is (the per-sequence position set
  ignores a duplicate).
- `state_read_meta` (one sequence): `seq_rm(seq, -1, -1)`, then
  `find_slot(ubatch, false)` for all its cells, then `apply_ubatch`.

One `llama_decode` is one ubatch here: the runtime sets `n_ubatch = n_batch`
(with smaller ubatches, llama.cpp re-applies the reset rule per ubatch).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

#: An open upper bound (llama.cpp: `std::numeric_limits<llama_pos>::max()`).
_OPEN = 1 << 62

_EMPTY = np.empty(0, np.int32)


class _Held:
    """One sequence's cells: `cells[i]` sits at position `first + i`, -1 where none.

    Owned by `CellMap`. Trimmed so both ends hold a cell: `first` is the
    sequence's lowest position and `first + len(cells) - 1` its highest.
    """

    __slots__ = ("first", "cells")

    def __init__(self, first: int, cells: np.ndarray) -> None:
        self.first = first
        self.cells = cells

    @property
    def end(self) -> int:
        return self.first + len(self.cells)

    def window(self, lo: int, hi: int) -> np.ndarray:
        """Cells at positions [lo, hi), -1 where none (a fresh array)."""
        out = np.full(hi - lo, -1, np.int32)
        a, b = max(lo, self.first), min(hi, self.end)
        if a < b:
            out[a - lo : b - lo] = self.cells[a - self.first : b - self.first]
        return out


class CellMap:
    """Which cells each sequence holds, how many sequences hold each cell, and llama.cpp's `head`."""

    __slots__ = ("n_cells", "head", "_holders", "_used", "_seqs")

    def __init__(self, n_cells: int) -> None:
        if n_cells <= 0:
            raise ValueError(f"a pool needs cells, got n_cells={n_cells}")
        self.n_cells = n_cells
        #: Where llama.cpp's next slot search starts; moved by this map's events.
        #: Those keep every cell below head used, so the restart rule and the
        #: wrap never fire from them; tests set head to reach both.
        self.head = 0
        #: cell -> number of sequences holding it (llama.cpp's per-cell seq bitset, counted).
        self._holders = np.zeros(n_cells, np.int32)
        self._used = 0
        self._seqs: dict[int, _Held] = {}

    def copy(self) -> CellMap:
        """An independent copy, to try a series of events on before doing them for real."""
        twin = CellMap(self.n_cells)
        twin.head, twin._used = self.head, self._used
        twin._holders = self._holders.copy()
        twin._seqs = {seq: _Held(held.first, held.cells.copy()) for seq, held in self._seqs.items()}
        return twin

    # -- reads ---------------------------------------------------------------

    @property
    def holders(self) -> np.ndarray:
        """Sequences holding each cell (a read-only view)."""
        view = self._holders.view()
        view.flags.writeable = False
        return view

    @property
    def used_cells(self) -> int:
        """Distinct cells held by any sequence (llama.cpp's `cells.get_used()`)."""
        return self._used

    @property
    def free_cells(self) -> int:
        return self.n_cells - self._used

    @property
    def view(self) -> int:
        """One past the highest used cell (llama.cpp's `used_max_p1`): how wide every step's KV view is."""
        used = np.flatnonzero(self._holders)
        return int(used[-1]) + 1 if len(used) else 0

    def is_free(self, cell: int) -> bool:
        return bool(self._holders[cell] == 0)

    def sequences(self) -> list[int]:
        """Ids of the sequences holding cells, ascending."""
        return sorted(self._seqs)

    def pos_max(self, seq: int) -> int:
        """Mirrors `llama_memory_seq_pos_max`: -1 for an empty sequence."""
        held = self._seqs.get(seq)
        return held.end - 1 if held is not None else -1

    def seq_len(self, seq: int) -> int:
        """Positions `seq` holds."""
        held = self._seqs.get(seq)
        return int(np.count_nonzero(held.cells >= 0)) if held is not None else 0

    def last_cell(self, seq: int) -> int:
        """The highest cell `seq` holds, -1 if none."""
        held = self._seqs.get(seq)
        return int(held.cells.max()) if held is not None else -1

    def cell_at(self, seq: int, pos: int) -> int:
        """The cell holding `seq`'s position `pos`, -1 if none."""
        held = self._seqs.get(seq)
        if held is None or not held.first <= pos < held.end:
            return -1
        return int(held.cells[pos - held.first])

    def seq_cells(self, seq: int) -> dict[int, int]:
        """{position: cell} of `seq` (a copy)."""
        held = self._seqs.get(seq)
        if held is None:
            return {}
        at = np.flatnonzero(held.cells >= 0)
        return dict(zip((at + held.first).tolist(), held.cells[at].tolist(), strict=True))

    def cells_of(self, seq: int) -> np.ndarray:
        """The cells `seq` holds, in position order (a fresh array)."""
        held = self._seqs.get(seq)
        return held.cells[held.cells >= 0] if held is not None else _EMPTY.copy()

    def state_order(self, seq: int) -> list[int]:
        """The positions of `seq` in the order `llama_state_seq_get_data` writes them: by ascending cell.

        Pass it to `restore` when the sequence's cells were not in position
        order, so the restored positions land where llama.cpp puts them.
        """
        held = self._seqs.get(seq)
        if held is None:
            return []
        at = np.flatnonzero(held.cells >= 0)
        return (at[np.argsort(held.cells[at], kind="stable")] + held.first).tolist()

    def owners(self, lane_limit: int) -> np.ndarray:
        """Each cell's owner kind: 0 free, 1 held by lanes only (sequences below `lane_limit`),
        2 by cache entries only, 3 by both (a lane sharing an entry's cells)."""
        kinds = np.zeros(self.n_cells, np.int8)
        for seq, held in self._seqs.items():
            cells = held.cells[held.cells >= 0]
            kinds[cells] |= 1 if seq < lane_limit else 2
        return kinds

    def cells_held(self, seqs: Iterable[int], *, prefix: tuple[int, int] | None = None) -> int:
        """Distinct cells held by any of these sequences (a cell they share counts once), and with
        `prefix=(seq, n)` by `seq`'s positions below `n` (what a `seq_cp(seq, dst, 0, n)` would share)."""
        mask = self._mask(seqs)
        if prefix is not None and (source := self._seqs.get(prefix[0])) is not None:
            window = source.window(source.first, max(prefix[1], source.first))
            mask[window[window >= 0]] = True
        return int(np.count_nonzero(mask))

    def covered(self, seqs: Iterable[int], by: Iterable[int]) -> set[int]:
        """Those of `seqs` each of whose cells one of the sequences `by` holds too: removing one of
        them (and none of `by`) frees no cell."""
        mask = self._mask(by)
        out = set()
        for seq in seqs:
            held = self._seqs.get(seq)
            if held is None or mask[held.cells[held.cells >= 0]].all():
                out.add(seq)
        return out

    def _mask(self, seqs: Iterable[int]) -> np.ndarray:
        """A fresh mask of the cells any of these sequences holds."""
        mask = np.zeros(self.n_cells, np.bool_)
        for seq in seqs:
            if (held := self._seqs.get(seq)) is not None:
                mask[held.cells[held.cells >= 0]] = True
        return mask

    def cells_freed_by_removing(self, seqs: set[int]) -> int:
        """Cells that removing these sequences would free: those no other sequence holds."""
        held = [self._seqs[s].cells for s in seqs if s in self._seqs]
        if not held:
            return 0
        cells = np.concatenate(held)
        # A sequence holds a cell at most once, so a cell is freed when these sequences hold it as
        # many times as it has holders. Counted over their cells, not the pool's: an eviction scan
        # asks this of every candidate entry.
        distinct, counts = np.unique(cells[cells >= 0], return_counts=True)
        return int(np.count_nonzero(counts == self._holders[distinct]))

    def search_start(self, n_tokens: int) -> int:
        """The cell llama.cpp's `find_slot` starts from for a batch of `n_tokens`."""
        # llama-kv-cache.cpp: "if we have enough unused cells before the current
        # head -> better to start searching from the beginning of the cache".
        return 0 if self.head > self._used + 2 * n_tokens else self.head

    def find_slot(self, n_tokens: int) -> list[int] | None:
        """The cells the next `llama_decode` of `n_tokens` gets, in batch order (None: no slot)."""
        slot = self._slot(n_tokens)
        return None if slot is None else slot.tolist()

    # -- events --------------------------------------------------------------

    def decode(self, runs: Sequence[tuple[int, int, int]]) -> list[int]:
        """Book a successful `llama_decode` of (seq, p0, p1) runs, in batch order; the cells given.

        Raises ValueError, changing nothing, when llama.cpp would have found no
        slot or a sequence would hold two cells at one position.
        """
        runs = [(seq, p0, p1) for seq, p0, p1 in runs if p1 != p0]
        n = 0
        for seq, p0, p1 in runs:
            if p1 < p0 or p0 < 0:
                raise ValueError(f"seq {seq}: bad run [{p0}, {p1})")
            held = self._seqs.get(seq)
            # Appending past pos_max (the usual case) cannot clash: skip the window.
            if held is not None and p0 < held.end and p1 > held.first and np.any(held.window(p0, p1) >= 0):
                raise ValueError(f"seq {seq} decodes [{p0}, {p1}) but already holds cells there")
            n += p1 - p0
        if len({seq for seq, _, _ in runs}) < len(runs):
            spans = sorted(runs)
            for (seq_a, _, end_a), (seq_b, start_b, _) in zip(spans, spans[1:], strict=False):
                if seq_a == seq_b and start_b < end_a:
                    raise ValueError(f"seq {seq_a} appears twice at one position in the batch")
        if n == 0:
            return []
        slot = self._slot(n)
        if slot is None:
            raise ValueError(f"no slot for {n} tokens ({self.free_cells} free of {self.n_cells})")
        i = 0
        for seq, p0, p1 in runs:
            self._write(seq, p0, slot[i : i + p1 - p0])
            i += p1 - p0
        self._holders[slot] += 1  # the slot's cells are distinct and were free
        self._used += n
        self.head = int(slot[-1]) + 1
        return slot.tolist()

    def restore(self, seq: int, n: int, order: Sequence[int] | None = None) -> list[int] | None:
        """`llama_state_seq_set_data` of a saved sequence of `n` cells at positions [0, n); the cells given.

        llama.cpp (`state_read_meta`) clears `seq`, then places the cells with
        `find_slot(ubatch, cont=false)`: the first `n` free cells from `head`,
        not necessarily contiguous, position `order[i]` on the i-th (`order`
        defaults to 0..n-1; a payload lists positions by ascending source cell,
        see `state_order`). Returns None when llama.cpp refuses (n > n_cells,
        or fewer than n free cells once `seq` is cleared); `seq` is then
        cleared all the same, as llama.cpp's `state_clear` leaves it. An empty
        payload (n == 0) changes nothing, `seq` included.
        """
        if seq < 0:
            raise ValueError(f"restore into seq {seq}: a whole-context restore is not mirrored")
        positions = None if order is None else np.asarray(order, np.int64)
        if positions is not None:
            ordered = np.sort(positions)
            if len(positions) != n or (n and (ordered[0] < 0 or np.any(ordered[1:] == ordered[:-1]))):
                raise ValueError(f"restore of seq {seq}: order must be {n} distinct positions >= 0")
        if n == 0:
            return []
        self.seq_rm(seq)
        slot = self._slot(n)
        if slot is None:
            return None
        if positions is None:
            self._seqs[seq] = _Held(0, slot.copy())
        else:
            first = int(ordered[0])
            cells = np.full(int(ordered[-1]) - first + 1, -1, np.int32)
            cells[positions - first] = slot
            self._seqs[seq] = _Held(first, cells)
        self._holders[slot] += 1
        self._used += n
        self.head = int(slot[-1]) + 1
        return slot.tolist()

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """`llama_memory_seq_cp`: dst joins src's cells in [p0, p1) (negative: open); nothing is copied.

        Raises ValueError, changing nothing, when dst already holds a different
        cell at one of those positions (llama.cpp would let a sequence hold two).
        """
        held = self._seqs.get(src)
        if held is None or src == dst:
            return
        lo, hi = max(p0, 0, held.first), min(p1 if p1 >= 0 else _OPEN, held.end)
        if lo >= hi:
            return
        incoming = held.cells[lo - held.first : hi - held.first]
        target = self._seqs.get(dst)
        if target is None:
            new = incoming >= 0
        else:
            existing = target.window(lo, hi)
            new = (incoming >= 0) & (existing < 0)
            clash = (incoming >= 0) & (existing >= 0) & (incoming != existing)
            if clash.any():
                pos = lo + int(np.argmax(clash))
                raise ValueError(f"seq_cp {src}->{dst}: position {pos} would hold two different cells")
        at = np.flatnonzero(new)
        if at.size == 0:
            return
        self._write(dst, lo + int(at[0]), np.where(new, incoming, -1)[at[0] : at[-1] + 1])
        self._holders[incoming[at]] += 1  # cells src holds: used already

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """`llama_memory_seq_rm(seq, p0, p1)`: negative bounds are open; seq < 0 means every sequence."""
        lo, hi = max(p0, 0), p1 if p1 >= 0 else _OPEN
        if lo >= hi:
            return
        first_freed = self.n_cells
        for s in list(self._seqs) if seq < 0 else [seq]:
            first_freed = min(first_freed, self._remove(s, lo, hi))
        # "If we freed up a slot, set head to it so searching can start there."
        if first_freed < self.head:
            self.head = first_freed

    def check_invariants(self) -> None:
        counts = np.zeros(self.n_cells, np.int64)
        for seq, held in self._seqs.items():
            assert held.cells.dtype == np.int32, f"seq {seq}: cells stored as {held.cells.dtype}"
            assert len(held.cells) and held.cells[0] >= 0 and held.cells[-1] >= 0, f"seq {seq} is not trimmed"
            assert held.first >= 0, f"seq {seq} starts at position {held.first}"
            cells = held.cells[held.cells >= 0]
            assert cells.max() < self.n_cells, f"seq {seq} holds cell {cells.max()} past the pool"
            # One cell per position is the layout; one position per cell is checked here.
            assert len(np.unique(cells)) == len(cells), f"seq {seq} holds a cell at two positions"
            counts[cells] += 1
        assert np.array_equal(counts, self._holders), "holders disagree with the sequences' cells"
        assert self._used == np.count_nonzero(self._holders), f"used {self._used} != cells with holders"
        assert 0 <= self.head <= self.n_cells, f"head {self.head} outside the pool"

    # -- internals -----------------------------------------------------------

    def _slot(self, n_tokens: int) -> np.ndarray | None:
        if n_tokens <= 0:
            return _EMPTY
        if n_tokens > self.n_cells:
            return None
        start = self.search_start(n_tokens)
        free = self._holders == 0
        # Most batches fit right after head: look there before scanning the pool.
        near = np.flatnonzero(free[start : start + 4 * n_tokens + 64])
        if len(near) >= n_tokens:
            return (near[:n_tokens] + start).astype(np.int32)
        found = np.concatenate((np.flatnonzero(free[start:]) + start, np.flatnonzero(free[:start])))
        if len(found) < n_tokens:
            return None
        return found[:n_tokens].astype(np.int32)

    def _write(self, seq: int, first: int, cells: np.ndarray) -> None:
        """Put `cells` (-1: leave as is) at positions from `first`; ends of `cells` hold a cell."""
        held = self._seqs.get(seq)
        if held is None:
            self._seqs[seq] = _Held(first, cells.astype(np.int32, copy=True))
            return
        end = first + len(cells)
        if first == held.end:  # appending, the common case
            held.cells = np.concatenate((held.cells, cells))
            return
        lo, hi = min(first, held.first), max(end, held.end)
        if (lo, hi) != (held.first, held.end):
            grown = np.full(hi - lo, -1, np.int32)
            grown[held.first - lo : held.end - lo] = held.cells
            held.first, held.cells = lo, grown
        part = held.cells[first - held.first : end - held.first]
        np.copyto(part, cells, where=cells >= 0)

    def _remove(self, seq: int, lo: int, hi: int) -> int:
        """Take `seq` off its cells at positions [lo, hi); the lowest cell freed (n_cells: none)."""
        held = self._seqs.get(seq)
        if held is None:
            return self.n_cells
        a, b = max(lo, held.first), min(hi, held.end)
        if a >= b:
            return self.n_cells
        part = held.cells[a - held.first : b - held.first]
        gone = part[part >= 0]
        self._holders[gone] -= 1  # a sequence holds each cell at one position only
        freed = gone[self._holders[gone] == 0]
        self._used -= len(freed)
        if a == held.first and b == held.end:
            del self._seqs[seq]
        else:
            part[:] = -1
            kept = np.flatnonzero(held.cells >= 0)
            held.cells = held.cells[kept[0] : kept[-1] + 1].copy()
            held.first += int(kept[0])
        return int(freed.min()) if len(freed) else self.n_cells
