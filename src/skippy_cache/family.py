"""Which model families may reuse resident KV alone.

A recurrent or hybrid model (Mamba/SSM, RWKV, and hybrids such as Jamba or
Granite-4) carries state outside the attention KV cells. Copying only the KV of
a prefix onto a lane would leave that state at its initial value and produce a
confidently wrong continuation, so such models never reuse KV alone: `auto`
resolves to disabled for them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from skippy_cache.config import StageKvCacheMode, StageKvCachePayload

#: Substrings of GGUF tensor names that only recurrent state layers have.
RECURRENT_TENSOR_MARKERS = ("ssm", "time_mix", "recurrent", "rwkv")


@dataclass(frozen=True, slots=True)
class FamilyVerdict:
    recurrent: bool
    #: First tensor name that gave it away, for the log line.
    evidence: str | None = None

    @property
    def reason(self) -> str | None:
        if not self.recurrent:
            return None
        return f"recurrent/hybrid model (tensor {self.evidence!r}): resident KV alone is not exact"


def classify_tensor_names(names: Iterable[str]) -> FamilyVerdict:
    for name in names:
        lowered = name.lower()
        if any(marker in lowered for marker in RECURRENT_TENSOR_MARKERS):
            return FamilyVerdict(recurrent=True, evidence=name)
    return FamilyVerdict(recurrent=False)


def resolve_mode(
    mode: StageKvCacheMode, payload: StageKvCachePayload, verdict: FamilyVerdict
) -> tuple[StageKvCacheMode, str | None]:
    """The mode the runtime will use and, when it differs from the request, why.

    Only KV payloads exist so far, so a recurrent model gets no cache even when
    asked for one explicitly: reusing its KV alone would give wrong answers.
    """
    if not verdict.recurrent:
        if mode is StageKvCacheMode.AUTO:
            return StageKvCacheMode.LOOKUP_RECORD, None
        return mode, None
    if mode is StageKvCacheMode.DISABLED:
        return mode, None
    if payload is StageKvCachePayload.FULL_STATE or payload is StageKvCachePayload.KV_RECURRENT:
        why = f"{verdict.reason}; payload {payload.value} is not implemented yet"
    else:
        why = verdict.reason
    return StageKvCacheMode.DISABLED, f"cache {mode.value} -> disabled: {why}"
