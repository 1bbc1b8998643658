"""Live figures for cost-aware restores: is restoring these tokens faster than prefilling them?

A restore reads chunks (RAM or disk), checks their digests and imports them;
a prefill recomputes the tokens. Which one wins depends on the model, the
disk and the machine: on a 135M model on CPU a restore from RAM is about a
hundred times faster, while a large model on a GPU with a slow disk can be
the other way round. So both are measured as the engine runs, per token
(moving averages), and a restore is skipped when its tier is measured
slower than prefill. Until both sides have a figure, restores go ahead: a
first restore is how its tier gets measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from skippy_cache.tiers import Source

#: Weight of the newest measurement in the moving averages.
ALPHA = 0.2
#: Steps with fewer prefill tokens than this are mostly decode rows: not a prefill figure.
MIN_PREFILL_TOKENS = 64


@dataclass(slots=True)
class RestoreCosts:
    prefill_ms_per_token: float | None = None
    restore_ms_per_token: dict[Source, float] = field(default_factory=dict)

    def prefilled(self, tokens: int, ms: float) -> None:
        if tokens >= MIN_PREFILL_TOKENS:
            self.prefill_ms_per_token = _average(self.prefill_ms_per_token, ms / tokens)

    def restored(self, source: Source, tokens: int, ms: float) -> None:
        if tokens > 0:
            self.restore_ms_per_token[source] = _average(self.restore_ms_per_token.get(source), ms / tokens)

    def restore_wins(self, source: Source) -> bool:
        restore = self.restore_ms_per_token.get(source)
        if restore is None or self.prefill_ms_per_token is None:
            return True
        return restore <= self.prefill_ms_per_token


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new
