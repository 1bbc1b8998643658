"""Which physical KV cells llama.cpp will give a batch, and how to steer it.

Why it matters: on llama.cpp's CPU flash-attention kernel (one thread) the
logits are bit-identical only when each token's cell index agrees with its
position modulo 64 and a sequence's cells stay in position order (EXACTNESS.md;
measured: a 64- or 128-cell shift of the whole prompt changes nothing, a shift
of 1..32 cells changes the logits by ~0.7). llama.cpp's allocator is
first-fit from a moving head, so where a warm run's suffix lands depends on the
pool's history. Deterministic mode therefore mirrors the allocator here and,
before a lane's decode, fills the free cells that stand between the head and the
lane's aligned target with a pad sequence.

`CellMap` mirrors `llama_kv_cache::find_slot` / `apply_ubatch` / `seq_rm` /
`seq_cp` of llama.cpp's unified cache (no SWA): one cell at a time from `head`,
restarting from 0 when `head > used + 2 * n_tokens`, wrapping at the end;
`head` moves past the last cell used; removing cells moves `head` back to the
first cell freed when that is lower.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Cell alignment the flash-attention kernel's results depend on.
ALIGN = 64


@dataclass
class CellMap:
    n_cells: int
    head: int = 0
    #: seq id -> {position: cell}; owned by this map.
    seqs: dict[int, dict[int, int]] = field(default_factory=dict)
    #: cell -> number of sequences holding it.
    holders: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.holders:
            self.holders = [0] * self.n_cells
        self.used = sum(1 for h in self.holders if h)

    def is_free(self, cell: int) -> bool:
        return self.holders[cell] == 0

    def find_slot(self, n_tokens: int) -> list[int] | None:
        """The cells the next batch of `n_tokens` would get, in batch order (None: no slot)."""
        if n_tokens > self.n_cells:
            return None
        cur = self.head
        if cur > self.used + 2 * n_tokens:
            cur = 0
        found: list[int] = []
        tested = 0
        while len(found) < n_tokens:
            if tested >= self.n_cells:
                return None
            if cur >= self.n_cells:
                cur = 0
            if self.holders[cur] == 0:
                found.append(cur)
            cur += 1
            tested += 1
        return found

    def decode(self, runs: list[tuple[int, int, int]]) -> list[int]:
        """Book a batch of (seq, p0, p1) runs, in batch order; returns the cells given."""
        n = sum(p1 - p0 for _, p0, p1 in runs)
        cells = self.find_slot(n)
        if cells is None:
            raise ValueError(f"no slot for {n} tokens")
        i = 0
        for seq, p0, p1 in runs:
            held = self.seqs.setdefault(seq, {})
            for pos in range(p0, p1):
                held[pos] = cells[i]
                self._hold(cells[i])
                i += 1
        self.head = cells[-1] + 1
        return cells

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        hi = p1 if p1 >= 0 else 1 << 62
        held = self.seqs.setdefault(dst, {})
        for pos, cell in self.seqs.get(src, {}).items():
            if max(p0, 0) <= pos < hi and pos not in held:
                held[pos] = cell
                self._hold(cell)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        lo, hi = (max(p0, 0)), (p1 if p1 >= 0 else 1 << 62)
        held = self.seqs.get(seq)
        if not held:
            return
        first_freed = self.n_cells
        for pos in [p for p in held if lo <= p < hi]:
            cell = held.pop(pos)
            self.holders[cell] -= 1
            if self.holders[cell] == 0:
                self.used -= 1
                first_freed = min(first_freed, cell)
        if not held:
            del self.seqs[seq]
        self.head = min(self.head, first_freed)

    def last_cell(self, seq: int) -> int:
        held = self.seqs.get(seq)
        return max(held.values()) if held else -1

    def pos_max(self, seq: int) -> int:
        held = self.seqs.get(seq)
        return max(held) if held else -1

    def aligned_target(self, after: int, first_pos: int, length: int) -> int | None:
        """Lowest cell > `after`, congruent to `first_pos` mod ALIGN, starting `length` free cells."""
        start = after + 1
        start += (first_pos - start) % ALIGN
        while start + length <= self.n_cells:
            blocker = next((c for c in range(start, start + length) if self.holders[c]), None)
            if blocker is None:
                return start
            start = blocker + 1
            start += (first_pos - start) % ALIGN
        return None

    def pad_needed(self, target: int, n_tokens: int) -> int:
        """Free cells the allocator would use before `target` for a batch of `n_tokens` (0: it lands there)."""
        cells = self.find_slot(n_tokens)
        if cells is not None and cells == list(range(target, target + n_tokens)):
            return 0
        cur = self.head if self.head <= self.used + 2 * n_tokens else 0
        count = 0
        for step in range(self.n_cells):
            cell = (cur + step) % self.n_cells
            if cell == target:
                return count
            if self.holders[cell] == 0:
                count += 1
        return count

    def _hold(self, cell: int) -> None:
        if self.holders[cell] == 0:
            self.used += 1
        self.holders[cell] += 1
