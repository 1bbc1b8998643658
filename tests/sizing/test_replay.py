"""The replay (no model): known answers on generated traces, determinism, the production books under it,
every tier and replicas, and the trace log read back."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from skippy_cache import eviction
from skippy_cache.eviction import Policy
from skippy_cache.server.tracelog import TraceLog
from skippy_cache.sizing.replay import (
    Capacities,
    ReplayConfig,
    Routing,
    belady,
    infinite_bound,
    replay,
)
from skippy_cache.sizing.trace import TraceRequest, read_trace

B = 16  # tokens per block: small traces, same rules


def request(t: float, ids: list[int], n: int | None = None, tenant: str | None = None) -> TraceRequest:
    n = len(ids) * B if n is None else n
    return TraceRequest(t * 1000, n, 8, tuple(ids), tenant)


def config(blocks: int = 10_000, policy: Policy = Policy.LRFU, **caps: int) -> ReplayConfig:
    return ReplayConfig(Capacities(ram_bytes=blocks * B, **caps), kv_bytes_per_token=1, block_tokens=B, policy=policy)


def conversation_trace(seed: int, conversations: int = 40, turns: int = 5) -> list[TraceRequest]:
    """Multi-turn chats over one system prompt (block 0): each turn resends the last one whole."""
    rng = random.Random(seed)
    next_id = 1
    events = []
    for c in range(conversations):
        ids = [0]
        t = rng.uniform(0, 600)
        for _ in range(turns):
            ids = ids + list(range(next_id, next_id + rng.randint(1, 4)))
            next_id += 5
            events.append((t, c, list(ids), len(ids) * B - rng.randint(0, B - 1)))
            t += rng.uniform(5, 120)
    events.sort()
    return [request(t, ids, n) for t, _, ids, n in events]


def test_all_distinct_prompts_hit_nothing() -> None:
    trace = [request(i, [10 * i + j for j in range(3)]) for i in range(20)]
    figures = replay(trace, config())
    assert figures.total_hit_tokens == 0
    assert infinite_bound(trace, B) == figures.bound() == 0


def test_exact_repeats_reach_the_bound_and_serve_the_whole_prompt() -> None:
    prompt = [1, 2, 3]
    trace = [request(i, prompt, 3 * B - 5) for i in range(10)]
    figures = replay(trace, config())
    # Every repeat after the first serves all its tokens (an exact repeat: the whole prompt, logits too).
    assert figures.total_hit_tokens == 9 * (3 * B - 5)
    assert figures.ratio() == pytest.approx(infinite_bound(trace, B)) == pytest.approx(0.9) == figures.bound()


def test_a_shared_two_block_prefix_is_reused_and_no_more() -> None:
    trace = [request(i, [100, 101, 1000 + i]) for i in range(5)]  # two shared blocks, a third of each's own
    figures = replay(trace, config())
    assert figures.total_hit_tokens == 4 * 2 * B
    assert figures.ratio() == pytest.approx(infinite_bound(trace, B)) == pytest.approx(8 / 15)


def test_a_replay_is_deterministic() -> None:
    trace = conversation_trace(1)
    cfg = config(blocks=20, disk_bytes=60 * B)
    a, b = replay(trace, cfg), replay(trace, cfg)
    assert a == b and a.total_hit_tokens > 0


def test_a_smaller_ram_hits_less_and_the_bound_caps_every_policy() -> None:
    trace = conversation_trace(2)
    bound = infinite_bound(trace, B)
    # The replay counts the bound in its own pass, whatever its budgets.
    assert bound > 0 and replay(trace, config(blocks=8)).bound() == pytest.approx(bound)
    ratios = {blocks: replay(trace, config(blocks=blocks)).ratio() for blocks in (8, 30, 10_000)}
    assert ratios[8] < ratios[30] < ratios[10_000]
    assert ratios[10_000] == pytest.approx(bound)
    for policy in Policy:
        assert replay(trace, config(blocks=30, policy=policy)).ratio() <= bound
    assert belady(trace, B, 30 * B) <= bound


def test_the_replay_runs_the_production_eviction_books() -> None:
    # The replay has no eviction of its own: change the books' rule and its figures move.
    trace = conversation_trace(3)
    before = replay(trace, config(blocks=25, policy=Policy.LRU)).ratio()
    original = eviction.LruBooks.evict

    def newest_first(self: eviction.LruBooks) -> tuple[str, int]:
        key, size = self._sizes.popitem(last=True)
        self._bytes -= size
        return key, size

    eviction.LruBooks.evict = newest_first  # type: ignore[method-assign]
    try:
        after = replay(trace, config(blocks=25, policy=Policy.LRU)).ratio()
    finally:
        eviction.LruBooks.evict = original  # type: ignore[method-assign]
    assert after != before


def test_chunks_that_leave_ram_are_served_from_disk() -> None:
    trace = conversation_trace(4)
    ram_only = replay(trace, config(blocks=6))
    with_disk = replay(trace, config(blocks=6, disk_bytes=10_000 * B))
    assert with_disk.hit_tokens.get("disk", 0) > 0
    assert with_disk.ratio() == pytest.approx(infinite_bound(trace, B))
    assert with_disk.ratio() > ram_only.ratio()


def test_the_resident_tier_serves_from_the_pool_first() -> None:
    trace = [request(i, [1, 2, 3]) for i in range(4)]
    figures = replay(trace, config(resident_tokens=10 * B))
    assert figures.hit_tokens.get("resident") == 3 * (3 * B)  # exact repeats, from the pool
    assert figures.hit_tokens.get("ram", 0) == 0


def test_a_prompt_longer_than_the_pools_budget_goes_to_the_store_as_a_server_does() -> None:
    trace = [request(i, [1, 2, 3, 4]) for i in range(3)]
    assert replay(trace, config(resident_tokens=3 * B)).hit_tokens == {"ram": 2 * 4 * B}
    assert replay(trace, config(resident_tokens=4 * B)).hit_tokens == {"resident": 2 * 4 * B}
    assert replay(trace, config(0, resident_tokens=3 * B)).total_hit_tokens == 0  # no store: kept nowhere


def test_the_pools_cap_counts_cells_that_entries_share_once_as_a_server_does() -> None:
    # Each prompt reuses the first's four blocks from the pool: the entries share those cells, so
    # three entries hold 6 blocks of cells and all stay under a cap of 6. Summed token counts (4 + 5
    # + 5) would have let the second entry go, and the last prompt would reuse 4 blocks, not 5.
    trace = [request(0, [1, 2, 3, 4]), request(1, [1, 2, 3, 4, 5]), request(2, [1, 2, 3, 4, 6]),
             request(3, [1, 2, 3, 4, 5, 7])]
    figures = replay(trace, config(0, resident_tokens=6 * B))
    assert figures.hit_tokens == {"resident": (4 + 4 + 5) * B}


def test_requests_of_two_tenants_never_share() -> None:
    trace = [request(0, [1, 2], tenant="alice"), request(1, [1, 2], tenant="bob"), request(2, [1, 2], tenant="bob")]
    assert replay(trace, config()).total_hit_tokens == 2 * B


def shared_config(replicas: int, routing: Routing, remote_blocks: int, local_blocks: int = 10_000) -> ReplayConfig:
    return ReplayConfig(Capacities(ram_bytes=local_blocks * B, remote_bytes=remote_blocks * B), 1, B,
                        Policy.LRFU, replicas, routing)


def test_a_shared_tier_serves_a_prefix_another_replica_computed() -> None:
    trace = [request(0, [1, 2, 3]), request(1, [1, 2, 4])]  # round-robin: one on each replica
    alone = replay(trace, shared_config(2, Routing.ROUND_ROBIN, 0))
    shared = replay(trace, shared_config(2, Routing.ROUND_ROBIN, 100))
    assert alone.total_hit_tokens == 0 and alone.per_replica == [1, 1]
    assert shared.hit_tokens == {"remote": 2 * B}
    assert shared.remote_read_bytes == 2 * B and shared.remote_written_bytes == 3 * B + B  # 3 chunks, 1 new


def test_session_routing_keeps_a_conversation_on_its_replica() -> None:
    trace = conversation_trace(5)
    rr = replay(trace, shared_config(4, Routing.ROUND_ROBIN, 0))
    session = replay(trace, shared_config(4, Routing.SESSION, 0))
    assert session.ratio() > rr.ratio()
    assert min(session.per_replica) > 0  # the system prompt every chat shares sends nobody anywhere


def test_least_loaded_routing_spreads_a_burst() -> None:
    trace = [request(0, [10 * i, 10 * i + 1]) for i in range(8)]
    figures = replay(trace, shared_config(4, Routing.LEAST_LOADED, 0))
    assert figures.per_replica == [2, 2, 2, 2]


def test_requests_before_the_window_warm_the_tiers_and_count_in_nothing() -> None:
    trace = [request(0, [1, 2]), request(120, [1, 2])]
    figures = replay(trace, config(), count_from_ms=60_000)
    assert figures.requests == 1 and figures.ratio() == 1.0
    assert infinite_bound(trace, B, count_from_ms=60_000) == figures.bound() == 1.0


def test_the_trace_log_reads_back_and_replays(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    log = TraceLog(path, started=100.0)
    system = list(range(1000, 1000 + 600))
    log.write(100.5, system + [1, 2, 3], 4, "alice")
    log.write(101.0, system + [4, 5, 6, 7], 4, "alice")  # the same first block: 512 tokens reused
    log.write(102.0, system + [1, 2, 3], 4, "bob")  # another tenant: shares nothing
    log.close()
    trace = read_trace(path)
    assert [r.tenant for r in trace] == ["alice", "alice", "bob"]
    figures = replay(trace, ReplayConfig(Capacities(ram_bytes=1 << 20), 1))
    assert figures.total_hit_tokens == 512
