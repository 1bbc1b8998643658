"""Prompt lookup decoding on and off: one user's decode speed, in process.

    PYTHONPATH=src .venv/bin/python benchmarks/lookup_decoding.py [--fast] [--rounds N]
        [--max-tokens N] [--context N]

Two engines on the default model, one with `lookup_decoding` and one without, answer the same
chat questions one at a time (greedy, replies up to `--max-tokens`), alternating so that the
machine's drift falls on both. Prints per question the time per output token (median over the
rounds) on and off, their ratio, and the share of guessed steps whose guess was taken; then the
medians over all questions. `--context N` puts the first N tokens of this repository's
docs/scheduling.md before each question, as a document the user pasted (a guessed row attends over
the whole context, a pad row over a few cells). The two engines' replies are also compared token for token: the
guess never changes the output.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.requests import GenerationRequest

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QUESTIONS = (
    "List ten capital cities in Europe and one fact about each.",
    "Explain how a hash table works, with an example in Python.",
    "Write a short story about a lighthouse keeper.",
    'Convert this JSON to YAML: {"name": "skippy", "ports": [8080, 8081], "cache": {"ram": "8GiB", "disk": true}}',
    "Summarize: the cache keeps the KV state of repeated prefixes resident in the llama.cpp context and "
    "reuses it exactly, so a repeated prefix costs a sequence copy instead of a prefill.",
    "Write a Python function that parses a CSV file and returns the rows as dictionaries. Then explain it.",
)


def chat_tokens(engine: Engine, question: str, context: int) -> list[int]:
    system = f"<|im_start|>system\n{SYSTEM}"
    turn = f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    if not context:
        return engine.model.tokenize(system + turn)
    document = Path(__file__).resolve().parent.parent / "docs" / "scheduling.md"
    prose = engine.tokenize(document.read_text(), add_special=False)[:context]
    return engine.model.tokenize(system + "\n") + prose + engine.model.tokenize(turn)


def ms_per_token(engine: Engine, tokens: list[int], max_tokens: int) -> tuple[float, tuple[int, ...]]:
    """Decode time per output token after the first (ms), and the reply's tokens."""
    request = GenerationRequest(tokens=tokens, max_tokens=max_tokens, record=False, lookup=False)
    t0 = time.perf_counter()
    done = engine.generate(request)
    total_ms = (time.perf_counter() - t0) * 1000
    n = len(done.tokens)
    return (total_ms - done.stats.ttft_ms) / max(n - 1, 1), done.tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true", help="fast mode (default: exact mode)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--context", type=int, default=0, help="tokens of prose before each question")
    args = parser.parse_args()
    ctx_size = max(4096, 2 * (args.context + args.max_tokens + 256))
    engines = {on: Engine(EngineConfig(ctx_size=ctx_size, lanes=1, host_cache_bytes=0, deterministic=not args.fast,
                                       lookup_decoding=on)) for on in (True, False)}
    try:
        print(f"{'question':<44} {'off ms/tok':>10} {'on ms/tok':>10} {'on/off':>7} {'taken':>7}")
        ratios, offs, ons = [], [], []
        for question in QUESTIONS:
            tokens = chat_tokens(engines[True], question, args.context)
            times: dict[bool, list[float]] = {True: [], False: []}
            replies: dict[bool, tuple[int, ...]] = {}
            before = engines[True].stats()
            for _ in range(args.rounds):
                for on in (False, True):
                    ms, replies[on] = ms_per_token(engines[on], tokens, args.max_tokens)
                    times[on].append(ms)
            after = engines[True].stats()
            assert replies[True] == replies[False], f"{question!r}: the guesses changed the reply"
            guesses = after.guesses - before.guesses
            taken = (after.guesses_taken - before.guesses_taken) / guesses if guesses else 0.0
            off, on = statistics.median(times[False]), statistics.median(times[True])
            ratios.append(on / off)
            offs.append(off)
            ons.append(on)
            print(f"{question[:44]:<44} {off:>10.2f} {on:>10.2f} {on / off:>6.2f}x {100 * taken:>6.0f}%"
                  f"  ({len(replies[True])} tokens)")
        print(f"{'median':<44} {statistics.median(offs):>10.2f} {statistics.median(ons):>10.2f} "
              f"{statistics.median(ratios):>6.2f}x")
    finally:
        for engine in engines.values():
            engine.close()


if __name__ == "__main__":
    main()
