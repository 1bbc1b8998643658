"""Prefill and decode speed with llama.cpp's weight repacking on and off, and what the start-up check costs.

    .venv/bin/python benchmarks/weight_repack.py [--runs 5] [--prompt 512] [--decode 64]

Models: the default (SmolLM2-135M-Instruct Q4_1) and the same weights requantised to Q4_0 by
llama.cpp's own quantizer (`llama_model_quantize`, into a temporary directory): CPU_REPACK has
kernels for Q4_0 on AVX2, AVX-512 and NEON, none for Q4_1. Each layout loads the model in this
process (`use_extra_bufts` on or off) and measures, in a fresh context per run:
- prefill: one `llama_decode` of `--prompt` tokens (tokens per second);
- decode: `--decode` one-token decodes after a 128-token prompt (tokens per second).
Runs alternate between the layouts so that drift on the machine hits both alike. Last, the
start-up check: `python -m skippy_cache.runtime.weightprobe` (a child that loads the model and
test-decodes), timed whole. Medians, with min and max.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path

import llama_cpp as ll

from skippy_cache.runtime import available_cores
from skippy_cache.runtime.gguf_info import default_model_path
from skippy_cache.runtime.native import Batch, ContextParams, NativeContext, NativeModel, extra_weight_buffers
from skippy_cache.runtime.weightprobe import probe_layout


def quantize_q4_0(source: Path, out: Path) -> Path:
    params = ll.llama_model_quantize_default_params()
    params.ftype = ll.LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    rc = ll.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize returned {rc}"
    return out


def tokens_for(model: NativeModel, n: int) -> list[int]:
    text = " ".join(f"Line {i} of the ledger records a delivery of {i * 7 % 97} crates." for i in range(n))
    tokens = model.tokenize(text)
    assert len(tokens) >= n
    return tokens[:n]


def prefill_tps(model: NativeModel, tokens: list[int], threads: int) -> float:
    ctx = NativeContext(model, ContextParams(n_ctx=2048, n_batch=len(tokens), n_seq_max=1, n_threads=threads))
    try:
        batch = Batch(len(tokens))
        batch.add(0, tokens, 0, want_logits_last=True)
        t0 = time.perf_counter()
        assert ctx.decode(batch) == 0
        return len(tokens) / (time.perf_counter() - t0)
    finally:
        ctx.close()


def decode_tps(model: NativeModel, prompt: list[int], steps: int, threads: int) -> float:
    ctx = NativeContext(model, ContextParams(n_ctx=2048, n_batch=len(prompt), n_seq_max=1, n_threads=threads))
    try:
        batch = Batch(len(prompt))
        batch.add(0, prompt, 0, want_logits_last=True)
        assert ctx.decode(batch) == 0
        token = prompt[-1]
        t0 = time.perf_counter()
        for pos in range(len(prompt), len(prompt) + steps):
            batch.clear()
            batch.add(0, [token], pos, want_logits_last=True)
            assert ctx.decode(batch) == 0
            token = int(ctx.logits(0).argmax())
        return steps / (time.perf_counter() - t0)
    finally:
        ctx.close()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8,.0f} (min {min(values):,.0f}, max {max(values):,.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode", type=int, default=64)
    args = parser.parse_args()
    threads = available_cores()
    print(f"extra buffer types offered here: {', '.join(extra_weight_buffers()) or 'none'}; {threads} threads")
    with tempfile.TemporaryDirectory() as tmp:
        default = default_model_path()
        models = {"Q4_1 (default)": default, "Q4_0 (requantised)": quantize_q4_0(default, Path(tmp) / "q4_0.gguf")}
        for name, path in models.items():
            loaded = {extra: NativeModel(path, use_extra_bufts=extra) for extra in (True, False)}
            prefill: dict[bool, list[float]] = {True: [], False: []}
            decode: dict[bool, list[float]] = {True: [], False: []}
            for run in range(args.runs):
                for extra in (True, False) if run % 2 == 0 else (False, True):
                    model = loaded[extra]
                    prefill[extra].append(prefill_tps(model, tokens_for(model, args.prompt), threads))
                    decode[extra].append(decode_tps(model, tokens_for(model, 128), args.decode, threads))
            print(f"\n{name}")
            for extra in (True, False):
                buffers = ", ".join(f"{k} {v:.0f} MiB" for k, v in sorted(loaded[extra].weight_buffers.items()))
                print(f"  repack {'on ' if extra else 'off'}: prefill tok/s {spread(prefill[extra])}, "
                      f"decode tok/s {spread(decode[extra])}   [{buffers}]")
            on_p, off_p = statistics.median(prefill[True]), statistics.median(prefill[False])
            on_d, off_d = statistics.median(decode[True]), statistics.median(decode[False])
            print(f"  on / off: prefill {on_p / off_p:.2f}x, decode {on_d / off_d:.2f}x")
            for model in loaded.values():
                model.close()
        checks = [probe_layout(default, True).seconds for _ in range(args.runs)]
        print(f"\nstart-up check (child process, default model, repack on): seconds {min(checks):.2f} min, "
              f"{statistics.median(checks):.2f} median, {max(checks):.2f} max")


if __name__ == "__main__":
    main()
