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
    """Fills the batch so that first tokens come out early.

    Fast mode, in this order:
    - every decoding lane's next token (one row each);
    - when a lane's last prompt token is among them, nothing else: its first
      token would otherwise wait for another lane's whole prefill chunk, which
      takes hundreds of times as long as a decode row;
    - prefill chunks, short remaining prefills first, then in arrival order.
      The first chunk may fill the batch; further lanes join only while the
      step holds fewer than `fill_tokens` tokens. Past that size a CPU matmul
      costs no less per token, so a larger step only makes the lanes ahead
      wait for the tokens of the lanes behind them.

    Deterministic mode never lets a prefill chunk share a decode with other
    lanes' tokens and alternates prefill and decode steps, so a chunk's floats
    do not depend on what else runs.
    """

    def __init__(self, batch: Batch, grid: int, *, deterministic: bool, fill_tokens: int) -> None:
        self.batch = batch
        self.grid = grid
        self.deterministic = deterministic
        self.fill_tokens = fill_tokens
        self._last_step_prefilled = False

    def fill(self, lanes: list[Lane]) -> list[Planned]:
        """The runs of this step's batch, in batch order (empty: nothing to decode)."""
        batch = self.batch
        batch.clear()
        planned: list[Planned] = []
        decoding = [lane for lane in lanes if lane.phase in (Phase.LAST_TOKEN, Phase.DECODE)]
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
        if self.deterministic or any(lane.phase is Phase.LAST_TOKEN for lane in decoding):
            return planned
        prefilling.sort(key=lambda lane: (lane.prefill_end - lane.n_past > self.fill_tokens, lane.t_submit))
        for lane in prefilling:
            first = not any(p.row < 0 for p in planned)
            budget = batch.capacity - batch.n_tokens if first else self.fill_tokens - batch.n_tokens
            if budget <= 0:
                break
            end = next_chunk_end(lane.n_past, lane.prefill_end, budget, self.grid, must_progress=first)
            if end > lane.n_past:
                planned.append(self._add_chunk(lane, end))
                self._last_step_prefilled = True
        return planned

    def _add_chunk(self, lane: Lane, end: int) -> Planned:
        self.batch.add(lane.seq_id, lane.prompt[lane.n_past : end], lane.n_past, False)
        return Planned(lane, lane.n_past, end, -1)
