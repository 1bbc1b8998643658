"""The shared tier's server in the replay: it evicts by the replicas' expiry times under volatile-ttl, by
recency under allkeys-lru, and the replay's figures follow the policy."""

from __future__ import annotations

from dataclasses import replace

from skippy_cache.eviction import Policy
from skippy_cache.sizing.replay import Capacities, ReplayConfig, Routing, replay
from skippy_cache.sizing.sharedtier import ServerPolicy, SharedTier
from skippy_cache.sizing.trace import TraceRequest

B = 16


def tier(policy: ServerPolicy, keys: int) -> tuple[SharedTier, list[float]]:
    now = [0.0]
    return SharedTier(keys * B, policy, lambda: now[0]), now


def test_volatile_ttl_lets_a_prompts_last_key_go_first_and_lru_its_first() -> None:
    for policy, gone in ((ServerPolicy.VOLATILE_TTL, "a3"), (ServerPolicy.ALLKEYS_LRU, "a1")):
        shared, now = tier(policy, 4)
        assert shared.use(["a1", "a2", "a3"], [B] * 3, reused=0, tail_repeat_only=True) == 3 * B
        now[0] = 1.0
        assert shared.use(["b1", "b2"], [B] * 2, reused=0, tail_repeat_only=True) == 2 * B
        assert gone not in shared and len(shared) == 4 and shared.evicted == 1, policy


def test_a_key_used_again_outlives_keys_used_once_by_a_turnover() -> None:
    # A stream of keys used once, one a second, through a tier of 20; one key used again every 30 s.
    # LRU forgets it after 20 s; with a turnover of about 20 s added, the server keeps it.
    for policy, kept in ((ServerPolicy.VOLATILE_TTL, True), (ServerPolicy.ALLKEYS_LRU, False)):
        shared, now = tier(policy, 20)
        for i in range(400):
            now[0] = float(i)
            if i == 100:
                shared.use(["hot"], [B], reused=1, tail_repeat_only=False)
            elif i > 100 and i % 30 == 10 and not shared.fetch("hot"):
                break
            shared.use([f"k{i}"], [B], reused=0, tail_repeat_only=False)
        assert ("hot" in shared) is kept, policy
        assert policy is ServerPolicy.ALLKEYS_LRU or 15 < shared.turnover.value < 30


def test_a_value_larger_than_the_server_is_refused() -> None:
    shared, _ = tier(ServerPolicy.VOLATILE_TTL, 2)
    assert shared.use(["big"], [3 * B], reused=0, tail_repeat_only=True) == 0 and "big" not in shared


def test_the_replay_follows_the_servers_policy() -> None:
    # Three replicas, round-robin. A's three keys, then B's two fill a tier of four: one of A's goes.
    # The third replica then asks for A's prefix: under volatile-ttl A's tail went, and its two
    # chunks serve; under allkeys-lru A's first chunk went, and nothing does.
    trace = [TraceRequest(0, 3 * B, 8, (1, 2, 3)), TraceRequest(1000, 2 * B, 8, (4, 5)),
             TraceRequest(2000, 4 * B, 8, (1, 2, 3, 9))]
    config = ReplayConfig(Capacities(ram_bytes=100 * B, remote_bytes=4 * B), 1, B, Policy.LRFU, 3,
                          Routing.ROUND_ROBIN)
    assert replay(trace, config).hit_tokens == {"remote": 2 * B}
    lru = replay(trace, replace(config, remote_policy=ServerPolicy.ALLKEYS_LRU))
    assert lru.total_hit_tokens == 0
