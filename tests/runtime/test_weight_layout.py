"""The weight layout on this machine's CPU: what llama.cpp offers, what auto picks, the probe that
guards it, and that the layout is part of every stored state's name.

The AMX crash cannot happen on a CPU without AMX, so the fallback is tested through the probe's
seam (a probe that reports a crash) and the crash detection through a child that really dies.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from pathlib import Path

import llama_cpp as ll
import pytest
from test_store import persist

from skippy_cache.runtime import Engine, EngineConfig, WeightLayoutError, weightprobe
from skippy_cache.runtime.gguf_info import default_model_path, read_gguf_info
from skippy_cache.runtime.native import extra_weight_buffers, runtime_abi
from skippy_cache.runtime.requests import GenerationRequest
from skippy_cache.runtime.weightprobe import (
    ProbeOutcome,
    cpu_flags,
    probe_layout,
    resolve_weight_layout,
    run_probe,
)
from skippy_cache.weights import AMX, WeightRepack, choose_layout

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

CRASH = ProbeOutcome(False, "SIGSEGV", "the test decode died by SIGSEGV", 0.1)
PASS = ProbeOutcome(True, None, "", 0.1)


@pytest.fixture(autouse=True)
def forget_verdicts() -> Iterator[None]:
    """Each test starts as a new process would: no verdict seen yet."""
    weightprobe._SEEN.clear()
    yield
    weightprobe._SEEN.clear()


@pytest.fixture(scope="module")
def q4_0_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model requantised to Q4_0 by llama.cpp's own quantizer: a weight type CPU_REPACK
    has kernels for on AVX2, AVX-512 and NEON (Q4_1, the default's, has none)."""
    out = tmp_path_factory.mktemp("q4_0") / "smollm2-135m-q4_0.gguf"
    params = ll.llama_model_quantize_default_params()
    params.ftype = ll.LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    rc = ll.llama_model_quantize(str(default_model_path()).encode(), str(out).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize returned {rc}"
    return out


def inputs(model: Path) -> dict[str, object]:
    gguf = read_gguf_info(model)
    return dict(extra_bufts=extra_weight_buffers(), model_path=gguf.path, model_digest=gguf.digest,
                build=runtime_abi())


def test_the_extra_buffers_llama_cpp_offers_match_this_cpu() -> None:
    """AMX is offered only where the library was built for it on a CPU that has it (and the kernel
    granted its tile state), and then auto turns the extra buffers off; elsewhere auto keeps what
    llama.cpp offers (CPU_REPACK)."""
    extra = extra_weight_buffers()
    flags = set(cpu_flags())
    built_for_amx = "AMX_INT8 = 1" in ll.llama_print_system_info().decode()
    if AMX in extra:
        assert built_for_amx and "amx_int8" in flags, (extra, sorted(flags))
    if not built_for_amx or "amx_int8" not in flags:
        assert AMX not in extra, (extra, sorted(flags))
    if {"avx2", "asimd"} & flags:
        assert "CPU_REPACK" in extra
    choice = choose_layout(WeightRepack.AUTO, extra)
    assert choice.use_extra_bufts == (bool(extra) and AMX not in extra)


def test_the_engine_loads_the_layout_auto_picks_and_names_it(q4_0_model: Path) -> None:
    engine = Engine(EngineConfig(model_path=q4_0_model, ctx_size=1024, lanes=1))
    try:
        info = engine.info
        assert info.weights.use_extra_bufts == choose_layout(WeightRepack.AUTO, extra_weight_buffers()).use_extra_bufts
        assert set(info.weight_buffers) == set(info.weight_layout.split("+"))
        if info.weights.use_extra_bufts and "CPU_REPACK" in info.weights.extra_bufts:
            assert "CPU_REPACK" in info.weight_buffers  # Q4_0 repacks wherever CPU_REPACK is offered
        assert engine.cache.identity_key.weight_layout == info.weight_layout
        assert engine.generate(GenerationRequest(tokens=engine.tokenize("The capital of France is"),
                                                 max_tokens=4)).tokens
    finally:
        engine.close()


@pytest.mark.parametrize("layout", ["auto's", "plain"])
def test_the_real_probe_decodes_in_a_child(layout: str) -> None:
    """The layout auto picks and plain weights run here (repacked ones may not, on an AMX Xeon)."""
    use_extra_bufts = layout == "auto's" and choose_layout(WeightRepack.AUTO, extra_weight_buffers()).use_extra_bufts
    outcome = probe_layout(default_model_path(), use_extra_bufts)
    assert outcome.ok and not outcome.crashed, outcome


def test_a_child_that_dies_by_a_signal_is_a_crash() -> None:
    outcome = run_probe([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"])
    assert (outcome.ok, outcome.crashed, outcome.signal_name) == (False, True, "SIGSEGV")
    assert "SIGSEGV" in outcome.detail


def test_a_child_that_fails_otherwise_or_hangs_is_inconclusive() -> None:
    failed = run_probe([sys.executable, "-c", "import sys; sys.exit('no model here')"])
    assert (failed.ok, failed.crashed) == (False, False) and "no model here" in failed.detail
    hung = run_probe([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.5)
    assert (hung.ok, hung.crashed) == (False, False) and "no answer" in hung.detail


@pytest.mark.parametrize("setting", [WeightRepack.AUTO, WeightRepack.ON])
def test_a_layout_whose_test_decode_crashes_falls_back_to_plain_weights(setting: WeightRepack,
                                                                        tmp_path: Path) -> None:
    calls: list[bool] = []

    def probe(_model: Path, use_extra_bufts: bool) -> ProbeOutcome:
        calls.append(use_extra_bufts)
        return CRASH if use_extra_bufts else PASS

    args = {**inputs(default_model_path()), "extra_bufts": ["AMX", "CPU_REPACK"]}
    if setting is WeightRepack.AUTO:
        args["extra_bufts"] = ["CPU_REPACK"]  # auto tries repacking only where AMX is not built in
    layout = resolve_weight_layout(setting, cache_dir=tmp_path, probe=probe, **args)
    assert not layout.use_extra_bufts and calls == [True, False]
    assert "died by SIGSEGV" in layout.reason and "repack off" in layout.reason
    # Remembered under the cache directory: a new process asks no child again.
    weightprobe._SEEN.clear()
    again = resolve_weight_layout(setting, cache_dir=tmp_path, probe=probe, **args)
    assert (again.use_extra_bufts, again.reason) == (False, layout.reason) and calls == [True, False]
    assert "before" in again.check
    assert len(list((tmp_path / "weight-probes").glob("*.json"))) == 2


def test_auto_on_an_amx_build_loads_plain_weights_and_checks_them(tmp_path: Path) -> None:
    calls: list[bool] = []

    def probe(_model: Path, use_extra_bufts: bool) -> ProbeOutcome:
        calls.append(use_extra_bufts)
        return PASS

    args = {**inputs(default_model_path()), "extra_bufts": ["AMX", "CPU_REPACK"]}
    layout = resolve_weight_layout(WeightRepack.AUTO, cache_dir=tmp_path, probe=probe, **args)
    assert not layout.use_extra_bufts and calls == [False]
    assert layout.reason == "AMX repack off: known to fault on this CPU; --weight-repack on to force"


def test_when_plain_weights_crash_too_the_engine_refuses_to_start_in_one_line() -> None:
    args = {**inputs(default_model_path()), "extra_bufts": ["CPU_REPACK"]}
    with pytest.raises(WeightLayoutError, match="crashes on this CPU with plain weights too") as caught:
        resolve_weight_layout(WeightRepack.ON, cache_dir=None, probe=lambda _m, _e: CRASH, **args)
    assert "\n" not in str(caught.value)


def test_an_inconclusive_probe_keeps_the_choice_and_is_not_remembered(tmp_path: Path) -> None:
    hung = ProbeOutcome(False, None, "no answer within 600 s", 600.0)
    args = {**inputs(default_model_path()), "extra_bufts": ["CPU_REPACK"]}
    layout = resolve_weight_layout(WeightRepack.ON, cache_dir=tmp_path, probe=lambda _m, _e: hung, **args)
    assert layout.use_extra_bufts and "inconclusive" in layout.check
    assert not (tmp_path / "weight-probes").exists() or not list((tmp_path / "weight-probes").iterdir())


def test_the_engine_starts_with_plain_weights_when_repacking_crashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seam the engine goes through: a probe that reports a crash for repacked weights."""
    monkeypatch.setattr(weightprobe, "probe_layout",
                        lambda _m, use_extra_bufts: CRASH if use_extra_bufts else PASS)
    engine = Engine(EngineConfig(ctx_size=1024, lanes=1, weight_repack=WeightRepack.ON))
    try:
        if engine.info.weights.extra_bufts:
            assert not engine.info.weights.use_extra_bufts
            assert "died by SIGSEGV" in engine.info.weights.reason
        assert engine.generate(GenerationRequest(tokens=engine.tokenize("Hello"), max_tokens=2)).tokens
    finally:
        engine.close()


def test_a_state_stored_with_repacked_weights_is_never_restored_without_them(q4_0_model: Path,
                                                                              tmp_path: Path) -> None:
    """Repacked weights run other matmul kernels: their KV is another state, so its chunks carry
    another name, and an engine with plain weights computes the prompt itself."""
    def engine(repack: WeightRepack) -> Engine:
        return Engine(EngineConfig(model_path=q4_0_model, ctx_size=2048, lanes=1, weight_repack=repack,
                                   cache_dir=tmp_path, idle_tokens=0, chunk_tokens=64))

    prompt_text = " ".join(f"Rule {i}: every guest signs the book at the door." for i in range(30))

    def run(e: Engine):
        return e.generate(GenerationRequest(tokens=e.tokenize(prompt_text), max_tokens=1))

    repacked = engine(WeightRepack.ON)
    try:
        if not repacked.info.weights.use_extra_bufts:
            pytest.skip(f"repacked weights crash on this CPU: {repacked.info.weights.reason}")
        # x86 (AVX2 and up) and ARM builds repack Q4_0: CPU_REPACK, or AMX where it is built in.
        assert set(repacked.info.weight_buffers) - {"CPU", "CPU_Mapped"}, repacked.info.weight_buffers
        run(repacked)
        assert run(repacked).stats.cached_tokens > 0  # a reused entry is one the idle engine exports
        persist(repacked)
    finally:
        repacked.close()
    plain = engine(WeightRepack.OFF)
    try:
        assert plain.info.weight_layout != repacked.info.weight_layout
        assert plain.stats().cache.store.chunks.disk.found_at_start > 0
        assert run(plain).stats.cached_tokens == 0
    finally:
        plain.close()
    again = engine(WeightRepack.ON)
    try:
        assert run(again).stats.cached_tokens > 0
    finally:
        again.close()
