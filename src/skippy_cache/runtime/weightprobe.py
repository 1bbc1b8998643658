"""Whether this CPU survives a weight layout: a test decode in a child process, its verdict remembered.

A native crash must never be a user's first request (weights.py says which
layouts fault where). Before the engine loads the model, `resolve_weight_layout`
runs the chosen layout once in a child (`python -m skippy_cache.runtime.weightprobe`):
load the model, decode a batch of `PROBE_TOKENS` tokens and one token alone,
since ggml's matmuls take one path for a single row and another for several.
A child that dies by a signal (SIGSEGV, SIGILL, SIGABRT) condemns the layout:
the engine falls back to plain weights and says so, or refuses to start with
one line when plain weights crash too.

The verdict is remembered, in this process and under `<cache dir>/weight-probes/`,
keyed by the library build, the CPU's flags, the model and the layout
(`weights.verdict_key`): only the first start on a new CPU, build or model
pays for the child.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from skippy_cache.diskchunks import PRIVATE_FILE_MODE, make_private_dirs
from skippy_cache.runtime.gguf_info import GgufInfo
from skippy_cache.runtime.native import (
    Batch,
    ContextParams,
    NativeContext,
    NativeModel,
    extra_weight_buffers,
    runtime_abi,
)
from skippy_cache.runtime.startup import StartupError
from skippy_cache.weights import LayoutChoice, WeightRepack, choose_layout, verdict_key

#: Tokens of the probe's batched decode: past the row counts where ggml's matmuls switch kernels.
PROBE_TOKENS = 32
#: A child that has not answered by then is killed; the layout is then used unchecked (a slow
#: disk loading a large model is far likelier than a hang), and nothing is remembered.
PROBE_TIMEOUT_S = 600.0
_VERDICT_DIR = "weight-probes"


class WeightLayoutError(StartupError):
    """Every layout crashes on this CPU: the server cannot run here, and says so in one line."""


@dataclass(frozen=True, slots=True)
class ProbeOutcome:
    #: The child decoded and exited 0.
    ok: bool
    #: The child died by this signal (a crash), or None.
    signal_name: str | None
    #: What went wrong, in words ("" when ok).
    detail: str
    seconds: float

    @property
    def crashed(self) -> bool:
        return self.signal_name is not None


@dataclass(frozen=True, slots=True)
class WeightLayout:
    """The layout the engine loads the model with, and what the startup block says about it."""

    use_extra_bufts: bool
    reason: str
    #: The extra buffer types this build offers on this CPU (`AMX`, `CPU_REPACK`); which of them
    #: take weights depends on the model's weight types.
    extra_bufts: tuple[str, ...]
    #: How it is known to run here: "test decode passed in a child process (0.5 s)", "... before ...".
    check: str


def cpu_fields() -> dict[str, str]:
    """`/proc/cpuinfo`'s fields, each as it first appears (the first processor's); empty where unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep:
            fields.setdefault(name.strip(), value.strip())
    return fields


def cpu_flags() -> list[str]:
    """The CPU's feature flags (`/proc/cpuinfo`: x86 `flags`, ARM `Features`); empty where unreadable."""
    fields = cpu_fields()
    return fields.get("flags", fields.get("Features", "")).split()


def probe_command(model_path: Path, use_extra_bufts: bool) -> list[str]:
    return [sys.executable, "-m", "skippy_cache.runtime.weightprobe", str(model_path),
            "extra" if use_extra_bufts else "plain"]


def run_probe(argv: Sequence[str], timeout_s: float = PROBE_TIMEOUT_S) -> ProbeOutcome:
    """Run one probe child; a death by signal is a crash, anything else that is not exit 0 is inconclusive."""
    start = time.perf_counter()
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return ProbeOutcome(False, None, f"no answer within {timeout_s:.0f} s", time.perf_counter() - start)
    seconds = time.perf_counter() - start
    if done.returncode == 0:
        return ProbeOutcome(True, None, "", seconds)
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        return ProbeOutcome(False, name, f"the test decode died by {name}", seconds)
    last = (done.stderr.strip().splitlines() or ["no message"])[-1]
    return ProbeOutcome(False, None, f"exit {done.returncode}: {last}", seconds)


Probe = Callable[[Path, bool], ProbeOutcome]


def probe_layout(model_path: Path, use_extra_bufts: bool) -> ProbeOutcome:
    return run_probe(probe_command(model_path, use_extra_bufts))


#: Verdicts this process has seen, by key: engines after the first skip the child even without a cache dir.
_SEEN: dict[str, ProbeOutcome] = {}


class Verdicts:
    """Remembered probe outcomes: this process's, and those in a directory that survive restarts."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory

    def get(self, key: str) -> ProbeOutcome | None:
        if key in _SEEN:
            return _SEEN[key]
        if self.directory is None:
            return None
        try:
            data = json.loads((self.directory / f"{key}.json").read_text())
            outcome = ProbeOutcome(bool(data["ok"]), data["signal"], str(data["detail"]), 0.0)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not outcome.ok and not outcome.crashed:
            return None
        _SEEN[key] = outcome
        return outcome

    def put(self, key: str, outcome: ProbeOutcome, about: dict[str, object]) -> None:
        _SEEN[key] = outcome
        if self.directory is None:
            return
        record = {"ok": outcome.ok, "signal": outcome.signal_name, "detail": outcome.detail,
                  "seconds": round(outcome.seconds, 3), **about}
        try:
            # The cache directory's one rule (diskchunks.py): this may be what creates it, and its
            # parents, which must not come out 0755 before the disk tier opens it.
            make_private_dirs(self.directory)
            tmp = self.directory / f"{key}.json.tmp"
            tmp.unlink(missing_ok=True)  # a leftover would keep its mode through the rename
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE), "w") as f:
                f.write(json.dumps(record, indent=1) + "\n")
            os.replace(tmp, self.directory / f"{key}.json")
        except OSError:
            pass  # not remembered: the next start probes again, which costs time, never correctness


def resolve_weight_layout(
    setting: WeightRepack,
    *,
    extra_bufts: Sequence[str],
    model_path: Path,
    model_digest: str,
    build: str,
    cache_dir: Path | None,
    probe: Probe | None = None,
) -> WeightLayout:
    """The layout to load the model with: the choice for `setting`, checked, or the plain layout if it crashes.

    `probe` runs one layout (default `probe_layout`, a child process). Raises
    WeightLayoutError when the plain layout crashes too.
    """
    probe = probe or probe_layout
    choice = choose_layout(setting, extra_bufts)
    verdicts = Verdicts(cache_dir / _VERDICT_DIR if cache_dir is not None else None)
    flags = cpu_flags()
    outcome, words = _checked(choice, verdicts, flags, model_path, model_digest, build, probe)
    if not outcome.crashed:
        return WeightLayout(choice.use_extra_bufts, choice.reason, tuple(extra_bufts), words)
    if choice.use_extra_bufts:
        plain = LayoutChoice(False, f"repack off: a test decode with {', '.join(extra_bufts)} repacked weights "
                                    f"died by {outcome.signal_name} on this CPU; --weight-repack off skips the test")
        fallback, words = _checked(plain, verdicts, flags, model_path, model_digest, build, probe)
        if not fallback.crashed:
            return WeightLayout(False, plain.reason, tuple(extra_bufts), words)
        outcome = fallback
    raise WeightLayoutError(
        f"llama.cpp crashes on this CPU with plain weights too ({outcome.detail}): model {model_path}, "
        f"{build.split('|')[0]}; try another --model, or a llama-cpp-python built for an older CPU "
        "(CMAKE_ARGS='-DGGML_NATIVE=OFF' pip install --force-reinstall --no-binary :all: llama-cpp-python)"
    )


def layout_for(gguf: GgufInfo, setting: WeightRepack, cache_dir: Path | None) -> WeightLayout:
    """`resolve_weight_layout` for a model file on this library build and CPU."""
    return resolve_weight_layout(setting, extra_bufts=extra_weight_buffers(), model_path=gguf.path,
                                 model_digest=gguf.digest, build=runtime_abi(), cache_dir=cache_dir)


def _checked(choice: LayoutChoice, verdicts: Verdicts, flags: Sequence[str], model_path: Path,
             model_digest: str, build: str, probe: Probe) -> tuple[ProbeOutcome, str]:
    """The outcome of `choice` on this CPU (remembered or probed now), and how it was known, in words."""
    key = verdict_key(build=build, cpu_flags=flags, model_digest=model_digest,
                      use_extra_bufts=choice.use_extra_bufts)
    remembered = verdicts.get(key)
    if remembered is not None:
        return remembered, "test decode passed before on this CPU and build" if remembered.ok else \
            f"a test decode died by {remembered.signal_name} before on this CPU and build"
    outcome = probe(model_path, choice.use_extra_bufts)
    if outcome.ok or outcome.crashed:
        verdicts.put(key, outcome, {"model": str(model_path), "build": build,
                                    "layout": "extra" if choice.use_extra_bufts else "plain"})
    if outcome.ok:
        return outcome, f"test decode passed in a child process ({outcome.seconds:.1f} s)"
    if outcome.crashed:
        return outcome, f"a test decode died by {outcome.signal_name}"
    return outcome, f"unchecked: the test decode was inconclusive ({outcome.detail})"


def _main(argv: Sequence[str]) -> int:
    """The child: load the model with the layout, decode `PROBE_TOKENS` tokens together, then one alone."""
    path, layout = Path(argv[0]), argv[1]
    model = NativeModel(path, use_extra_bufts=layout == "extra")
    ctx = NativeContext(model, ContextParams(n_ctx=256, n_batch=64, n_seq_max=1, n_threads=os.cpu_count() or 1))
    batch = Batch(64)
    tokens = [max(model.bos, 0)] + [t % model.n_vocab for t in range(100, 100 + PROBE_TOKENS - 1)]
    batch.add(0, tokens, 0, want_logits_last=True)
    if ctx.decode(batch) != 0:
        print("the batched test decode failed", file=sys.stderr)
        return 3
    batch.clear()
    batch.add(0, [tokens[-1]], PROBE_TOKENS, want_logits_last=True)
    if ctx.decode(batch) != 0:
        print("the one-token test decode failed", file=sys.stderr)
        return 3
    ctx.close()
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
