"""The KV cell pool: the only caller of llama.cpp's sequence operations, and their one mirror.

Every decode, copy, removal, export and restore goes through `CellPool`, which
books it in a `CellMap` (a mirror of llama.cpp's allocator) right after
llama.cpp acts. llama.cpp does not report used cells, so the mirror is how the
engine evicts before a decode instead of letting it fail for want of a slot,
and how deterministic mode steers cells onto the alignment grid. One mirror fed
from one place cannot drift from a second one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from skippy_cache.cells import CellMap
from skippy_cache.runtime.native import Batch, NativeContext

#: (sequence, first position, end position) of one run of tokens in a batch.
Run = tuple[int, int, int]


class CellPool:
    def __init__(self, ctx: NativeContext, *, whole_entries: bool = False) -> None:
        self.ctx = ctx
        self.n_ctx = ctx.n_ctx
        self.cells = CellMap(ctx.n_ctx)
        #: The model keeps recurrent state (family.py): a copy takes the source's latest state,
        #: whatever the range, so only a copy of a whole sequence is exact.
        self.whole_entries = whole_entries

    @property
    def used_cells(self) -> int:
        return self.cells.used_cells

    @property
    def free_cells(self) -> int:
        return self.cells.free_cells

    def warm_up(self, token: int) -> bytearray:
        """One throwaway decode: a fresh context's first `llama_decode` allocates its
        compute buffers, which would otherwise land on the first request's TTFT.
        Returns that one-token sequence's state: its layout is every state's layout.

        It runs on a thread of its own that then ends. llama.cpp's CPU backend
        computes each graph with an OpenMP team that belongs to the calling
        thread, and a team left on one thread (the one that builds the engine)
        slows graphs computed on another (the engine's): one-row decodes took
        8 to 11 ms instead of 5 here, the engine's decode steps (two rows or
        more) about 6% longer. A thread that ends takes its team with it.
        """
        # Leaving the block joins the executor's one thread: its team is gone before the engine's.
        with ThreadPoolExecutor(1, thread_name_prefix="skippy-warm-up") as thread:
            return thread.submit(self._warm_up, token).result()

    def _warm_up(self, token: int) -> bytearray:
        batch = Batch(1)
        batch.add(0, [token], 0, True)
        if self.decode(batch, [(0, 0, 1)]) != 0:
            raise RuntimeError("llama_decode failed on a one-token warm-up: the context is unusable")
        state = self.export(0)
        self.free(0)
        return state

    def decode(self, batch: Batch, runs: Sequence[Run]) -> int:
        """`llama_decode` of a batch holding `runs` in batch order; 0 on success (1: no slot, <0: error)."""
        status = self.ctx.decode(batch)
        if status == 0:
            self.cells.decode(runs)
        return status

    def copy(self, src: int, dst: int, n: int) -> None:
        """`dst` joins `src`'s cells of positions [0, n): nothing is copied."""
        if self.whole_entries and n != self.cells.pos_max(src) + 1:
            # The copy would pair the attention cells of [0, n) with the recurrent state of the
            # source's end: confidently wrong logits, so it is a bug the caller must not reach.
            raise RuntimeError(f"copy of positions [0, {n}) from seq {src}, which holds "
                               f"{self.cells.pos_max(src) + 1}: a recurrent state cannot be cut")
        self.ctx.seq_cp(src, dst, 0, n)
        self.cells.seq_cp(src, dst, 0, n)

    def free(self, seq_id: int) -> None:
        self.ctx.seq_rm(seq_id, -1, -1)
        self.cells.seq_rm(seq_id)

    def trim(self, seq_id: int, keep: int) -> None:
        """Keep positions [0, keep) of the sequence."""
        # Keeping none is a whole removal, which a recurrent memory accepts; a cut it refuses.
        self.ctx.seq_rm(seq_id, keep if keep > 0 else -1, -1)
        self.cells.seq_rm(seq_id, keep, -1)

    def remove(self, seq_id: int, p0: int, p1: int) -> None:
        """Take the sequence off its cells of positions [p0, p1)."""
        self.ctx.seq_rm(seq_id, p0, p1)
        self.cells.seq_rm(seq_id, p0, p1)

    def export(self, seq_id: int) -> bytearray:
        """The sequence's exact state (`llama_state_seq_get_data`)."""
        return self.ctx.state_seq_get(seq_id)

    def restore(self, seq_id: int, payload: bytes | bytearray | memoryview, n: int, start: int = 0) -> bool:
        """Import a state of positions [start, start + n) into an empty sequence; False (and nothing
        held) if refused."""
        if not self.ctx.state_seq_set(seq_id, payload) or self.ctx.seq_pos_max(seq_id) != start + n - 1:
            # Refused (no room, bad bytes) or not the state the books promised.
            self.ctx.seq_rm(seq_id, -1, -1)
            return False
        if self.cells.restore(seq_id, n, range(start, start + n) if start else None) is None:
            raise RuntimeError(f"llama.cpp restored {n} cells into seq {seq_id} where the mirror has no room for them")
        return True

    def mismatches(self, seq_ids: Iterable[int]) -> list[str]:
        """Sequences whose llama.cpp `pos_max` differs from the mirror's (tests; a native call each)."""
        out = []
        for seq in sorted(set(seq_ids) | set(self.cells.sequences())):
            native, booked = self.ctx.seq_pos_max(seq), self.cells.pos_max(seq)
            if native != booked:
                out.append(f"seq {seq}: llama.cpp pos_max {native}, mirror {booked}")
        return out
