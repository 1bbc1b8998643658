"""Constrained decoding: what a grammar costs to compile, and per output token, against free decoding.

    PYTHONPATH=src .venv/bin/python benchmarks/grammar_bench.py [--rounds N] [--max-tokens N]

Uses only what every version of the engine has (`json_grammar`, `call_grammar`, the lane's
`Sampler`), so the same script measures another checkout: `PYTHONPATH=OTHER/src`.

Compile: for each of the agent bench's ten tool schemas (bench/agent.py), and for the grammar of
a call of any of the ten (`tool_choice: required`), the time from the schema to a grammar a
lane can sample with: the grammar made and checked as the server does, then the lane's sampler
made (`Sampler`), `--rounds` times each. Prints the median and the p99 over all of them.

Per token: greedy replies to the same prompts with and without a grammar (a JSON object under
`response_format` json_object, and a tool call under `required`), one at a time on one lane,
cold (no cache), alternating so the machine's drift falls on both. Prints the time per output
token after the first (median over the rounds) and the ratio, per prompt and overall.
"""

from __future__ import annotations

import argparse
import statistics
import time

from skippy_cache.bench.agent import CHAT_TOOLS, TOOLS
from skippy_cache.runtime import Engine, EngineConfig, json_grammar
from skippy_cache.runtime.native import Sampler, SamplingParams
from skippy_cache.runtime.requests import GenerationRequest
from skippy_cache.server.schemas import ToolSpec
from skippy_cache.server.tools import call_grammar

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def compile_ms(engine: Engine, make: object) -> float:
    """Schema to a sampler a lane can use: the grammar made and checked, then the lane's sampler."""
    t0 = time.perf_counter()
    grammar = make()  # type: ignore[operator]
    sampler = Sampler(SamplingParams(grammar=grammar), engine.model)
    elapsed = (time.perf_counter() - t0) * 1000
    sampler.close()
    return elapsed


def chat(engine: Engine, question: str) -> list[int]:
    return engine.model.tokenize(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
                                 "<|im_start|>assistant\n")


def ms_per_token(engine: Engine, tokens: list[int], max_tokens: int, grammar: str | None) -> tuple[float, int]:
    request = GenerationRequest(tokens=tokens, max_tokens=max_tokens, record=False, lookup=False,
                                sampling=SamplingParams(grammar=grammar))
    t0 = time.perf_counter()
    done = engine.generate(request)
    total_ms = (time.perf_counter() - t0) * 1000
    n = len(done.tokens)
    return (total_ms - done.stats.ttft_ms) / max(n - 1, 1), n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    engine = Engine(EngineConfig(ctx_size=4096, lanes=1, host_cache_bytes=0, cache_dir=None))
    try:
        tools = [ToolSpec.model_validate(t) for t in CHAT_TOOLS]
        makers = {t["name"]: (lambda schema=t["parameters"]: json_grammar(schema)) for t in TOOLS}
        makers["a call of any of the ten"] = lambda: call_grammar(tools, "required", False)
        compile_ms(engine, makers["read_file"])  # the first builds what every later one shares
        print(f"{'compile':<28} {'median ms':>10} {'p99 ms':>8}")
        everything: list[float] = []
        for name, make in makers.items():
            times = [compile_ms(engine, make) for _ in range(args.rounds)]
            everything += times
            print(f"{name:<28} {statistics.median(times):>10.2f} {_p99(times):>8.2f}")
        print(f"{'all':<28} {statistics.median(everything):>10.2f} {_p99(everything):>8.2f}")

        prompts = {
            "json_object": ("Describe a cat as a JSON object with its name, age and colour.", json_grammar()),
            "tool call (required)": ("Read the file README.md and tell me what the project does.",
                                     call_grammar(tools, "required", False)),
        }
        print(f"\n{'per token':<28} {'free ms/tok':>11} {'grammar ms/tok':>14} {'ratio':>6}")
        ratios = []
        for name, (question, grammar) in prompts.items():
            tokens = chat(engine, question)
            times: dict[bool, list[float]] = {False: [], True: []}
            lengths: dict[bool, int] = {}
            for _ in range(args.rounds):
                for constrained in (False, True):
                    ms, lengths[constrained] = ms_per_token(engine, tokens, args.max_tokens,
                                                            grammar if constrained else None)
                    times[constrained].append(ms)
            free, held = statistics.median(times[False]), statistics.median(times[True])
            ratios.append(held / free)
            print(f"{name:<28} {free:>11.2f} {held:>14.2f} {held / free:>5.2f}x"
                  f"  ({lengths[False]} and {lengths[True]} tokens)")
        print(f"{'median':<28} {'':>11} {'':>14} {statistics.median(ratios):>5.2f}x")
    finally:
        engine.close()


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


if __name__ == "__main__":
    main()
