"""What goes into the next `llama_decode`: one step's batch over the running lanes."""

from __future__ import annotations

from dataclasses import dataclass

from skippy_cache.prefill import next_chunk_end
from skippy_cache.runtime.lane import Lane, Phase
from skippy_cache.runtime.native import Batch


@dataclass(slots=True)
class Planned:
    """One lane's run of tokens in the batch: positions [p0, p1)."""

    lane: Lane
    p0: int
    p1: int
    #: Batch row whose logits are sampled, or -1 for a prefill chunk.
    row: int


class BatchBuilder:
    """Fills the batch: decoding lanes first (one token each), then prefill chunks.

    Fast mode packs everything into one decode. Deterministic mode never lets a
    prefill chunk share a decode with other lanes' tokens and alternates
    prefill and decode steps, so a chunk's floats do not depend on what else runs.
    """

    def __init__(self, batch: Batch, grid: int, *, deterministic: bool) -> None:
        self.batch = batch
        self.grid = grid
        self.deterministic = deterministic
        self._last_step_prefilled = False

    def fill(self, lanes: list[Lane]) -> list[Planned]:
        """The runs of this step's batch, in batch order (empty: nothing to decode)."""
        batch = self.batch
        batch.clear()
        planned: list[Planned] = []
        decoding = [lane for lane in lanes if lane.phase is not Phase.PREFILL]
        prefilling = [lane for lane in lanes if lane.phase is Phase.PREFILL]

        if self.deterministic and prefilling and not (decoding and self._last_step_prefilled):
            # One grid step per chunk: a chunk's size picks the matmul kernel,
            # so a warm run resuming at any grid length must see exactly the
            # chunks the cold run saw from there on.
            lane = prefilling[0]
            budget = min(self.grid, batch.capacity)
            end = next_chunk_end(lane.n_past, lane.prefill_end, budget, self.grid, must_progress=True)
            planned.append(self._add_chunk(lane, end))
            self._last_step_prefilled = True
            return planned

        for lane in decoding:
            row = batch.add(lane.seq_id, [lane.next_token], lane.n_past, True)
            planned.append(Planned(lane, lane.n_past, lane.n_past + 1, row))
        self._last_step_prefilled = False
        if self.deterministic:
            return planned
        for lane in prefilling:
            budget = batch.capacity - batch.n_tokens
            first = not any(p.row < 0 for p in planned)
            end = next_chunk_end(lane.n_past, lane.prefill_end, budget, self.grid, must_progress=first)
            if end > lane.n_past:
                planned.append(self._add_chunk(lane, end))
                self._last_step_prefilled = True
        return planned

    def _add_chunk(self, lane: Lane, end: int) -> Planned:
        self.batch.add(lane.seq_id, lane.prompt[lane.n_past : end], lane.n_past, False)
        return Planned(lane, lane.n_past, end, -1)
