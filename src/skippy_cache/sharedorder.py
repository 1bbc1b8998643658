"""The shared tier's eviction order, told to Redis or Valkey through each key's expiry time.

A Redis or Valkey server evicts by its own policy, and the cache's order
(LRFU, eviction.py) lives in the replicas. Run with `maxmemory-policy
volatile-ttl`, the server evicts the key whose expiry time comes first; a
replica that sets a chunk's expiry time at each use from LRFU's priority then
has the server evict in (nearly) LRFU order. Under `allkeys-lru` the same expiry
times are only long TTLs, and the server evicts by LRU (docs/sizing.md
replays both).

The deadline of a use (`deadlines`), for a prompt's keys in order (its chunks,
then its tail):
- now + `ttl`, plus `T` for a key this request reused (it has been used twice:
  LRFU keeps such chunks one turnover longer), minus `T` for a whole prompt's
  tail (found only by an exact repeat of it: one turnover less);
- no key's deadline is before a later key's of the same prompt: a lookup stops
  at the first missing chunk, so a prompt's last chunks go first (LRFU evicts
  only leaves; LRU would evict a prompt's first chunk first and strand the rest).
`T` is the tier's turnover, the time a key stays once it stops being used: the
keys the server holds over the keys it evicts per second, from its own counters
(`Turnover`). Until the server evicts, `T` is 0 and the order is LRU, leaves first.
"""

from __future__ import annotations

from collections import deque

#: Seconds between two keys' deadlines along a prompt: the resolution of PEXPIREAT and SET PXAT.
STEP_S = 0.001


def reused_keys(reused_tokens: int, n_chunks: int, chunk_tokens: int, *, whole: bool) -> int:
    """How many of a prompt's keys (its `n_chunks` chunks, then its tail) a use found rather than
    produced, when it reused the first `reused_tokens` tokens: the chunks those cover whole, and the
    tail when the whole prompt was reused."""
    return min(reused_tokens // chunk_tokens, n_chunks) + whole


def deadlines(now: float, n_keys: int, *, reused: int, tail_repeat_only: bool, turnover: float,
              ttl: float) -> list[float]:
    """Expiry times (seconds, the clock of `now`) for a prompt's `n_keys` keys used now, first to last.

    `reused`: how many leading keys this use found rather than produced;
    `tail_repeat_only`: the last key is a whole prompt's tail. `turnover` is
    capped at a quarter of `ttl`, so no key expires before its time scale says.
    """
    t = min(max(turnover, 0.0), ttl / 4)
    out = [now + ttl + (t if i < reused else 0.0) for i in range(n_keys)]
    if n_keys and tail_repeat_only:
        out[-1] -= t
    for i in range(n_keys - 2, -1, -1):
        out[i] = max(out[i], out[i + 1] + STEP_S)
    return out


class Turnover:
    """The shared tier's time scale: keys held over keys evicted per second, over the last `window_s`.

    Fed every `poll_s` with the server's count of evicted keys (cumulative,
    `INFO stats`) and of keys held (`DBSIZE`). 0 until at least
    `min_evictions` keys were evicted within the window.
    """

    def __init__(self, window_s: float = 120.0, poll_s: float = 10.0, min_evictions: int = 10) -> None:
        self.window_s = window_s
        self.poll_s = poll_s
        self.min_evictions = min_evictions
        self._samples: deque[tuple[float, int]] = deque()
        self._last_poll = float("-inf")
        self.value = 0.0

    def due(self, now: float) -> bool:
        return now - self._last_poll >= self.poll_s

    def observe(self, now: float, evicted_total: int, keys: int) -> None:
        self._last_poll = now
        samples = self._samples
        if samples and evicted_total < samples[-1][1]:
            samples.clear()  # the server restarted: its counters did too
        samples.append((now, evicted_total))
        while len(samples) > 2 and samples[1][0] <= now - self.window_s:
            samples.popleft()
        t0, e0 = samples[0]
        evicted = evicted_total - e0
        self.value = keys * (now - t0) / evicted if evicted >= self.min_evictions and now > t0 else 0.0
