"""What goes into the next `llama_decode`: one step's batch over the running lanes."""

from __future__ import annotations

import time
from dataclasses import dataclass

from skippy_cache.placement import ALIGN
from skippy_cache.prefill import next_chunk_end, step_rows
from skippy_cache.runtime.lane import Lane, Phase
from skippy_cache.runtime.native import Batch

#: Rows computed one at a time cost each the same whatever else shares their step, so a lane's rows
#: that join another's step only hold back that lane's first token. Other lanes' rows top up a step
#: only to this many rows: in so short a step, the cost every step pays once (reading the weights)
#: is worth sharing.
JOIN_ROWS = 16

#: How much sooner a cold prefill counts as finishing per second it has waited (`prefill_order`):
#: about half the prompt rows this project's 2-core machine computes a second, so a long prompt
#: behind a stream of shorter ones goes first once it has waited as long as their difference
#: would take to compute twice over.
AGING_ROWS_PER_S = 100.0


@dataclass(slots=True)
class Planned:
    """One lane's run of tokens in the batch: positions [p0, p1)."""

    lane: Lane
    p0: int
    p1: int
    #: Batch row whose logits are sampled, or -1 for a prefill chunk.
    row: int
    #: Guesses at the tokens after the sampled row's, each fed in a row of its own (the run's last
    #: rows: `guesses[i]` at position p1 - len(guesses) + i, row `row + 1 + i`): tokens the
    #: lane's grammar forces (jump-forward, after a decode's token or a prompt's last token), or
    #: a lone decode's guess from prompt lookup (drafts.py).
    guesses: tuple[int, ...] = ()
    #: The guesses are forced by the grammar (else they are a lookup's).
    forced: bool = False


def prefill_order(prefilling: list[Lane], lanes: list[Lane], short: int, now: float) -> list[Lane]:
    """The prefilling lanes in the order their rows go next: the cost of what waits on each.

    A lane with at most `short` rows left (a hit's question, a short prompt) goes
    before every longer one: its first token is a step away. Among the rest the
    one that finishes soonest goes first, its rows divided by the requests that
    wait for them (itself and the lanes joined to its prefix, inflight.py: one
    prefill serves them all), less `AGING_ROWS_PER_S` for each second it has
    waited, so a long prompt is not passed over forever. Each lane's rows are
    computed as its cold run computes them whatever the order, so the order
    changes when a token comes, never what it is.
    """
    waiting: dict[int, int] = {}
    for lane in lanes:
        if lane.phase is Phase.JOIN and lane.leader is not None:
            waiting[id(lane.leader)] = waiting.get(id(lane.leader), 0) + 1

    def key(lane: Lane) -> tuple[bool, float]:
        rows = lane.prefill_end - lane.n_past
        return rows > short, rows / (1 + waiting.get(id(lane), 0)) - AGING_ROWS_PER_S * (now - lane.t_submit)

    return sorted(prefilling, key=key)


class BatchBuilder:
    """Fills the batch so that first tokens come out early and a decode row's floats do not
    depend on what else runs.

    llama.cpp's CPU flash attention picks its kernel from the step's row count
    (EXACTNESS.md): 64 rows or more run a tiled kernel; 2 to 63 run row by row,
    each row over its own sequence's cells in cell order, whatever else is in
    the step or the pool; a lone row is split across threads at points that
    move with the pool's occupancy. So a step holds either decode rows or
    prefill chunks, never both, and a step of one row gets a pad row
    of a spare sequence: every decode row is computed row by row, the same
    alone or next to other lanes, and an exact repeat continues as its first
    run did. A lone decode row's second row is, where it can be, its lane's
    guessed next token instead (drafts.py): a step that guessed right yields two
    tokens, each with the floats of its own step. Steps alternate while both kinds wait:
    - a decode step: every decoding lane's next token (one row each, and the
      tokens its grammar forces after it: `_decode_rows`). It comes
      right after a prefill step, and whenever a lane's last prompt token waits:
      that first token would otherwise wait for another lane's whole prefill
      chunk, which takes hundreds of times as long as a decode step;
    - a prefill step: chunks, in `prefill_order` (short remaining prefills
      first, then the one that finishes soonest for the requests waiting on
      it). The first chunk may fill the step (the batch, or fewer rows when
      the KV view is wide: `step_rows`), or in fast mode `fill_tokens` rows
      while lanes decode (their next tokens wait for it); further lanes join only while
      the step holds fewer than `fill_tokens` tokens. Past that size a CPU
      matmul costs no less per token, so a larger step only makes the lanes
      ahead wait for the tokens of the lanes behind them.

    Deterministic mode computes each row with the kernel the request fixes
    (`Lane.kernels`, exact.py): a span of tiled rows (whole 64-token blocks) in
    chunks as large as a step, one lane's alone (the tiled kernel's floats
    do not depend on the chunk's size when the cells are aligned: steering.py);
    a span of rows computed one at a time (the prompt's last partial block, a
    resent reply's blocks) in steps of fewer than 64 rows, one lane's before
    the next lane's (a short step is topped up with other lanes' such rows);
    a lane whose last such rows fit takes its last prompt token along, so its
    first token comes out of that step.
    A hit resumes where the request's kernels allow, so every row is computed
    by the kernel the cold run used, whatever length was reused and whatever
    ran beside it.
    """

    def __init__(self, batch: Batch, grid: int, *, deterministic: bool, fill_tokens: int, pad_seq: int,
                 lone_last: bool = False, guess: bool = False, jump_forward: bool = False) -> None:
        self.batch = batch
        #: A lone decode row's second row is its lane's guessed next token rather than a pad row
        #: (drafts.py). Only where a sequence's last cell can be taken back (attention memory).
        self.guess = guess
        #: A decoding lane's grammar-forced next tokens ride in its decode step (`_decode_rows`).
        #: Only where a sequence's last cell can be taken back, as for guesses.
        self.jump_forward = jump_forward
        self.grid = grid
        self.deterministic = deterministic
        #: The last prompt token always gets a step of its own (recurrent memories, family.py):
        #: llama.cpp computes a one-token step of a recurrent layer by another path than a longer
        #: one, so a warm run must decode it the way the cold run's does whatever the hit's length.
        self.lone_last = lone_last
        self.fill_tokens = fill_tokens
        #: The spare sequence of the pad row.
        self.pad_seq = pad_seq
        #: This step is one row and needs a pad row (`add_pad_row`); the engine frees it after the decode.
        self.needs_pad = False
        self._last_step_prefilled = False

    def fill(self, lanes: list[Lane], view: int) -> list[Planned]:
        """The runs of this step's batch, in batch order (empty: nothing to decode), for a pool whose
        KV view is `view` cells wide (`CellMap.view`)."""
        batch = self.batch
        rows = step_rows(view, batch.capacity)
        batch.clear()
        self.needs_pad = False
        planned: list[Planned] = []
        decoding = [lane for lane in lanes if lane.phase in (Phase.LAST_TOKEN, Phase.DECODE)]
        prefilling = [lane for lane in lanes if lane.phase is Phase.PREFILL]

        last_token = any(lane.phase is Phase.LAST_TOKEN for lane in decoding)
        if decoding and not self.deterministic:
            # Every decoding lane's next token waits for this step: a step of `fill_tokens` rows
            # costs a little more per row than a full one and holds them half as long. (Not in
            # deterministic mode: there it kept every row exact, but the open loop measured it no
            # faster, TTFT and TPOT alike, and it places twice as many chunks.)
            rows = min(rows, max(self.fill_tokens, ALIGN))
        if prefilling and not (decoding and (self._last_step_prefilled or last_token)):
            # A prefill step holds no decode row: with 64 rows or more a decode row
            # would take the tiled kernel, and its floats would depend on what else runs.
            prefilling = prefill_order(prefilling, lanes, self.fill_tokens, time.perf_counter())
            if self.deterministic:
                planned += self._deterministic_chunks(prefilling, rows)
                self._last_step_prefilled = True
                return self._padded(planned)
            for lane in prefilling:
                first = not planned
                budget = rows - batch.n_tokens if first else self.fill_tokens - batch.n_tokens
                if budget <= 0:
                    break
                end = next_chunk_end(lane.n_past, lane.chunk_limit, budget, self.grid, must_progress=first)
                if end > lane.n_past:
                    planned.append(self._add_chunk(lane, end))
            self._last_step_prefilled = True
            return self._padded(planned)
        spare = ALIGN - 1 - len(decoding)
        for lane in decoding:
            planned.append(self._decode_rows(lane, spare))
            spare -= len(planned[-1].guesses)
        self._last_step_prefilled = False
        if len(planned) == 1 and self.guess and not planned[0].guesses:
            self._add_guess(planned[0])
        return self._padded(planned)

    def _decode_rows(self, lane: Lane, spare: int) -> Planned:
        """The lane's next token, and after it the tokens its grammar forces (jump-forward), each
        in a row of its own, while the step stays under 64 rows (`spare` more at most).

        A tool call's first chunk is its name, about fifteen tokens in, and most of
        them are fixed text (`<tool_call>\\n{"name": "`) or the rest of a name its first
        token settled. One per step, each waited for the other lanes' prefill steps
        in between. Under 64 rows every row is computed on its own, over its own
        sequence's cells, so a forced token's row has the floats its own step would
        have given it (the lookup guesses' argument, drafts.py): sampling still picks
        each token from its row, and where that is not the forced token (the chain
        banned it), the rows after it are taken back as a wrong guess's are. The
        output is the same as without jump-forward, bit for bit.
        """
        row = self.batch.add(lane.seq_id, [lane.next_token], lane.n_past, True)
        decode = Planned(lane, lane.n_past, lane.n_past + 1, row)
        self._add_forced(decode, spare)
        return decode

    def _add_forced(self, item: Planned, spare: int) -> None:
        """After the run whose last row is sampled: the tokens the lane's grammar forces next, each
        in a row of its own (at most `spare`, and none past the reply's `max_tokens`)."""
        lane = item.lane
        if not self.jump_forward:
            return
        forced = lane.sampler.forced(min(spare, lane.request.max_tokens - len(lane.generated) - 1))
        for i, token in enumerate(forced):
            self.batch.add(lane.seq_id, [token], item.p1 + i, True)
        item.p1 += len(forced)
        item.guesses, item.forced = tuple(forced), bool(forced)

    def _add_guess(self, decode: Planned) -> None:
        """In place of the pad row: the lane's guessed next token, when the token this step samples
        may not be its last (the guess would serve nothing after it)."""
        lane = decode.lane
        if lane.phase is not Phase.DECODE or len(lane.generated) + 1 >= lane.request.max_tokens:
            return
        guess = lane.guess()
        if guess is None:
            return
        self.batch.add(lane.seq_id, [guess], decode.p1, True)
        decode.p1 += 1
        decode.guesses = (guess,)

    def _deterministic_chunks(self, prefilling: list[Lane], rows: int) -> list[Planned]:
        """The first lane's next tiled rows alone, or its next rows that are computed one at a time,
        topped up to `JOIN_ROWS` with other lanes' such rows.

        Under 64 rows each row is computed on its own, so several lanes' such
        rows may share a step, and a span of them may take several steps; tiled
        rows share a step with no other lane's, so that it is always tiled.
        """
        lane = prefilling[0]
        if not lane.kernels.row_by_row(lane.n_past):
            span_end = min(lane.kernels.span_end(lane.n_past, lane.prefill_end), lane.chunk_limit)
            end = next_chunk_end(lane.n_past, span_end, rows, ALIGN, must_progress=True)
            return [self._add_chunk(lane, end)]
        planned = []
        for lane in prefilling:
            # The first lane's rows may fill the step; the others only top up a short one.
            room = (JOIN_ROWS if planned else ALIGN - 1) - self.batch.n_tokens
            if room > 0 and lane.kernels.row_by_row(lane.n_past):
                span_end = min(lane.kernels.span_end(lane.n_past, lane.prefill_end), lane.chunk_limit)
                end = min(span_end, lane.n_past + room)
                if end == lane.prefill_end and end - lane.n_past < room and not self.lone_last:
                    # The last prompt token too: it is computed row by row wherever it goes
                    # (exact.py), so it costs one more row here instead of a step of its own
                    # (a pass over the weights, and a pad row).
                    end += 1
                planned.append(self._add_chunk(lane, end))
                if end == len(lane.prompt):
                    # And the tokens a grammar forces at the reply's start (a required call's
                    # opening): computed row by row here too, so its first sampled token is the
                    # first one the grammar leaves open.
                    self._add_forced(planned[-1], ALIGN - 1 - self.batch.n_tokens)
        return planned

    def _padded(self, planned: list[Planned]) -> list[Planned]:
        self.needs_pad = self.batch.n_tokens == 1
        return planned

    def add_pad_row(self, pos: int) -> tuple[int, int, int]:
        """Add the pad row at `pos` (next to its sequence's other pads); returns its run."""
        self.batch.add(self.pad_seq, [0], pos, False)
        return (self.pad_seq, pos, pos + 1)

    def _add_chunk(self, lane: Lane, end: int) -> Planned:
        """The lane's prompt rows [n_past, end); a chunk that ends the prompt gives its first token's logits."""
        last = end == len(lane.prompt)
        row = self.batch.add(lane.seq_id, lane.prompt[lane.n_past : end], lane.n_past, last)
        return Planned(lane, lane.n_past, end, row if last else -1)
