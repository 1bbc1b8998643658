"""The order prefilling lanes' rows go in (`batching.prefill_order`), on stand-in lanes: no model."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from skippy_cache.runtime.batching import AGING_ROWS_PER_S, prefill_order
from skippy_cache.runtime.lane import Phase

SHORT = 128


def lane(rows: int, t_submit: float = 0.0, leader: object = None) -> SimpleNamespace:
    return SimpleNamespace(prefill_end=rows, n_past=0, t_submit=t_submit, leader=leader,
                           phase=Phase.JOIN if leader is not None else Phase.PREFILL)


@given(st.lists(st.tuples(st.integers(1, 4000), st.floats(0, 60)), min_size=1, max_size=8))
def test_short_prefills_go_first_and_nothing_is_lost(specs: list[tuple[int, float]]) -> None:
    lanes = [lane(rows, t) for rows, t in specs]
    order = prefill_order(lanes, lanes, SHORT, now=60.0)
    assert sorted(map(id, order)) == sorted(map(id, lanes))
    shorts = [lane.prefill_end <= SHORT for lane in order]
    assert shorts == sorted(shorts, reverse=True)


def test_the_prefill_that_finishes_soonest_goes_first() -> None:
    long, shorter = lane(1500), lane(700, t_submit=1.0)
    assert prefill_order([long, shorter], [long, shorter], SHORT, now=1.0) == [shorter, long]


def test_rows_count_for_every_request_that_waits_on_them() -> None:
    alone, shared = lane(700), lane(1200)
    joiners = [lane(1250, leader=shared), lane(1300, leader=shared)]
    assert prefill_order([alone, shared], [alone, shared], SHORT, now=0.0) == [alone, shared]
    # 1,200 rows for three requests: 400 a request, against 700.
    assert prefill_order([alone, shared], [alone, shared, *joiners], SHORT, now=0.0) == [shared, alone]


def test_a_long_prefill_that_has_waited_goes_before_a_newer_shorter_one() -> None:
    old, new = lane(2000, t_submit=0.0), lane(1000, t_submit=0.0)
    assert prefill_order([old, new], [old, new], SHORT, now=0.0) == [new, old]
    new.t_submit = 1000 / AGING_ROWS_PER_S + 1.0
    assert prefill_order([old, new], [old, new], SHORT, now=new.t_submit) == [old, new]
