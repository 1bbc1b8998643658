"""Admission takes turns between tenants: the scheduler alone, on plain requests, no model."""

from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_cache.runtime.lane import Lane
from skippy_cache.runtime.requests import GenerationRequest, QueueFullError, RequestHandle
from skippy_cache.runtime.scheduler import Admission, Scheduler, Waiting


def _discard(_event: object) -> None:
    pass


#: A token no other request's question holds.
_QUESTIONS = itertools.count(1_000_000)


def queue(scheduler: Scheduler, tenant: str | None, *, prompt: int = 10, max_tokens: int = 6,
          t_submit: float = 0.0, start: int = 1, question: int = 0) -> Waiting:
    """Queue a request whose prompt is `prompt` tokens from `start` on, then `question` more of its own."""
    tokens = list(range(start, start + prompt)) + [next(_QUESTIONS)] * question
    request = GenerationRequest(tokens=tokens, max_tokens=max_tokens, tenant=tenant)
    waiting = Waiting(RequestHandle(request), _discard, t_submit)
    scheduler.enqueue(waiting)
    return waiting


def run(scheduler: Scheduler, admission: Admission) -> Lane:
    """Start the admitted request's lane, as the engine does right after `admit`."""
    lane = Lane(seq_id=admission.seq_id, handle=admission.waiting.handle, sink=_discard,
                sampler=None, stream=None, reserve=admission.reserve,  # type: ignore[arg-type]
                t_submit=admission.waiting.t_submit)
    scheduler.start(lane)
    return lane


def admit_and_run(scheduler: Scheduler) -> Lane | None:
    admission = scheduler.admit()
    return None if admission is None else run(scheduler, admission)


def tenant_of(lane: Lane) -> str | None:
    return lane.request.tenant


@pytest.mark.parametrize("tenant", ["a", None])
def test_one_tenant_or_none_is_admitted_in_queue_order(tenant: str | None) -> None:
    scheduler = Scheduler(lanes=2, n_ctx=10_000, max_queue=64)
    queued = [queue(scheduler, tenant) for _ in range(7)]
    admitted = []
    while scheduler.waiting:
        while (lane := admit_and_run(scheduler)) is not None:
            admitted.append(lane)
        scheduler.release(admitted[len(admitted) - len(scheduler.lanes)])
    assert [lane.handle for lane in admitted] == [w.handle for w in queued]


def test_a_tenant_holding_no_lane_goes_ahead_of_a_flood() -> None:
    scheduler = Scheduler(lanes=4, n_ctx=10_000, max_queue=64)
    for _ in range(3):
        queue(scheduler, "a")
    assert [tenant_of(admit_and_run(scheduler)) for _ in range(3)] == ["a", "a", "a"]
    flood = [queue(scheduler, "a") for _ in range(3)]
    b = queue(scheduler, "b")
    assert scheduler.admit().waiting is b
    # The flood's own requests keep their order.
    assert list(scheduler.waiting) == flood


def test_two_tenants_alternate_under_a_flood() -> None:
    # Tenant a queues its whole flood before b's first request: each lane that frees goes to
    # whichever tenant holds fewer, and the tie to a, whose oldest waiting request is older.
    scheduler = Scheduler(lanes=4, n_ctx=10_000, max_queue=64)
    a = [queue(scheduler, "a") for _ in range(10)]
    b = [queue(scheduler, "b") for _ in range(10)]
    started = [admit_and_run(scheduler) for _ in range(4)]
    assert [tenant_of(lane) for lane in started] == ["a", "b", "a", "b"]
    assert scheduler.admit() is None
    order = [lane.handle for lane in started]
    while scheduler.lanes:
        scheduler.release(scheduler.lanes[0])
        while (lane := admit_and_run(scheduler)) is not None:
            order.append(lane.handle)
    assert order == [w.handle for pair in zip(a, b, strict=True) for w in pair]


def test_the_tie_goes_to_the_tenant_queued_first() -> None:
    scheduler = Scheduler(lanes=3, n_ctx=10_000, max_queue=64)
    queue(scheduler, "b")
    queue(scheduler, "a")
    queue(scheduler, "b")
    assert [tenant_of(admit_and_run(scheduler)) for _ in range(3)] == ["b", "a", "b"]


def test_the_request_in_turn_waits_for_cells_and_nothing_smaller_skips_it() -> None:
    scheduler = Scheduler(lanes=4, n_ctx=100, max_queue=64)
    queue(scheduler, "a", prompt=40, max_tokens=20)
    assert admit_and_run(scheduler) is not None
    big = queue(scheduler, "b", prompt=40, max_tokens=20)
    queue(scheduler, "a", prompt=5, max_tokens=5)
    # b holds no lane: its request is in turn, and 60 more cells do not fit beside 60 reserved.
    assert scheduler.admit() is None
    assert len(scheduler.waiting) == 2 and sorted(scheduler._free_ids) == [1, 2, 3]
    scheduler.release(scheduler.lanes[0])
    assert scheduler.admit().waiting is big


def test_the_wait_limit_looks_at_the_oldest_request_of_the_same_tenant() -> None:
    # The flood's oldest request waits while b's go first: a's next request is refused, b's is not,
    # since b is served at the next free lane however long a's requests have waited.
    scheduler = Scheduler(lanes=2, n_ctx=10_000, max_queue=64, max_wait_s=5.0)
    now = time.perf_counter()
    queue(scheduler, "a", t_submit=now - 60)
    assert admit_and_run(scheduler) is not None
    queue(scheduler, "a", t_submit=now - 30)
    # Queued as the engine queues a prefetched request: counted against the limits at submit.
    scheduler.waiting.append(Waiting(RequestHandle(GenerationRequest(tokens=[1], max_tokens=1, tenant="b")),
                                     _discard, now))
    assert tenant_of(admit_and_run(scheduler)) == "b"
    with pytest.raises(QueueFullError, match="oldest waiting request has waited"):
        queue(scheduler, "a")
    queue(scheduler, "b")
    # Without tenants, every request is one tenant's: the oldest of all decides.
    alone = Scheduler(lanes=1, n_ctx=10_000, max_queue=64, max_wait_s=5.0)
    queue(alone, None, t_submit=now - 30)
    with pytest.raises(QueueFullError):
        queue(alone, None)


def measured(scheduler: Scheduler) -> None:
    """Rates as the engine measures them: 10 ms a prompt row, 50 ms a token, 10 tokens a request."""
    scheduler.rates.step(100, 0, 1.0)
    scheduler.rates.step(0, 2, 0.1)
    scheduler.rates.finished(10)


def test_a_request_that_would_wait_past_the_limit_is_refused_before_the_queue_s_head_has() -> None:
    scheduler = Scheduler(lanes=2, n_ctx=100_000, max_queue=64, max_wait_s=12.0, clock=lambda: 0.0)
    for start in (1_000, 2_000):
        queue(scheduler, None, prompt=400, max_tokens=10, start=start)
        admit_and_run(scheduler)
    queue(scheduler, None, prompt=400, max_tokens=10, start=3_000)
    assert scheduler.expected_wait() == 0.0  # nothing measured yet: no estimate
    measured(scheduler)
    # Engine time: a running lane 399 rows (its prefill; the last token is decoded) x 10 ms + 10
    # tokens x 50 ms = 4.49 s, a waiting request that shares nothing 400 x 10 ms + 0.5 s = 4.5 s.
    # Behind 2 running and 1 waiting, a new request waits for 2 of the 3 to end.
    assert scheduler.expected_wait() == pytest.approx((2 * 4.49 + 4.5) * 2 / 3)
    queue(scheduler, None, prompt=400, max_tokens=10, start=4_000)
    with pytest.raises(QueueFullError, match="would wait about 13 s") as refused:
        queue(scheduler, None, prompt=400, max_tokens=10, start=5_000)
    assert refused.value.retry_after_s == 2  # (2 x 4.49 + 2 x 4.5) x 3 / 4 = 13.5 s, 1.5 s past the limit
    # Another tenant with nothing waiting goes at the next free lane (turns), whatever waits.
    queue(scheduler, "b", prompt=400, start=6_000)


def test_hits_queued_behind_cold_prompts_are_not_refused_for_the_cold_prompts_time() -> None:
    # Four tenants' new system prompts are near the end of their prefill; their users' next questions
    # wait. Each waiting request shares its system prompt with a running one (a join, or a hit once it
    # is recorded): only its question and reply are work. Judged by how long the cold prompts held
    # their lanes, such hits were refused that the server would have answered within seconds.
    def running_cold(scheduler: Scheduler) -> None:
        measured(scheduler)
        for tenant in range(4):
            queue(scheduler, None, prompt=600, max_tokens=16, start=10_000 * (tenant + 1), question=20)
            lane = admit_and_run(scheduler)
            assert lane is not None
            lane.n_past = lane.prefill_end - 100  # 100 rows and 10 tokens left: 1.5 s

    hits = Scheduler(lanes=4, n_ctx=100_000, max_queue=64, max_wait_s=15.0, clock=lambda: 0.0)
    running_cold(hits)
    for i in range(12):
        queue(hits, None, prompt=600, max_tokens=16, start=10_000 * (i % 4 + 1), question=20)
    assert all(w.new_rows == 20 for w in hits.waiting)
    # 4 x 1.5 s running, 12 x (20 rows x 10 ms + 0.5 s) waiting; a 13th waits for 13 of 16 to end.
    assert hits.expected_wait() == pytest.approx((4 * 1.5 + 12 * 0.7) * 13 / 16)
    # Prompts nobody shares are 6.7 s of work each: a 4th waits (6 + 3 x 6.7) x 4 / 7 = 14.9 s and is
    # taken, a 5th would wait (6 + 4 x 6.7) x 5 / 8 = 20.5 s.
    cold = Scheduler(lanes=4, n_ctx=100_000, max_queue=64, max_wait_s=15.0, clock=lambda: 0.0)
    running_cold(cold)
    with pytest.raises(QueueFullError, match="would wait"):
        for i in range(12):
            queue(cold, None, prompt=620, max_tokens=16, start=100_000 * (i + 1))
    assert len(cold.waiting) == 4


def test_a_finished_prompt_counts_as_shared_for_the_requests_after_it() -> None:
    scheduler = Scheduler(lanes=1, n_ctx=100_000, max_queue=64, max_wait_s=15.0, clock=lambda: 0.0)
    queue(scheduler, None, prompt=600, start=1)
    lane = admit_and_run(scheduler)
    assert lane is not None
    scheduler.release(lane)
    queue(scheduler, None, prompt=600, start=1, question=5)
    assert scheduler.waiting[0].new_rows == 5


TENANTS = ["a", "b", "c", None]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.lists(st.one_of(st.sampled_from(TENANTS), st.just("admit"),
                                             st.integers(0, 3)), max_size=60))
def test_no_tenant_goes_ahead_of_one_holding_fewer_lanes(lanes: int, ops: list[object]) -> None:
    # ops: a tenant queues a request, "admit" admits what may start, an int releases that running
    # lane (modulo how many run). Every admission is checked against the rule restated directly.
    scheduler = Scheduler(lanes=lanes, n_ctx=10_000, max_queue=1_000)
    for op in ops:
        if op == "admit":
            before = list(scheduler.waiting)
            running = {t: sum(tenant_of(lane) == t for lane in scheduler.lanes) for t in TENANTS}
            lane_free = len(scheduler.lanes) < lanes
            admission = scheduler.admit()
            if not before or not lane_free:
                assert admission is None
                continue
            assert admission is not None
            chosen = admission.waiting
            tenant = chosen.handle.request.tenant
            waiting_tenants = {w.handle.request.tenant for w in before}
            assert running[tenant] == min(running[t] for t in waiting_tenants)
            # The oldest of its tenant, and no tenant holding as many lanes had an older one.
            earlier = before[: before.index(chosen)]
            assert all(running[w.handle.request.tenant] > running[tenant] for w in earlier)
            assert list(scheduler.waiting) == [w for w in before if w is not chosen]
            run(scheduler, admission)
        elif isinstance(op, int):
            if scheduler.lanes:
                scheduler.release(scheduler.lanes[op % len(scheduler.lanes)])
        else:
            queue(scheduler, op)
    assert len(scheduler.lanes) <= lanes
