"""The dashboard's history: requests that ended in the last ten minutes, in ten-second points.

Fed by the metrics (every finished request) and read by the dashboard, so it sits below both:
neither imports the other for it.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass

from skippy_cache.runtime import DoneEvent, FinishReason

#: Seconds of history the page shows, and the width of one point.
WINDOW_S = 600
STEP_S = 10


@dataclass(frozen=True, slots=True)
class _Done:
    at: float
    ttft_ms: float | None
    prompt_tokens: int
    cached_tokens: int
    tenant: str | None


class Timeline:
    """Finished requests of the last `WINDOW_S` seconds (fed from any thread)."""

    def __init__(self) -> None:
        self._done: deque[_Done] = deque()
        self._lock = threading.Lock()

    def add(self, done: DoneEvent, now: float | None = None, *, tenant: str | None = None) -> None:
        stats = done.stats
        answered = stats.completion_tokens > 0 and done.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        item = _Done(time.time() if now is None else now, stats.ttft_ms if answered else None,
                     stats.prompt_tokens, stats.cached_tokens, tenant)
        with self._lock:
            self._done.append(item)
            while self._done and self._done[0].at < item.at - WINDOW_S:
                self._done.popleft()

    def points(self, now: float | None = None, *, tenant: str | None = None) -> list[dict]:
        """One point per `STEP_S` seconds, oldest first: requests, hit ratio (cached / prompt tokens) and
        median TTFT of the requests that ended in it (None when none did); with `tenant`, its requests only."""
        now = time.time() if now is None else now
        start = now - WINDOW_S
        with self._lock:
            done = [d for d in self._done if d.at >= start and (tenant is None or d.tenant == tenant)]
        points = []
        for i in range(WINDOW_S // STEP_S):
            lo = start + i * STEP_S
            bucket = [d for d in done if lo <= d.at < lo + STEP_S]
            prompt = sum(d.prompt_tokens for d in bucket)
            ttfts = [d.ttft_ms for d in bucket if d.ttft_ms is not None]
            points.append({
                "t": round(lo + STEP_S - now),
                "requests": len(bucket),
                "hit_ratio": sum(d.cached_tokens for d in bucket) / prompt if prompt else None,
                "ttft_ms": statistics.median(ttfts) if ttfts else None,
            })
        return points
