"""Incremental vs naive prefix identities for one 8,000-token prompt.

For every lookup candidate of the default policy (min_tokens 64, stride 128:
shared lengths every 64 tokens, 125 candidates) compute the prefix identity:
- incremental: `prefix_identities`, one BLAKE3 pass over the tokens in all;
- naive: `prefix_identity(key, tokens[:n])` per candidate, each from scratch.

Prints the median of 50 runs of each, in microseconds, and their ratio.

    PYTHONPATH=src python benchmarks/identity_bench.py
"""

from __future__ import annotations

import random
import statistics
import time

from skippy_cache.config import PrefixCandidatePolicy, StageKvCacheConfig
from skippy_cache.identity import IdentityKey, prefix_identities, prefix_identity

TOKENS = 8000
RUNS = 50
VOCAB = 49152  # SmolLM2's vocabulary size


def main() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(VOCAB) for _ in range(TOKENS)]
    policy = PrefixCandidatePolicy.from_cache(StageKvCacheConfig())
    counts = policy.candidate_token_counts(TOKENS)
    key = IdentityKey(
        model_id="smollm2-135m-instruct",
        model_digest="sha256:bench",
        stage_id="stage-0",
        stage_index=0,
        layer_start=0,
        layer_end=30,
        runtime_abi="llama-cpp-python-0.3.36",
        type_k="f16",
        type_v="f16",
        flash_attn=True,
        kv_unified=True,
        ctx_size=16384,
    )

    def incremental() -> dict:
        return prefix_identities(key, tokens, counts)

    def naive() -> dict:
        return {n: prefix_identity(key, tokens[:n]) for n in counts}

    assert incremental() == naive(), "incremental and naive identities differ"

    def median_us(fn) -> float:
        fn()  # warm up
        samples = []
        for _ in range(RUNS):
            t0 = time.perf_counter_ns()
            fn()
            samples.append((time.perf_counter_ns() - t0) / 1000)
        return statistics.median(samples)

    inc = median_us(incremental)
    nai = median_us(naive)
    print(
        f"{TOKENS} tokens, {len(counts)} candidate lengths "
        f"(min_tokens {policy.min_tokens}, stride {policy.stride_tokens}, grid {policy.grid_tokens}), "
        f"median of {RUNS} runs"
    )
    print(f"incremental prefix_identities: {inc:10.1f} us")
    print(f"naive prefix_identity each:    {nai:10.1f} us")
    print(f"naive / incremental:           {nai / inc:10.2f}x")


if __name__ == "__main__":
    main()
