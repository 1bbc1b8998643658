"""Each kind of model memory gets its reuse rule; KV alone is never reused where state lives outside it."""

from __future__ import annotations

import pytest

from skippy_cache.config import CacheMode, CachePayload
from skippy_cache.family import REFUSED, Family, Memory, refusal, resolve_mode


def family(memory: Memory, n_swa: int = 0) -> Family:
    return Family.of("x", recurrent=memory is Memory.RECURRENT, hybrid=memory is Memory.HYBRID, n_swa=n_swa)


@pytest.mark.parametrize(
    ("recurrent", "hybrid", "n_swa", "memory"),
    [
        (False, False, 0, Memory.ATTENTION),
        (False, False, 512, Memory.SLIDING_WINDOW),
        (True, False, 0, Memory.RECURRENT),
        # llama.cpp reports a hybrid as recurrent too, and a hybrid may have a window as well:
        # the recurrent part decides.
        (True, True, 0, Memory.HYBRID),
        (False, True, 4096, Memory.HYBRID),
    ],
)
def test_memory_kind_follows_what_llama_cpp_reports(recurrent, hybrid, n_swa, memory):
    assert Family.of("arch", recurrent=recurrent, hybrid=hybrid, n_swa=n_swa).memory is memory


def test_rules_per_memory_kind():
    attention, window = family(Memory.ATTENTION), family(Memory.SLIDING_WINDOW, 512)
    recurrent, hybrid = family(Memory.RECURRENT), family(Memory.HYBRID)
    assert attention.any_prefix and not attention.whole_entries and not attention.checkpoints
    assert not window.any_prefix and not window.whole_entries and window.checkpoints
    for f in (recurrent, hybrid):
        assert not f.any_prefix and f.whole_entries and f.checkpoints
    assert [f.chunked for f in (attention, window, recurrent, hybrid)] == [True, False, False, False]
    assert "512" in window.describe() and "checkpoints" in hybrid.describe() and "whole states" in hybrid.describe()


@pytest.mark.parametrize("memory", list(Memory))
def test_auto_mode_looks_up_and_records_for_every_memory(memory):
    assert resolve_mode(CacheMode.AUTO, CachePayload.AUTO, family(memory)) == (
        CacheMode.LOOKUP_RECORD,
        None,
    )


@pytest.mark.parametrize("memory", [Memory.RECURRENT, Memory.HYBRID])
def test_kv_alone_is_refused_where_state_lives_outside_it(memory):
    mode, why = resolve_mode(CacheMode.LOOKUP_RECORD, CachePayload.RESIDENT_KV, family(memory))
    assert mode is CacheMode.DISABLED and "resident-kv" in why and memory.value in why
    for payload in (CachePayload.KV_RECURRENT, CachePayload.FULL_STATE):
        assert resolve_mode(CacheMode.LOOKUP_RECORD, payload, family(memory)) == (
            CacheMode.LOOKUP_RECORD, None)


def test_disabled_stays_disabled():
    assert resolve_mode(CacheMode.DISABLED, CachePayload.AUTO, family(Memory.HYBRID)) == (
        CacheMode.DISABLED, None)


@pytest.mark.parametrize("architecture", sorted(REFUSED))
def test_rwkv_is_refused_with_a_reason(architecture):
    why = refusal(architecture)
    assert why is not None and architecture in why and "not supported" in why
    assert refusal("mamba2") is None
