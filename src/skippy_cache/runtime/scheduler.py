"""Admission and lane lifecycle: which waiting request runs next, and on which sequence id.

Requests wait in FIFO order. The head is admitted when a lane's sequence id
is free and the cells of its whole run (prompt plus max_tokens) fit beside the
other lanes' reservations: a lane can then never be starved of cells
mid-generation, because everything else in the pool is evictable cache.

The queue is shared with submitting threads: the engine holds its lock around
`enqueue`, `admit` and `take_cancelled`. Lanes belong to the engine thread.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from skippy_cache.runtime.lane import Lane
from skippy_cache.runtime.requests import EventSink, QueueFullError, RequestHandle
from skippy_cache.runtime.remote import Prefetched


@dataclass(slots=True)
class Waiting:
    handle: RequestHandle
    sink: EventSink
    t_submit: float
    prefetched: Prefetched | None = None


@dataclass(frozen=True, slots=True)
class Admission:
    waiting: Waiting
    seq_id: int
    #: Cells reserved for the request's whole run.
    reserve: int


class Scheduler:
    def __init__(self, lanes: int, n_ctx: int, max_queue: int) -> None:
        self.n_ctx = n_ctx
        self.max_queue = max_queue
        self.waiting: deque[Waiting] = deque()
        self.lanes: list[Lane] = []
        #: Lane sequence ids 0..lanes-1, handed out from 0 up; a freed id is reused first.
        self._free_ids = list(range(lanes - 1, -1, -1))

    @property
    def reserved_cells(self) -> int:
        return sum(lane.reserve for lane in self.lanes)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.lanes

    def enqueue(self, waiting: Waiting, *, also_waiting: int = 0) -> None:
        """Queue a request; `also_waiting` counts requests accepted but not queued yet (prefetching)."""
        self.check_room(also_waiting)
        self.waiting.append(waiting)

    def check_room(self, also_waiting: int = 0) -> None:
        if len(self.waiting) + also_waiting >= self.max_queue:
            raise QueueFullError(f"the queue is full ({self.max_queue} waiting)")

    def admit(self) -> Admission | None:
        """Take the head of the queue if it may start now, with a lane id and its reservation."""
        if not self._free_ids or not self.waiting:
            return None
        request = self.waiting[0].handle.request
        reserve = len(request.tokens) + request.max_tokens
        if self.reserved_cells + reserve > self.n_ctx:
            return None
        return Admission(self.waiting.popleft(), self._free_ids.pop(), reserve)

    def start(self, lane: Lane) -> None:
        self.lanes.append(lane)

    def release(self, lane: Lane) -> None:
        """The lane's request ended: its sequence id is free again (its cells were freed by the caller)."""
        self.lanes.remove(lane)
        self._free_ids.append(lane.seq_id)

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
