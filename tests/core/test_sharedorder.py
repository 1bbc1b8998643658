"""The shared tier's order told through expiry times: deadlines along a prompt, and the turnover estimate."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from skippy_cache.sharedorder import STEP_S, Turnover, deadlines, reused_keys

TTL = 86_400.0


@given(n=st.integers(1, 40), reused=st.integers(0, 40), tail=st.booleans(), turnover=st.floats(0, 200_000))
def test_no_key_expires_before_a_later_key_of_its_prompt(
    n: int, reused: int, tail: bool, turnover: float
) -> None:
    due = deadlines(1000.0, n, reused=reused, tail_repeat_only=tail, turnover=turnover, ttl=TTL)
    assert len(due) == n
    assert all(a >= b + STEP_S * 0.999 for a, b in zip(due, due[1:]))
    # The time scale is capped: no key expires sooner than three quarters of the TTL ahead.
    assert min(due) >= 1000.0 + 0.75 * TTL - 1e-6


def test_a_reused_prefix_stays_a_turnover_longer_and_a_repeat_only_tail_one_less() -> None:
    now, t = 50.0, 300.0
    new = deadlines(now, 3, reused=0, tail_repeat_only=False, turnover=t, ttl=TTL)
    assert new[-1] == now + TTL  # a new key: the TTL ahead, as under LRU
    used = deadlines(now, 3, reused=2, tail_repeat_only=True, turnover=t, ttl=TTL)
    assert used[1] == now + TTL + t and used[0] == used[1] + STEP_S
    assert used[2] == now + TTL - t
    # Without evictions yet the order is LRU, a prompt's last key first.
    assert deadlines(now, 3, reused=2, tail_repeat_only=True, turnover=0.0, ttl=TTL) == pytest.approx(
        [now + TTL + 2 * STEP_S, now + TTL + STEP_S, now + TTL], abs=1e-6)


def test_turnover_is_keys_held_over_keys_evicted_per_second() -> None:
    t = Turnover(window_s=100, poll_s=10, min_evictions=10)
    assert t.due(0.0)
    t.observe(0.0, evicted_total=0, keys=1000)
    assert t.value == 0.0 and not t.due(5.0) and t.due(10.0)
    t.observe(10.0, evicted_total=5, keys=1000)
    assert t.value == 0.0  # too few evictions to say
    t.observe(20.0, evicted_total=20, keys=1000)
    assert t.value == 1000 * 20 / 20  # one eviction a second: a key stays 1,000 s
    for now in range(30, 301, 10):
        t.observe(float(now), evicted_total=20 + 4 * (now - 20), keys=2000)
    assert t.value == 2000 / 4  # only the last window counts: four a second now
    t.observe(310.0, evicted_total=3, keys=10)  # the server restarted
    assert t.value == 0.0


def test_reused_keys_are_the_whole_chunks_a_hit_covered_and_the_tail_of_a_whole_hit() -> None:
    assert reused_keys(0, 3, 64, whole=False) == 0
    assert reused_keys(130, 3, 64, whole=False) == 2  # the third chunk was only begun
    assert reused_keys(400, 3, 64, whole=False) == 3  # never more than the chunks there are
    assert reused_keys(200, 3, 64, whole=True) == 4
