"""A cold prompt of N tokens: skippy-cache's server, llama.cpp's llama-server, and the bare library.

    .venv/bin/python benchmarks/cold_prefill.py --llama-server PATH [--runs 5] [--tokens 2000] [--fast]

Each run sends one new prompt (its own first word, so nothing is cached
anywhere) to every target in turn, the order rotating from run to run so that
drift on this machine hits each alike:
- `skippy-cache`: `serve` (exact mode, the default; `--fast` for fast mode), 8,192 cells;
- `llama-server`: as the bench starts it (`-c 8192 -np 4 --kv-unified -t CORES`);
- `library`: the same llama.cpp through llama-cpp-python in this process, no server and no
  engine: a fresh context of 8,192 cells, the prompt in 512-token `llama_decode` calls.

Every request is `max_tokens` 1 with the prompt as token ids (the same ids for all), timed in
the client from send to answer; llama-server's own `timings.prompt_ms` is printed beside it.
If the library is as fast as llama-server, a gap is the engine's; if not, it is the library
build or its context settings.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import httpx

from skippy_cache.bench.targets import (
    LLAMA_SERVER,
    free_port,
    launch,
    server_command,
    stop,
    wait_ready,
    weight_layout,
)
from skippy_cache.bench.text import WORDS, passage
from skippy_cache.runtime import available_cores
from skippy_cache.runtime.gguf_info import default_model_path
from skippy_cache.runtime.native import Batch, ContextParams, NativeContext, NativeModel

CTX = 8192
STEP = 512


def prompt_tokens(model: NativeModel, n: int, run: int) -> list[int]:
    text = passage(f"cold-prefill:{run}", n, first=WORDS[run % len(WORDS)])
    tokens = model.tokenize(text)
    assert len(tokens) >= n, f"a passage of {n} words gave only {len(tokens)} tokens"
    return tokens[:n]


def ask(url: str, tokens: list[int]) -> tuple[float, float | None]:
    """Milliseconds from send to answer, and the server's own prompt time if it reports one."""
    body = {"prompt": tokens, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    ms = (time.perf_counter() - t0) * 1000
    reply.raise_for_status()
    timings = reply.json().get("timings") or {}
    return ms, timings.get("prompt_ms")


def library(model: NativeModel, tokens: list[int], threads: int) -> float:
    """The prompt through bare llama.cpp: a fresh context, 512-token steps, the last token's logits."""
    ctx = NativeContext(model, ContextParams(n_ctx=CTX, n_batch=STEP, n_seq_max=4, n_threads=threads))
    try:
        batch = Batch(STEP)
        t0 = time.perf_counter()
        for start in range(0, len(tokens), STEP):
            batch.clear()
            chunk = tokens[start : start + STEP]
            batch.add(0, chunk, start, start + len(chunk) == len(tokens))
            assert ctx.decode(batch) == 0
        return (time.perf_counter() - t0) * 1000
    finally:
        ctx.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--fast", action="store_true", help="skippy-cache in fast mode")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/cold-prefill"))
    args = parser.parse_args()
    model_path = default_model_path()
    threads = available_cores()
    # Both servers and the library load the weights alike (targets.py: one layout for every server).
    repack = weight_layout(model_path).use_extra_bufts
    port = free_port()
    skippy = server_command("skippy-cache", port, model_path, CTX, repack=repack) + (["--fast"] if args.fast else [])
    ours = launch("skippy-cache", "skippy-cache", skippy, args.logs / "skippy.log", port)
    port = free_port()
    peer = launch("llama-server", LLAMA_SERVER,
                  server_command(LLAMA_SERVER, port, model_path, CTX, llama_server=args.llama_server, repack=repack),
                  args.logs / "llama-server.log", port)
    model = NativeModel(model_path, use_extra_bufts=repack)
    try:
        wait_ready([ours, peer])
        for target in (ours, peer):
            assert target.error is None, f"{target.label}: {target.error}"
            ask(target.url, model.tokenize("Hello there, a first decode to warm up."))
        library(model, model.tokenize("Hello there.") * 8, threads)
        times: dict[str, list[float]] = {"skippy-cache": [], "llama-server": [], "library": []}
        prompt_ms: list[float] = []
        for run in range(args.runs):
            tokens = prompt_tokens(model, args.tokens, run)
            labels = list(times)
            order = labels[run % len(labels) :] + labels[: run % len(labels)]
            for label in order:
                if label == "library":
                    times[label].append(library(model, tokens, threads))
                    continue
                ms, own = ask((ours if label == "skippy-cache" else peer).url, tokens)
                times[label].append(ms)
                if own is not None:
                    prompt_ms.append(own)
            print(f"run {run + 1}: " + ", ".join(f"{k} {v[-1]:,.0f} ms" for k, v in times.items()), flush=True)
        mode = "fast" if args.fast else "exact"
        print(f"\ncold {args.tokens}-token prompt, {args.runs} runs, {threads} threads, skippy-cache {mode} mode")
        base = statistics.median(times["skippy-cache"])
        for label, values in times.items():
            median = statistics.median(values)
            print(f"{label:>13}: median {median:,.0f} ms (min {min(values):,.0f}, max {max(values):,.0f}); "
                  f"{median / base:.2f}x skippy-cache")
        if prompt_ms:
            print(f"llama-server's own prompt_ms: median {statistics.median(prompt_ms):,.0f}")
    finally:
        model.close()
        for target in (ours, peer):
            stop(target)


if __name__ == "__main__":
    main()
