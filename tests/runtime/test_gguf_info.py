"""The GGUF header reader against the gguf package's, on real model files."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from tinymodels import ARCHS, build

from skippy_cache.runtime import Engine, EngineConfig
from skippy_cache.runtime.gguf_info import (
    ModelFileError,
    _header_by_gguf,
    default_model_path,
    read_gguf_info,
    read_header,
)

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]


def test_the_header_reader_agrees_with_the_gguf_package(tmp_path: Path) -> None:
    # Data offset (and so the model's digest, which names every cached chunk), architecture,
    # chat template and tensor count, on the default model and a tiny model of every family.
    paths = [default_model_path()] + [build(arch, tmp_path / f"{arch}.gguf") for arch in ARCHS]
    for path in paths:
        assert read_header(path) == _header_by_gguf(path), path.name
    assert read_header(paths[0]).chat_template  # SmolLM2 carries its template


@pytest.mark.parametrize("damage", ["truncated", "magic", "version"])
def test_a_file_the_reader_does_not_follow_goes_to_the_gguf_package(tmp_path: Path, damage: str) -> None:
    data = bytearray(default_model_path().read_bytes()[: 1 << 20])
    if damage == "magic":
        data[:4] = b"GGML"
    elif damage == "version":
        data[4:8] = (1).to_bytes(4, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    with pytest.raises(ValueError):
        read_header(bad)
    with pytest.raises(ModelFileError, match="not a GGUF model file"):
        read_gguf_info(bad)


@pytest.mark.parametrize(("ctx_size", "warned"), [(8192, False), (8192 + 512, True)])
def test_a_context_past_the_models_trained_length_is_warned_of(caplog: pytest.LogCaptureFixture, ctx_size: int,
                                                               warned: bool) -> None:
    """SmolLM2-135M was trained on 8,192 tokens; llama.cpp runs longer prompts without a word."""
    caplog.set_level(logging.WARNING, logger="skippy_cache.engine")
    engine = Engine(EngineConfig(ctx_size=ctx_size, lanes=1))
    try:
        assert engine.model.n_ctx_train == 8192
    finally:
        engine.close()
    said = [r.getMessage() for r in caplog.records if "trained on" in r.getMessage()]
    assert bool(said) == warned, said
