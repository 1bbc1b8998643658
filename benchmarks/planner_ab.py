"""Zero, tenants and chat in-process, for comparing two versions of the step planner.

    PYTHONPATH=OTHER_CHECKOUT/src:benchmarks .venv/bin/python benchmarks/planner_ab.py old
    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/planner_ab.py new [--fast]

Alternate the two a few times and compare medians: one run moves by 10% or more on a 2-core
machine. Prints zero's throughput and TTFT p50 (16 distinct 512-token prompts, 16 tokens,
4 at a time), tenants' later-round TTFT p50 (8 system prompts of 600 tokens, 3 rounds) and
chat's TTFT p50 over turns 2-5 (4 conversations, 24-token replies), and joins' TTFT mean and
p50 (a long prompt sent with three that share a system prompt, twice).
"""
from __future__ import annotations

import statistics
import sys
import time

from runtime_bench import text_tokens

from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.requests import GenerationRequest


def zero(engine: Engine) -> tuple[float, float]:
    """Requests per second and TTFT p50 (ms) of 16 distinct prompts, 4 at a time."""
    prompts = [text_tokens(engine, 512, seed=9000 + i) for i in range(16)]
    started, ttft = time.perf_counter(), []
    for i in range(0, 16, 4):
        done = engine.generate_many([GenerationRequest(tokens=p, max_tokens=16) for p in prompts[i : i + 4]])
        ttft += [d.stats.ttft_ms for d in done]
    return 16 / (time.perf_counter() - started), statistics.median(ttft)


def tenants(engine: Engine) -> float:
    """TTFT p50 (ms) of rounds 2 and 3: each tenant's system prompt with a new question."""
    systems = [text_tokens(engine, 600, seed=9100 + k) for k in range(8)]
    later = []
    for r in range(3):
        requests = [GenerationRequest(tokens=s + text_tokens(engine, 16, seed=9200 + 10 * k + r), max_tokens=1)
                    for k, s in enumerate(systems)]
        for i in range(0, 8, 4):
            done = engine.generate_many(requests[i : i + 4])
            if r:
                later += [d.stats.ttft_ms for d in done]
    return statistics.median(later)


def chat(engine: Engine) -> float:
    """TTFT p50 (ms) of turns 2-5: each turn resends the history, replies included."""
    histories = [text_tokens(engine, 150, seed=9300 + c) for c in range(4)]
    # Where each earlier reply sits, as the server finds them in a chat's messages.
    replies: list[tuple[tuple[int, int], ...]] = [()] * 4
    ttft = []
    for turn in range(5):
        for c in range(4):
            histories[c] = histories[c] + text_tokens(engine, 60, seed=9400 + 10 * c + turn)
        done = engine.generate_many([GenerationRequest(tokens=h, max_tokens=24, replies=r)
                                     for h, r in zip(histories, replies, strict=True)])
        for c, d in enumerate(done):
            replies[c] += ((len(histories[c]), len(histories[c]) + len(d.tokens)),)
            histories[c] = histories[c] + list(d.tokens)
        if turn:
            ttft += [d.stats.ttft_ms for d in done]
    return statistics.median(ttft)


def joins(engine: Engine) -> tuple[float, float]:
    """TTFT mean and p50 (ms) of four requests sent at once: a 1,500-token prompt, then three that
    share an 880-token system prompt (the later two join the first one's prefill, inflight.py)."""
    means, p50s = [], []
    for r in range(2):
        system = text_tokens(engine, 832, seed=9500 + r)
        requests = [GenerationRequest(tokens=text_tokens(engine, 1500, seed=9600 + r), max_tokens=1)]
        requests += [GenerationRequest(tokens=system + text_tokens(engine, 48, seed=9700 + 10 * r + q),
                                       max_tokens=1) for q in range(3)]
        ttft = [d.stats.ttft_ms for d in engine.generate_many(requests)]
        means.append(statistics.mean(ttft))
        p50s.append(statistics.median(ttft))
    return statistics.mean(means), statistics.mean(p50s)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--fast"]
    label = args[0] if args else "this checkout"
    engine = Engine(EngineConfig(cache_dir=None, deterministic="--fast" not in sys.argv))
    try:
        rate, zero_ttft = zero(engine)
        joins_mean, joins_p50 = joins(engine)
        print(f"{label}: zero {rate:.3f} req/s, TTFT p50 {zero_ttft:.0f} ms | tenants later p50 "
              f"{tenants(engine):.0f} ms | chat turns 2-5 p50 {chat(engine):.0f} ms | joins TTFT mean "
              f"{joins_mean:.0f} ms, p50 {joins_p50:.0f} ms", flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
