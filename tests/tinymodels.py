"""Tiny random-weight GGUF models, built at test time, one per llama.cpp architecture.

The real-model tests need one model per memory layout the cache must handle: a
plain KV cache (llama, qwen3), interleaved sliding-window attention (gemma3),
pure recurrent state (mamba2, rwkv7) and hybrids of both (lfm2, granitehybrid,
qwen35). Downloading one checkpoint of each is slow and large; these are each
well under 1 MB and take milliseconds to make.

How: only the metadata (hyperparameters and a vocabulary) is written here, into
a `gguf_context` through the gguf functions the bundled ggml library exports.
`llama_model_init_from_user` then lets llama.cpp itself create every tensor the
architecture's loader asks for, with the exact shapes it expects, and calls
back into Python to fill each one; `llama_model_save_to_file` writes the
result. This is how llama.cpp's own tests/test-llama-archs.cpp builds its
models, so no tensor shape is restated here and nothing outside the pinned
llama-cpp-python is needed.

The weights are seeded random numbers, so logits are finite and varied but
meaningless; every built file with the same (arch, seed) is byte-identical.

Run as a script to build all of them into a directory:
    python tests/tinymodels.py /tmp/tiny
"""

from __future__ import annotations

import ctypes
import re
import sys
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import llama_cpp as ll
import numpy as np
from llama_cpp._ggml import libggml

# ---------------------------------------------------------------------------
# Hyperparameters

#: Every model shares the vocabulary below, this width and this trained context.
N_EMBD = 64
N_CTX_TRAIN = 4096

#: Per architecture: its `{arch}.<key>` metadata, besides the keys every model
#: gets (context_length, embedding_length, attention.layer_norm_rms_epsilon).
#: ints are written as u32, floats as f32, lists as u32 arrays (per layer for head counts).
HPARAMS: dict[str, dict[str, object]] = {
    "llama": {
        "block_count": 2,
        "feed_forward_length": 128,
        "attention.head_count": 4,
        # GQA, as in every recent llama: K/V rows narrower than Q.
        "attention.head_count_kv": 2,
        "rope.freq_base": 500000.0,
    },
    "qwen3": {
        "block_count": 2,
        "feed_forward_length": 128,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        # qwen3 states its head size rather than deriving it from n_embd / n_head.
        "attention.key_length": 16,
        "attention.value_length": 16,
        "rope.freq_base": 1000000.0,
    },
    "gemma3": {
        # Gemma 3's interleaving comes from the loader's default period of 6 (no
        # sliding_window_pattern key, like the real GGUFs): five sliding-window
        # layers, then one global one. Six layers hold exactly one period.
        "block_count": 6,
        # Narrower FFN than the others: six layers of F32 must stay under 1 MB.
        "feed_forward_length": 64,
        "attention.head_count": 2,
        "attention.head_count_kv": 1,
        "attention.key_length": 32,
        "attention.value_length": 32,
        # Small, so a test crosses the window within a few dozen tokens.
        "attention.sliding_window": 16,
        "rope.freq_base": 1000000.0,
        "rope.freq_base_swa": 10000.0,
    },
    "mamba2": {
        "block_count": 2,
        # Pure SSM: no attention heads and no FFN.
        "ssm.conv_kernel": 4,
        "ssm.inner_size": 2 * N_EMBD,
        "ssm.state_size": 16,
        # Mamba-2 heads: inner_size / time_step_rank = 32 channels each.
        "ssm.time_step_rank": 4,
        "ssm.group_count": 1,
    },
    "lfm2": {
        # LFM2 interleaves short-convolution blocks with attention; a layer is
        # a convolution exactly when its head_count_kv is 0 (as in real LFM2 GGUFs).
        "block_count": 4,
        "feed_forward_length": 128,
        "attention.head_count": 4,
        "attention.head_count_kv": [0, 0, 2, 0],
        "shortconv.l_cache": 3,
        "rope.freq_base": 1000000.0,
    },
    "granitehybrid": {
        # Granite 4.0-H: Mamba-2 layers with a few attention layers (head_count_kv 0 = Mamba).
        "block_count": 4,
        # Narrower FFN: Mamba's in-projection is large, and the file must stay well under 1 MB.
        "feed_forward_length": 96,
        "attention.head_count": 4,
        "attention.head_count_kv": [0, 0, 2, 0],
        # The loader supports only an expansion factor of 2.
        "ssm.conv_kernel": 4,
        "ssm.inner_size": 2 * N_EMBD,
        "ssm.state_size": 16,
        "ssm.time_step_rank": 4,
        "ssm.group_count": 1,
        # Granite's muP multipliers, so those code paths run too (values of the 350M model's order).
        "embedding_scale": 12.0,
        "residual_scale": 0.22,
        "logit_scale": 4.0,
        "rope.freq_base": 10000.0,
    },
    "qwen35": {
        # Qwen3.5: three gated delta-net (linear attention) layers, then one
        # full-attention layer, repeating (the real full_attention_interval).
        "block_count": 4,
        "full_attention_interval": 4,
        "feed_forward_length": 128,
        "attention.head_count": 2,
        "attention.head_count_kv": 1,
        "attention.key_length": 32,
        "attention.value_length": 32,
        # Partial rotary (a quarter of the head, as in the real models) with
        # interleaved M-RoPE sections summing to rope.dimension_count / 2.
        "rope.dimension_count": 8,
        "rope.dimension_sections": [2, 1, 1, 0],
        "rope.freq_base": 10000000.0,
        # Delta net: group_count key heads and time_step_rank value heads of state_size each.
        "ssm.conv_kernel": 4,
        "ssm.state_size": 16,
        "ssm.group_count": 2,
        "ssm.time_step_rank": 4,
        "ssm.inner_size": 16 * 4,
    },
    "rwkv7": {
        "block_count": 2,
        "feed_forward_length": 128,
        # One head of 64: the CPU wkv7 kernel's SIMD loop steps through a head
        # 32 or 64 floats at a time with no remainder loop, so a smaller head
        # reads and writes its neighbours' state (batch-size-dependent logits).
        "wkv.head_size": 64,
        "attention.layer_norm_epsilon": 1e-5,
        "attention.decay_lora_rank": 8,
        "attention.iclr_lora_rank": 8,
        "attention.value_residual_mix_lora_rank": 8,
        "attention.gate_lora_rank": 16,
    },
}

ARCHS: tuple[str, ...] = tuple(HPARAMS)

#: Architectures whose output projection is its own matrix. The rest tie it to
#: the token embeddings, as the small real checkpoints of those families do
#: (and it keeps the files small); rwkv7's loader requires a separate one.
UNTIED: frozenset[str] = frozenset({"llama", "rwkv7"})

#: Standard deviation of the random matrices. Small against 1/sqrt(fan_in) for
#: fan_in 64-128, so activations shrink a little per layer instead of growing.
WEIGHT_STD = 0.05

# ---------------------------------------------------------------------------
# Vocabulary: SentencePiece style ("llama" tokenizer) with byte fallback

#: Whole words reachable through their "▁"-prefixed prefixes (every prefix is a
#: token, so SPM merges walk to the word), making ordinary English a few tokens
#: shorter than its bytes, as with a real tokenizer.
_WORDS = ["the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are", "as", "with", "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by", "word", "but", "not", "what", "all", "were", "we", "when", "your", "can", "said", "there", "use", "an", "each", "which", "she", "do", "how", "their", "if", "will", "up", "other", "about", "out", "many", "then", "them", "these", "so", "some", "her", "would", "make", "like", "him", "into", "time", "has", "look", "two", "more", "write", "go", "see", "number", "no", "way", "could", "people", "my", "than", "first", "water", "been", "call", "who", "its", "now", "find", "long", "down", "day", "did", "get", "come", "made", "may", "part", "hello", "world", "cache", "token", "model", "prefix"]

TOKEN_UNK, TOKEN_BOS, TOKEN_EOS = 0, 1, 2
# llama.cpp's llama_token_type values.
_TYPE_NORMAL, _TYPE_UNKNOWN, _TYPE_CONTROL, _TYPE_BYTE = 1, 2, 3, 6


def _vocab() -> tuple[list[str], list[float], list[int]]:
    """Token texts, scores and types: <unk> <s> </s>, the 256 byte tokens, printable ASCII, word pieces."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [_TYPE_UNKNOWN, _TYPE_CONTROL, _TYPE_CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [_TYPE_BYTE] * 256
    pieces = ["▁"] + [chr(c) for c in range(0x21, 0x7F)]
    seen = set(pieces)
    for word in _WORDS:
        for end in range(2, len(word) + 2):
            piece = "▁" + word[: end - 1]
            if piece not in seen:
                seen.add(piece)
                pieces.append(piece)
    tokens += pieces
    types += [_TYPE_NORMAL] * len(pieces)
    # SPM merges the highest-scoring pair first; longer pieces rank higher so a
    # word merges all the way up.
    scores = [0.0] * (3 + 256) + [float(len(p)) - i * 1e-4 for i, p in enumerate(pieces)]
    return tokens, scores, types


# ---------------------------------------------------------------------------
# ctypes bindings to ggml's gguf writer and tensor setter (exported by the bundled libggml)


def _fn(name: str, restype: object, *argtypes: object) -> Callable[..., object]:
    fn = getattr(libggml, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


_p, _s = ctypes.c_void_p, ctypes.c_char_p
_gguf_init_empty = _fn("gguf_init_empty", _p)
_gguf_free = _fn("gguf_free", None, _p)
_gguf_set_u32 = _fn("gguf_set_val_u32", None, _p, _s, ctypes.c_uint32)
_gguf_set_f32 = _fn("gguf_set_val_f32", None, _p, _s, ctypes.c_float)
_gguf_set_bool = _fn("gguf_set_val_bool", None, _p, _s, ctypes.c_bool)
_gguf_set_str = _fn("gguf_set_val_str", None, _p, _s, _s)
_gguf_set_arr_data = _fn("gguf_set_arr_data", None, _p, _s, ctypes.c_int, _p, ctypes.c_size_t)
_gguf_set_arr_str = _fn("gguf_set_arr_str", None, _p, _s, ctypes.POINTER(_s), ctypes.c_size_t)
_ggml_get_name = _fn("ggml_get_name", _s, _p)
_ggml_nbytes = _fn("ggml_nbytes", ctypes.c_size_t, _p)
_ggml_backend_tensor_set = _fn("ggml_backend_tensor_set", None, _p, _p, ctypes.c_size_t, ctypes.c_size_t)


class _GgufInitParams(ctypes.Structure):
    """`struct gguf_init_params` (gguf.h), passed by value."""

    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.POINTER(ctypes.c_void_p))]


_gguf_init_from_file = _fn("gguf_init_from_file", _p, _s, _GgufInitParams)
_gguf_set_kv = _fn("gguf_set_kv", None, _p, _p)
_gguf_get_n_tensors = _fn("gguf_get_n_tensors", ctypes.c_int64, _p)
_gguf_get_tensor_name = _fn("gguf_get_tensor_name", _s, _p, ctypes.c_int64)
_gguf_add_tensor = _fn("gguf_add_tensor", None, _p, _p)
_gguf_write_to_file = _fn("gguf_write_to_file", ctypes.c_bool, _p, _s, ctypes.c_bool)
_ggml_get_tensor = _fn("ggml_get_tensor", _p, _p, _s)
_ggml_free = _fn("ggml_free", None, _p)

_GGUF_TYPE_UINT32, _GGUF_TYPE_INT32, _GGUF_TYPE_FLOAT32 = 4, 5, 6
_GGML_TYPE_F32, _GGML_TYPE_F16 = 0, 1
_GGML_LOG_LEVEL_ERROR = 4


class _TensorHead(ctypes.Structure):
    """The leading fields of `struct ggml_tensor` (ggml.h): its type and shape."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4)]


class _Gguf:
    """An owned `gguf_context` with typed setters."""

    def __init__(self) -> None:
        self.ptr = _gguf_init_empty()

    def close(self) -> None:
        _gguf_free(self.ptr)

    def set(self, key: str, value: object) -> None:
        k = key.encode()
        if isinstance(value, bool):
            _gguf_set_bool(self.ptr, k, value)
        elif isinstance(value, int):
            _gguf_set_u32(self.ptr, k, value)
        elif isinstance(value, float):
            _gguf_set_f32(self.ptr, k, value)
        elif isinstance(value, str):
            _gguf_set_str(self.ptr, k, value.encode())
        elif isinstance(value, list) and all(isinstance(v, int) for v in value):
            arr = (ctypes.c_uint32 * len(value))(*value)
            _gguf_set_arr_data(self.ptr, k, _GGUF_TYPE_UINT32, arr, len(value))
        else:
            raise TypeError(f"{key}: unsupported metadata value {value!r}")

    def set_array(self, key: str, values: Sequence[float] | Sequence[int], gguf_type: int) -> None:
        ctype = {_GGUF_TYPE_FLOAT32: ctypes.c_float, _GGUF_TYPE_INT32: ctypes.c_int32}[gguf_type]
        arr = (ctype * len(values))(*values)
        _gguf_set_arr_data(self.ptr, key.encode(), gguf_type, arr, len(values))

    def set_strings(self, key: str, values: Sequence[str]) -> None:
        encoded = [v.encode() for v in values]
        arr = (_s * len(encoded))(*encoded)
        _gguf_set_arr_str(self.ptr, key.encode(), arr, len(encoded))


# ---------------------------------------------------------------------------
# Weights


def _tensor_values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random values for one tensor, shaped like a trained model's where it matters for stability."""
    n = int(np.prod(shape))
    if re.search(r"(norm(_\d)?|_ln)\.weight$", name):
        # RMS/layer/group norm gains: near 1 so norms keep activations at unit scale.
        return 1.0 + rng.normal(0.0, 0.02, n)
    if name.endswith(".ssm_a"):
        # State decay A = -exp(A_log) must be negative, or the SSM state blows up.
        return -rng.uniform(1.0, 8.0, n)
    if name.endswith(".ssm_d"):
        # The skip connection D of Mamba.
        return np.ones(n)
    if name.endswith("ssm_dt.bias"):
        # Inverse softplus of time steps in [1e-3, 1e-1], as Mamba initializes them.
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), n))
        return np.log(np.expm1(dt))
    if "lerp" in name:
        # RWKV token-shift interpolation factors live in [0, 1].
        return rng.uniform(0.0, 1.0, n)
    if name.endswith(".bias"):
        # Norm and convolution biases: a neutral start.
        return np.zeros(n)
    return rng.normal(0.0, WEIGHT_STD, n)


def _tensor_filler(seed: int, errors: list[str]) -> ctypes._CFuncPtr:
    """The `llama_model_set_tensor_data_t` callback: fills each tensor llama.cpp created."""

    @ll.llama_model_set_tensor_data_t
    def fill(tensor: int, _userdata: int) -> None:
        # An exception here cannot cross the C frame: record it and fail after the load.
        try:
            name = _ggml_get_name(tensor).decode()
            head = _TensorHead.from_address(tensor)
            shape = tuple(int(d) for d in head.ne)
            # Seeded per tensor name, so one tensor's values don't depend on the others' order.
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            values = _tensor_values(name, shape, rng)
            if head.type == _GGML_TYPE_F32:
                data = values.astype(np.float32)
            elif head.type == _GGML_TYPE_F16:
                data = values.astype(np.float16)
            else:
                raise TypeError(f"{name}: unexpected ggml type {head.type}")
            if data.nbytes != _ggml_nbytes(tensor):
                raise ValueError(f"{name}: {data.nbytes} bytes for a tensor of {_ggml_nbytes(tensor)}")
            _ggml_backend_tensor_set(tensor, data.ctypes.data, 0, data.nbytes)
        except Exception as e:  # noqa: BLE001 - re-raised by build()
            errors.append(f"{e!r}")

    return fill


#: Optional tensors `llama_model_init_from_user` creates anyway (it makes every
#: tensor the loader would accept) but that no real checkpoint of these
#: architectures has: per-tensor quantization scales (offered for every matrix),
#: linear-layer biases, rope frequency factors, qwen3's reranker head. Left in,
#: they would change the graph (a `ggml_mul` after each matmul, bias adds), so
#: they are dropped from the file; their random fill never matters.
_DROP = re.compile(
    r"\.(input_)?scale$"
    r"|\.(attn_[qkv]|attn_output|ffn_(gate|up|down))\.bias$"
    r"|^rope_freqs\.weight$"
    r"|^cls\.output\.weight$"
)


def _keep(arch: str, name: str) -> bool:
    if name == "output.weight":
        return arch in UNTIED
    return not _DROP.search(name)


# ---------------------------------------------------------------------------
# Building


def _metadata(arch: str) -> _Gguf:
    g = _Gguf()
    g.set("general.architecture", arch)
    g.set("general.name", f"tiny-{arch}")
    p = arch + "."
    g.set(p + "context_length", N_CTX_TRAIN)
    g.set(p + "embedding_length", N_EMBD)
    g.set(p + "attention.layer_norm_rms_epsilon", 1e-6)
    for key, value in HPARAMS[arch].items():
        g.set(p + key, value)
    tokens, scores, types = _vocab()
    g.set("tokenizer.ggml.model", "llama")
    g.set_strings("tokenizer.ggml.tokens", tokens)
    g.set_array("tokenizer.ggml.scores", scores, _GGUF_TYPE_FLOAT32)
    g.set_array("tokenizer.ggml.token_type", types, _GGUF_TYPE_INT32)
    g.set("tokenizer.ggml.unknown_token_id", TOKEN_UNK)
    g.set("tokenizer.ggml.bos_token_id", TOKEN_BOS)
    g.set("tokenizer.ggml.eos_token_id", TOKEN_EOS)
    g.set("tokenizer.ggml.add_bos_token", True)
    g.set("tokenizer.ggml.add_eos_token", False)
    return g


@ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_float, ctypes.c_void_p)
def _silent_progress(_progress: float, _userdata: int) -> bool:
    return True


def _copy_without(src: Path, dst: Path, keep: Callable[[str], bool]) -> None:
    """Rewrite the GGUF `src` as `dst` with the same metadata and only the tensors `keep` accepts."""
    ggml_ctx = ctypes.c_void_p()
    old = _gguf_init_from_file(str(src).encode(), _GgufInitParams(False, ctypes.pointer(ggml_ctx)))
    if not old:
        raise RuntimeError(f"could not read back {src}")
    new = _gguf_init_empty()
    try:
        _gguf_set_kv(new, old)
        for i in range(_gguf_get_n_tensors(old)):
            name = _gguf_get_tensor_name(old, i)
            if keep(name.decode()):
                _gguf_add_tensor(new, _ggml_get_tensor(ggml_ctx, name))
        if not _gguf_write_to_file(new, str(dst).encode(), False):
            raise RuntimeError(f"could not write {dst}")
    finally:
        _gguf_free(new)
        _gguf_free(old)
        _ggml_free(ggml_ctx)


def build(arch: str, path: Path, *, seed: int = 0) -> Path:
    """Write a tiny random `arch` model to `path` (a .gguf file) and return `path`.

    Deterministic: the same (arch, seed) always gives the same bytes. Raises
    ValueError for an architecture not in ARCHS and RuntimeError if llama.cpp
    refuses the metadata.
    """
    if arch not in HPARAMS:
        raise ValueError(f"unknown tiny architecture {arch!r}; known: {', '.join(ARCHS)}")
    ll.llama_backend_init()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = _metadata(arch)
    errors: list[str] = []
    fill = _tensor_filler(seed, errors)
    params = ll.llama_model_default_params()
    params.n_gpu_layers = 0
    params.progress_callback = _silent_progress
    try:
        model = ll.llama_model_init_from_user(meta.ptr, fill, None, params)
    finally:
        meta.close()
    if not model:
        raise RuntimeError(f"llama.cpp refused the tiny {arch} metadata (see its log above)")
    try:
        if errors:
            raise RuntimeError(f"filling the tiny {arch} weights failed: {errors[0]}")
        raw = _temp_sibling(path, ".raw")
        try:
            ll.llama_model_save_to_file(model, str(raw).encode())
        finally:
            ll.llama_model_free(model)
            model = None
        tmp = _temp_sibling(path, ".tmp")
        try:
            _copy_without(raw, tmp, lambda name: _keep(arch, name))
            # Atomic, so a concurrent reader (another test worker) never sees half a file.
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
            raw.unlink(missing_ok=True)
    finally:
        if model:
            ll.llama_model_free(model)
    return path


def _temp_sibling(path: Path, suffix: str) -> Path:
    """A unique hidden name next to `path`, so concurrent builds of one path never share a scratch file."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex}{suffix}")


@ll.llama_log_callback
def _quiet_log(level: int, text: bytes, _userdata: int) -> None:
    if level == _GGML_LOG_LEVEL_ERROR and text:
        sys.stderr.write(text.decode("utf-8", "replace"))


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/tinymodels.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    # Model loading logs a page per model; this process has nothing else to hear.
    ll.llama_log_set(_quiet_log, None)
    for arch in ARCHS:
        t0 = time.perf_counter()
        path = build(arch, out / f"tiny-{arch}.gguf")
        ms = (time.perf_counter() - t0) * 1000
        print(f"{arch:14s} {path.stat().st_size / 1024:8.1f} KiB {ms:7.1f} ms  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
