"""What exact (deterministic) mode promises, in one place for the real-model tests: cache-on
output equals cache-off output bit for bit (EXACTNESS.md, exact.py)."""

from __future__ import annotations

import numpy as np
from fastmode import assert_logits_close


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
