"""Cost-aware restores: the figures, and the decision they drive (no model needed)."""

from __future__ import annotations

import pytest

from skippy_cache.runtime.costs import MIN_PREFILL_TOKENS, RestoreCosts
from skippy_cache.tiers import Source


def test_restores_go_ahead_until_both_sides_are_measured() -> None:
    costs = RestoreCosts()
    assert costs.restore_wins(Source.DISK)
    costs.restored(Source.DISK, 1000, 5000.0)
    assert costs.restore_wins(Source.DISK), "no prefill figure yet"
    costs.prefilled(MIN_PREFILL_TOKENS - 1, 1.0)
    assert costs.prefill_ms_per_token is None, "a step of mostly decode rows is not a prefill figure"


def test_a_tier_measured_slower_than_prefill_loses_and_a_faster_one_wins() -> None:
    costs = RestoreCosts()
    costs.prefilled(512, 512 * 5.0)  # 5 ms per token
    costs.restored(Source.RAM, 2000, 40.0)  # 0.02 ms per token
    costs.restored(Source.DISK, 2000, 2000 * 8.0)  # 8 ms per token: a slow disk
    assert costs.restore_wins(Source.RAM)
    assert not costs.restore_wins(Source.DISK)


def test_figures_are_moving_averages() -> None:
    costs = RestoreCosts()
    costs.prefilled(100, 100.0)
    costs.prefilled(100, 200.0)
    assert costs.prefill_ms_per_token == pytest.approx(1.2)
