"""The weight layout decision (weights.py): which setting and build load which layout, and its names."""

from __future__ import annotations

import pytest

from skippy_cache.weights import (
    LayoutChoice,
    WeightRepack,
    choose_layout,
    parse_weight_repack,
    verdict_key,
    weight_layout_name,
)

AMX_BUILD = ["AMX", "CPU_REPACK"]
AVX2_BUILD = ["CPU_REPACK"]


@pytest.mark.parametrize("text, value", [("auto", WeightRepack.AUTO), (" ON ", WeightRepack.ON),
                                         ("off", WeightRepack.OFF)])
def test_parse_weight_repack(text: str, value: WeightRepack) -> None:
    assert parse_weight_repack(text) is value


def test_parse_weight_repack_names_the_setting_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"--weight-repack='yes' .*auto, on, off"):
        parse_weight_repack("yes", name="--weight-repack")


def test_auto_keeps_amx_off_where_it_is_built_in() -> None:
    choice = choose_layout(WeightRepack.AUTO, AMX_BUILD)
    assert choice == LayoutChoice(False, "AMX repack off: known to fault on this CPU; --weight-repack on to force")


def test_auto_keeps_llama_cpps_repack_where_amx_is_not_built_in() -> None:
    assert choose_layout(WeightRepack.AUTO, AVX2_BUILD) == LayoutChoice(True, "repack on (auto)")


@pytest.mark.parametrize("extra", [AMX_BUILD, AVX2_BUILD])
def test_on_and_off_are_obeyed(extra: list[str]) -> None:
    assert choose_layout(WeightRepack.ON, extra).use_extra_bufts
    assert not choose_layout(WeightRepack.OFF, extra).use_extra_bufts


@pytest.mark.parametrize("setting", list(WeightRepack))
def test_a_build_without_extra_buffers_loads_plain_weights(setting: WeightRepack) -> None:
    assert not choose_layout(setting, []).use_extra_bufts


def test_layout_names_are_canonical() -> None:
    assert weight_layout_name(["CPU_REPACK", "CPU_Mapped", "CPU_REPACK"]) == "CPU_Mapped+CPU_REPACK"
    assert weight_layout_name(["CPU_Mapped"]) != weight_layout_name(["CPU_Mapped", "AMX"])
    with pytest.raises(ValueError):
        weight_layout_name([])


BASE = dict(build="llama-cpp-python/0.3.36|CPU : AVX2 = 1", cpu_flags=["avx2", "fma"], model_digest="d",
            use_extra_bufts=True)


@pytest.mark.parametrize("field, value", [("build", "llama-cpp-python/0.3.37|CPU : AVX2 = 1"),
                                          ("cpu_flags", ["avx2", "fma", "amx_int8"]), ("model_digest", "e"),
                                          ("use_extra_bufts", False)])
def test_every_input_of_a_verdict_changes_its_key(field: str, value: object) -> None:
    assert verdict_key(**{**BASE, field: value}) != verdict_key(**BASE)  # type: ignore[arg-type]


def test_a_verdict_key_ignores_the_order_of_flags() -> None:
    assert verdict_key(**{**BASE, "cpu_flags": ["fma", "avx2"]}) == verdict_key(**BASE)  # type: ignore[arg-type]
