"""What exact (deterministic) mode promises, in one place for the real-model tests: cache-on
output equals cache-off output bit for bit (EXACTNESS.md, exact.py)."""

from __future__ import annotations

import threading

import numpy as np
from fastmode import assert_logits_close

from skippy_cache.runtime import Engine
from skippy_cache.runtime.requests import DoneEvent, Event, GenerationRequest, TokenEvent


def assert_bit_exact(on, off, what: str) -> None:
    """A cache-on run's first-token logits and greedy text equal the cache-off run's, bit for bit."""
    diff = float(np.abs(on.first_logits - off.first_logits).max())
    assert diff == 0.0, f"{what} ({on.stats.cached_tokens} cached): logits differ by {diff}"
    assert on.tokens == off.tokens, f"{what}: greedy text differs"


def assert_as_cold(on, off, engine, deterministic: bool, what: str) -> None:
    """What each mode promises of a cache-on run against the cache-off one: bit for bit, every
    step on the grid (deterministic mode); first-token logits within the float noise (fast)."""
    if deterministic:
        assert_bit_exact(on, off, what)
        assert engine.stats().placement.unaligned_steps == 0
    else:
        assert_logits_close(on.first_logits, off.first_logits, what)


def run_all(engine: Engine, requests: list[GenerationRequest], wait_s: float = 120.0
            ) -> list[tuple[list[TokenEvent], DoneEvent]]:
    """The requests submitted at once; each one's token events (logprobs included, which
    `Engine.generate_many` does not keep) and end, within `wait_s` seconds each."""
    events: list[list[Event]] = [[] for _ in requests]
    done = [threading.Event() for _ in requests]

    def sink_for(i: int):  # type: ignore[no-untyped-def]
        def sink(event: Event) -> None:
            events[i].append(event)
            if isinstance(event, DoneEvent):
                done[i].set()
        return sink

    for i, r in enumerate(requests):
        engine.submit(r, sink_for(i))
    for d in done:
        assert d.wait(wait_s)
    return [([e for e in ev if isinstance(e, TokenEvent) and e.token >= 0], ev[-1])  # type: ignore[misc]
            for ev in events]
