"""The trace workload: a Mooncake-format trace sent to live servers, against what the replay predicts.

Each request of the trace (its first `Sizes.trace_requests`) becomes a prompt of token ids: every
hash id its own run of `Sizes.trace_block_tokens` ids, the trace's 512-token blocks scaled down so
that its prompts fit a small model's context (a partial last block in proportion). Prompts go out
one at a time in trace order, so a server sees them in the order the replay does; the gaps between
them are not kept. With `Sizes.trace_time_scale` each goes out at its trace time times the scale
instead, answered or not: a server then also sees the trace's concurrency, and a request may
arrive while the prefix it shares is still being computed (the replay, which serves requests in
order, counts that prefix as cached). For each skippy-cache target the workload then asks the
server for its budgets (`/v1/cache`) and replays the same requests through
`skippy_cache.sizing.replay` under them: the live cached share and the predicted one, side by side.
"""

from __future__ import annotations

import asyncio
import random
import time

from skippy_cache.bench.run import TRACE, Run
from skippy_cache.bench.targets import Target
from skippy_cache.eviction import Policy
from skippy_cache.sizing.replay import Capacities, ReplayConfig, replay
from skippy_cache.sizing.trace import BLOCK_TOKENS, TraceRequest

COMPLETIONS = "/v1/completions"
#: Token ids the prompts draw from: past any model's special tokens, inside any vocabulary this
#: bench runs (SmolLM2's has 49,152).
_TOKEN_RANGE = (1000, 40_000)


def scaled(request: TraceRequest, block_tokens: int) -> TraceRequest:
    """The request with each 512-token block made `block_tokens` tokens (the last in proportion)."""
    last = request.input_length - BLOCK_TOKENS * (len(request.hash_ids) - 1)
    n = block_tokens * (len(request.hash_ids) - 1) + max(1, -(-last * block_tokens // BLOCK_TOKENS))
    return TraceRequest(request.timestamp, n, request.output_length, request.hash_ids, request.tenant)


def prompt_tokens(request: TraceRequest, block_tokens: int, seed: int) -> list[int]:
    """Token ids for a scaled request: block `h` is the same ids wherever it appears."""
    tokens: list[int] = []
    for h in request.hash_ids:
        rng = random.Random(f"skippy-bench:{seed}:block:{h}")
        tokens.extend(rng.randrange(*_TOKEN_RANGE) for _ in range(block_tokens))
    return tokens[: request.input_length]


async def trace(run: Run) -> None:
    s = run.sizes
    requests = [scaled(r, s.trace_block_tokens) for r in run.trace[: s.trace_requests]]
    prompts = [prompt_tokens(r, s.trace_block_tokens, run.seed) for r in requests]
    for target in run.targets_for(TRACE):
        started = time.perf_counter()
        bodies = [{"prompt": tokens, "max_tokens": s.trace_max_tokens, "temperature": 0} for tokens in prompts]
        if s.trace_time_scale is None:
            for body in bodies:
                await run.request(TRACE, target, "trace", COMPLETIONS, body)
        else:
            sent = []
            for request, body in zip(requests, bodies, strict=True):
                due = (request.timestamp - requests[0].timestamp) / 1000 * s.trace_time_scale
                await asyncio.sleep(max(0.0, due - (time.perf_counter() - started)))
                sent.append(asyncio.create_task(run.request(TRACE, target, "trace", COMPLETIONS, body)))
            await asyncio.gather(*sent)
        run.span(TRACE, target, "trace", started, len(prompts))
        if target.kind == "skippy-cache":
            run.predicted[target.label] = await _predict(run, target, requests)


async def _predict(run: Run, target: Target, requests: list[TraceRequest]) -> float:
    """The cached share (%) the replay predicts for `requests` under the server's own budgets."""
    budgets = (await run.client.get_json(target.url, "/v1/cache"))["budgets"]
    chunk = budgets["chunk_tokens"]
    if chunk != run.sizes.trace_block_tokens:
        raise ValueError(f"{target.label} stores chunks of {chunk} tokens, the trace's blocks are "
                         f"{run.sizes.trace_block_tokens}: the replay would name other chunks")
    kv = run.kv_bytes_per_token
    caps = Capacities(ram_bytes=budgets["host_cache_bytes"], disk_bytes=budgets["disk_cache_bytes"],
                      resident_tokens=budgets["max_resident_tokens"])
    config = ReplayConfig(caps, kv, chunk, Policy(budgets["eviction"]))
    return 100 * replay(requests, config).ratio()
