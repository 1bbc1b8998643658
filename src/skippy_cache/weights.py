"""Weight layout: whether llama.cpp may repack the model's weights into its extra CPU buffer types.

llama.cpp's CPU backend can move weights out of the plain `CPU` buffer into
*extra* buffer types at load: `AMX` (Intel AMX tiles, built in when the
library is compiled on a CPU with AMX) and `CPU_REPACK` (interleaved blocks
for the AVX2/AVX-512/NEON GEMM kernels: Q4_0, Q4_K, IQ4_NL, Q8_0 and more).
One switch, `llama_model_params.use_extra_bufts`, turns them on or off
together; llama.cpp turns them on.

Why this is a decision and not a default:
- ggml's AMX matmul faults on current (often virtualised) Sapphire and Granite
  Rapids Xeons: the first `llama_decode` ends the process with SIGSEGV or
  SIGILL, intermittently on some hosts. So `auto` keeps the extra buffers off
  wherever AMX is among them; `CPU_REPACK` cannot be kept alone through
  llama.cpp's API, so it goes too on such a CPU.
- Where AMX is not built in, `auto` keeps llama.cpp's default: CPU_REPACK is
  a real prefill speed-up for the quantisations it covers.
- The layout changes the matmul kernels, so the KV floats: a state computed
  with repacked weights is a different state. `weight_layout_name` names the
  buffer types that hold weights, and it goes into the prefix identity.

The runtime checks the chosen layout in a child process before it loads the
model (`runtime/weightprobe.py`); the key a verdict is remembered under is
`verdict_key`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from blake3 import blake3

#: The extra buffer type whose kernels are known to fault (see the module docstring).
AMX = "AMX"


class WeightRepack(enum.Enum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


def parse_weight_repack(text: str, *, name: str = "weight_repack") -> WeightRepack:
    word = text.strip().lower()
    for value in WeightRepack:
        if word == value.value:
            return value
    choices = ", ".join(v.value for v in WeightRepack)
    raise ValueError(f"{name}={text!r} is not a weight repack setting (one of: {choices})")


@dataclass(frozen=True, slots=True)
class LayoutChoice:
    """What the model is loaded with (`use_extra_bufts`) and why, in words for the startup log."""

    use_extra_bufts: bool
    reason: str


def choose_layout(setting: WeightRepack, extra_bufts: Sequence[str]) -> LayoutChoice:
    """The layout to try first, from the setting and the extra buffer types this build offers on this CPU.

    `extra_bufts` are llama.cpp's names (`AMX`, `CPU_REPACK`, `KLEIDIAI`, ...), as
    `ggml_backend_dev_get_extra_bufts` lists them.
    """
    if setting is WeightRepack.OFF:
        return LayoutChoice(False, "repack off (--weight-repack off)")
    if not extra_bufts:
        return LayoutChoice(False, "no repacked weight buffers in this build")
    if setting is WeightRepack.ON:
        return LayoutChoice(True, "repack on (--weight-repack on)")
    if AMX in extra_bufts:
        return LayoutChoice(False, "AMX repack off: known to fault on this CPU; --weight-repack on to force")
    return LayoutChoice(True, "repack on (auto)")


def weight_layout_name(buffers: Iterable[str]) -> str:
    """The buffer types that hold the model's weights, canonical: sorted, `+`-joined (`CPU_Mapped+CPU_REPACK`)."""
    names = sorted(set(buffers))
    if not names:
        raise ValueError("a loaded model holds its weights in at least one buffer type")
    return "+".join(names)


def verdict_key(*, build: str, cpu_flags: Iterable[str], model_digest: str, use_extra_bufts: bool) -> str:
    """Names one probe's verdict: the same library build, CPU features, model and layout get the same key.

    The CPU's flags are in it because the crash depends on the CPU, not only on
    what the library was compiled for: a disk cache moved to another host probes again.
    """
    hasher = blake3()
    for part in (build, " ".join(sorted(set(cpu_flags))), model_digest, "extra" if use_extra_bufts else "plain"):
        data = part.encode("utf-8")
        hasher.update(len(data).to_bytes(8, "little") + data)
    return hasher.hexdigest()[:32]
