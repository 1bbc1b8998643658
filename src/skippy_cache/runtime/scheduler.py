"""Admission and lane lifecycle: which waiting request runs next, and on which sequence id.

Admission takes turns between tenants (`GenerationRequest.tenant`). When a
lane's sequence id is free, the candidate is the oldest waiting request of the
tenant that holds the fewest running lanes; between tenants holding as many,
the one whose oldest waiting request was queued first. Plain FIFO would let one
tenant's flood fill the queue and then every lane, and hold another tenant's
request behind the whole flood; this way a tenant holding no lane goes first
as soon as one frees. With one tenant (or None for every request, a server
without tenants) the rule is FIFO in queue order. Scanning the queue for it
costs O(waiting) per admission: the queue holds at most `max_queue`.

The candidate is admitted when the cells of its whole run (prompt plus
max_tokens) fit beside the other lanes' reservations: a lane can then never be
starved of cells mid-generation, because everything else in the pool is
evictable cache.

A new request is refused (`QueueFullError`, HTTP 503 with `Retry-After`) when
`max_queue` requests wait, and when its tenant has requests waiting and either
the oldest of them has waited longer than `max_wait_s` or the new one would:
past saturation requests arrive faster than lanes free up, and queueing them all
would only make every time to first token grow without bound; refusing early
tells the client to come back (or go to another replica) while the requests
already accepted still get answered in time. The wait ahead is estimated from
the work ahead, in engine seconds: the running lanes' remaining prompt rows and
tokens, and each waiting request's prompt rows that no running, waiting or
recently finished prompt shares with it (those are a hit or a join by the time
it runs), at the rates the engine measures step by step. One engine computes
every lane's rows, so the queue drains at one engine second per second; a new
request gets a lane once all but the last L - 1 of the requests ahead of it
have ended. How long requests held their lanes lately (Little's law), the rule
before, counted a burst of cold prompts' time for the cheap hits queued behind
them and refused hits the server would have answered within seconds. The
oldest request's wait alone let the queue grow until its head had waited the
limit, and every request queued behind it then waited that long again. Its own
tenant's requests, not the queue's: admission takes turns, so a tenant with
nothing waiting is served at the next free lane however long a flooding
tenant's requests wait (without tenants the two are one).

The queue is shared with submitting threads: the engine holds its lock around
`enqueue`, `admit` and `take_cancelled`. Lanes belong to the engine thread.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from skippy_cache.runtime.inflight import shared_prefix
from skippy_cache.runtime.lane import Lane
from skippy_cache.runtime.remote import Prefetched
from skippy_cache.runtime.requests import EventSink, QueueFullError, RequestHandle


@dataclass(slots=True)
class Waiting:
    handle: RequestHandle
    sink: EventSink
    t_submit: float
    prefetched: Prefetched | None = None
    #: Prompt rows it will likely compute (`Scheduler.new_rows`); None: its whole prompt.
    new_rows: int | None = None


@dataclass(frozen=True, slots=True)
class Admission:
    waiting: Waiting
    seq_id: int
    #: Cells reserved for the request's whole run.
    reserve: int


#: Weight of the newest step (or finished request) in the engine's moving rates.
RATE_ALPHA = 0.1
#: Finished requests' prompts a new one is compared with: the entries a hit most likely comes from.
RECENT_PROMPTS = 32


@dataclass(slots=True)
class WorkRates:
    """Engine seconds per prompt row and per generated token, and tokens a request generates: moving
    sums of what the engine measured, so a few slow steps move them only a little."""

    prefill_s: float = 0.0
    prefill_rows: float = 0.0
    decode_s: float = 0.0
    decode_tokens: float = 0.0
    #: Tokens a finished request generated, on average; None until one finished.
    tokens_per_request: float | None = None

    def step(self, prefill_rows: int, decode_tokens: int, seconds: float) -> None:
        """One `llama_decode`: a prefill step (prompt rows) or a decode step (a token for each lane)."""
        if prefill_rows:
            self.prefill_s += RATE_ALPHA * (seconds - self.prefill_s)
            self.prefill_rows += RATE_ALPHA * (prefill_rows - self.prefill_rows)
        elif decode_tokens:
            self.decode_s += RATE_ALPHA * (seconds - self.decode_s)
            self.decode_tokens += RATE_ALPHA * (decode_tokens - self.decode_tokens)

    def finished(self, generated: int) -> None:
        old = self.tokens_per_request
        self.tokens_per_request = generated if old is None else old + RATE_ALPHA * (generated - old)

    def seconds(self, rows: int, tokens: int) -> float | None:
        """Engine seconds to compute `rows` prompt rows and generate `tokens`; None until measured."""
        if not self.prefill_rows or not self.decode_tokens:
            return None
        return rows * self.prefill_s / self.prefill_rows + tokens * self.decode_s / self.decode_tokens


class Scheduler:
    def __init__(self, lanes: int, n_ctx: int, max_queue: int, max_wait_s: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.n_ctx = n_ctx
        self.max_queue = max_queue
        #: 0: no limit on how long a request may wait for a lane.
        self.max_wait_s = max_wait_s
        self.waiting: deque[Waiting] = deque()
        self.lanes: list[Lane] = []
        #: Lane sequence ids 0..lanes-1, handed out from 0 up; a freed id is reused first.
        self._free_ids = list(range(lanes - 1, -1, -1))
        self._clock = clock
        #: Measured by the engine: what a prompt row and a generated token cost.
        self.rates = WorkRates()
        #: The prompts of the requests that ended last, newest last.
        self._recent: deque[list[int]] = deque(maxlen=RECENT_PROMPTS)

    @property
    def reserved_cells(self) -> int:
        return sum(lane.reserve for lane in self.lanes)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.lanes

    def enqueue(self, waiting: Waiting, *, also_waiting: int = 0) -> None:
        """Queue a request; `also_waiting` counts requests accepted but not queued yet (prefetching)."""
        self.check_room(also_waiting, waiting.handle.request.tenant)
        self.add_waiting(waiting)

    def add_waiting(self, waiting: Waiting) -> None:
        """Queue a request already counted against the limits (a prefetched one)."""
        if self.max_wait_s:
            waiting.new_rows = self.new_rows(waiting.handle.request.tokens)
        self.waiting.append(waiting)

    def new_rows(self, tokens: list[int]) -> int:
        """Prompt rows a request will likely compute: those past the longest prefix it shares with a
        running, waiting or recently finished prompt (by the time it runs, a hit or a join)."""
        others = [*(lane.request.tokens for lane in self.lanes),
                  *(w.handle.request.tokens for w in self.waiting), *self._recent]
        return len(tokens) - max((shared_prefix(tokens, other) for other in others), default=0)

    def check_room(self, also_waiting: int = 0, tenant: str | None = None) -> None:
        """Raise `QueueFullError` if a new request of `tenant` may not wait (module docstring)."""
        if len(self.waiting) + also_waiting >= self.max_queue:
            raise QueueFullError(f"the queue is full ({self.max_queue} waiting)")
        if not self.max_wait_s:
            return
        oldest = next((w for w in self.waiting if w.handle.request.tenant == tenant), None)
        if oldest is None:
            return
        waited = self._clock() - oldest.t_submit
        if waited > self.max_wait_s:
            raise QueueFullError(
                f"the server is saturated: the oldest waiting request has waited {waited:.0f} s "
                f"(limit {self.max_wait_s:g} s)", retry_after_s=max(1, math.ceil(waited - self.max_wait_s)))
        wait = self.expected_wait(also_waiting)
        if wait > self.max_wait_s:
            raise QueueFullError(
                f"the server is saturated: a new request would wait about {wait:.0f} s for a lane "
                f"(limit {self.max_wait_s:g} s)", retry_after_s=max(1, math.ceil(wait - self.max_wait_s)))

    def expected_wait(self, also_waiting: int = 0) -> float:
        """Seconds a new request, queued behind the waiting ones and `also_waiting` more, can expect to
        wait for a lane (module docstring); 0 until the engine has measured its rates."""
        ahead = len(self.waiting) + also_waiting
        ending = ahead + 1 - len(self._free_ids)  # requests that must end before a lane is free for it
        rates = self.rates
        if ending <= 0 or rates.tokens_per_request is None:
            return 0.0
        tokens = rates.tokens_per_request
        work = [rates.seconds(max(lane.prefill_end - lane.n_past, 0),
                              max(round(min(tokens, lane.request.max_tokens)) - len(lane.generated), 0))
                for lane in self.lanes]
        work += [rates.seconds(len(w.handle.request.tokens) if w.new_rows is None else w.new_rows,
                               round(min(tokens, w.handle.request.max_tokens))) for w in self.waiting]
        if None in work:
            return 0.0
        seconds = sum(work)  # type: ignore[arg-type]
        if also_waiting and self.waiting:
            seconds += also_waiting * seconds / (len(self.lanes) + len(self.waiting))
        return seconds * ending / (len(self.lanes) + ahead)

    def admit(self) -> Admission | None:
        """Take the request in turn (module docstring) if it may start now, with a lane id and its
        reservation."""
        if not self._free_ids or not self.waiting:
            return None
        index = self._next_index()
        waiting = self.waiting[index]
        request = waiting.handle.request
        reserve = len(request.tokens) + request.max_tokens
        # The request in turn waits for cells rather than letting a smaller one go ahead: smaller
        # requests keep arriving, and skipping to them would starve a large one forever.
        if self.reserved_cells + reserve > self.n_ctx:
            return None
        del self.waiting[index]
        return Admission(waiting, self._free_ids.pop(), reserve)

    def _next_index(self) -> int:
        """Where in `waiting` the request in turn sits: the first one whose tenant holds the fewest
        running lanes among the tenants waiting (the queue is not empty)."""
        running = Counter(lane.request.tenant for lane in self.lanes)
        best, fewest = 0, -1
        for index, waiting in enumerate(self.waiting):
            held = running[waiting.handle.request.tenant]
            # Strictly fewer: a later request of a tenant holding as many lanes is not in turn yet,
            # which keeps one tenant's requests, and tenants tied on lanes, in queue order.
            if fewest < 0 or held < fewest:
                best, fewest = index, held
                if held == 0:
                    break
        return best

    def start(self, lane: Lane) -> None:
        self.lanes.append(lane)

    def release(self, lane: Lane) -> None:
        """The lane's request ended: its sequence id is free again (its cells were freed by the caller)."""
        self.lanes.remove(lane)
        self._free_ids.append(lane.seq_id)
        self.rates.finished(len(lane.generated))
        self._recent.append(lane.request.tokens)

    def take_cancelled(self) -> list[Waiting]:
        """Remove and return the waiting requests whose callers gave up."""
        cancelled = [w for w in self.waiting if w.handle.cancelled]
        for waiting in cancelled:
            self.waiting.remove(waiting)
        return cancelled

    def cancel_all(self) -> None:
        for lane in self.lanes:
            lane.handle.cancel()
        for waiting in self.waiting:
            waiting.handle.cancel()
