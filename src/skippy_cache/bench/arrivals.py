"""When open-loop requests arrive: offsets in seconds from the start of a rate's run.

Open-loop arrivals keep their own clock: a slow server does not slow them down, so its queue
shows up in the latencies instead of hiding in the clients' pauses (a closed loop's clients send
their next request only when the last one is answered).
- poisson: independent arrivals at `rate` per second (exponential gaps), the usual model of many
  users acting on their own;
- burst: `burst` requests at the same instant, bursts `burst / rate` seconds apart (a cron job,
  a retry storm, an agent fanning out);
- trace: a recorded trace's own gaps (Mooncake's JSONL `timestamp` in ms, or one number of
  seconds per line), scaled so its mean rate is `rate`, repeated if it is shorter than asked.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

ARRIVALS = ("poisson", "burst", "trace")
DEFAULT_BURST = 4


def arrival_times(kind: str, rate: float, n: int, seed: str, *, burst: int = DEFAULT_BURST,
                  trace: list[float] | None = None) -> list[float]:
    """`n` nondecreasing arrival offsets (seconds, the first at 0) with mean rate `rate` per second."""
    if rate <= 0 or n < 1:
        raise ValueError("an open-loop run needs a positive rate and at least one request")
    if kind == "poisson":
        rng = random.Random(f"skippy-bench:arrivals:{seed}:{rate}")
        times = [0.0]
        for _ in range(n - 1):
            times.append(times[-1] + rng.expovariate(rate))
        return times
    if kind == "burst":
        if burst < 1:
            raise ValueError("--burst must be at least 1")
        return [(i // burst) * burst / rate for i in range(n)]
    if kind == "trace":
        if not trace or len(trace) < 2:
            raise ValueError("trace arrivals need a trace of at least two timestamps (--trace)")
        gaps = [max(0.0, b - a) for a, b in itertools.pairwise(trace)]
        mean = sum(gaps) / len(gaps)
        scale = 1.0 / (rate * mean) if mean > 0 else 0.0
        times = [0.0]
        for i in range(n - 1):
            times.append(times[-1] + gaps[i % len(gaps)] * scale)
        return times
    raise ValueError(f"unknown arrivals {kind!r} (known: {', '.join(ARRIVALS)})")


def read_trace(path: Path) -> list[float]:
    """A trace's arrival times in seconds, sorted: Mooncake JSONL (`timestamp`, ms) or one number per line."""
    times = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            times.append(float(json.loads(line)["timestamp"]) / 1000 if line.startswith("{") else float(line))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: expected a JSON object with 'timestamp' (ms) or a number "
                             f"of seconds ({exc})") from None
    return sorted(times)
