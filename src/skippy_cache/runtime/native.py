"""The one module that calls llama.cpp (through llama-cpp-python's low-level API).

Everything here is a thin, typed wrapper: the model, its vocabulary, one
context with a unified KV pool, a reusable multi-sequence batch, and the
sampler chain. Decisions (what to copy, what to evict) are made elsewhere.
Only the engine thread calls into a `NativeContext`; tokenization reads the
vocabulary only and is safe from other threads.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as ll
import numpy as np
from blake3 import blake3
from llama_cpp._ggml import libggml
from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from llguidance.llamacpp import lltokenizer_from_vocab

_backend_lock = threading.Lock()
_backend_ready = False

#: llama.cpp logs every context creation and decode warning to stderr; we keep
#: errors only. The callback object must stay referenced or ctypes frees it.
_LOG_ERROR_LEVEL = 4

#: While a model loads: the log lines that say which buffer types took its weights
#: (`load_tensors:   CPU_REPACK model buffer size =    56.95 MiB`). llama.cpp has no
#: call that tells, and the layout goes into the prefix identity.
_BUFFER_LINE = re.compile(r"(\S+) model buffer size =\s*([0-9.]+) MiB")
_load_lines: list[str] | None = None


@ll.llama_log_callback
def _log_callback(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    if not text:
        return
    if level == _LOG_ERROR_LEVEL:
        os.write(2, text)
    lines = _load_lines
    if lines is not None and b"model buffer size" in text:
        lines.append(text.decode("utf-8", "replace"))


def init_backend(quiet: bool = True) -> None:
    global _backend_ready
    with _backend_lock:
        if _backend_ready:
            return
        if quiet:
            ll.llama_log_set(_log_callback, ctypes.c_void_p())
        ll.llama_backend_init()
        _backend_ready = True


#: ggml type names accepted for the KV cache, as llama-server spells them.
KV_TYPES = {"f32": ll.GGML_TYPE_F32, "f16": ll.GGML_TYPE_F16, "q8_0": ll.GGML_TYPE_Q8_0, "q5_1": ll.GGML_TYPE_Q5_1,
            "q5_0": ll.GGML_TYPE_Q5_0, "q4_1": ll.GGML_TYPE_Q4_1, "q4_0": ll.GGML_TYPE_Q4_0}
#: Bytes per element: a quantized type's block (32 elements) over its 32 elements.
_KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32, "q4_1": 20 / 32,
                  "q4_0": 18 / 32}


def runtime_abi() -> str:
    """Names the code that computes the KV; a hit never crosses llama.cpp builds."""
    system = ll.llama_print_system_info().decode("utf-8", "replace")
    return f"llama-cpp-python/{ll.__version__}|{system.strip()}"


class NativeError(RuntimeError):
    pass


def _ggml_fn(name: str, restype: object, *argtypes: object) -> ctypes._CFuncPtr:
    fn = getattr(libggml, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


_GGML_BACKEND_DEVICE_TYPE_CPU = 0
_EXTRA_BUFTS_FN = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)


def extra_weight_buffers() -> list[str]:
    """The extra buffer types this build's CPU backend offers for weights on this CPU (`AMX`, `CPU_REPACK`).

    What `use_extra_bufts` turns on: llama.cpp asks `ggml_backend_dev_get_extra_bufts`
    for them at load. AMX is listed only when the library was compiled for it and
    the kernel granted the process AMX tile state.
    """
    init_backend()
    dev = _ggml_fn("ggml_backend_dev_by_type", ctypes.c_void_p, ctypes.c_int)(_GGML_BACKEND_DEVICE_TYPE_CPU)
    if not dev:
        return []
    reg = _ggml_fn("ggml_backend_dev_backend_reg", ctypes.c_void_p, ctypes.c_void_p)(dev)
    get_proc = _ggml_fn("ggml_backend_reg_get_proc_address", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)
    address = get_proc(reg, b"ggml_backend_dev_get_extra_bufts")
    if not address:
        return []
    buft_name = _ggml_fn("ggml_backend_buft_name", ctypes.c_char_p, ctypes.c_void_p)
    bufts = _EXTRA_BUFTS_FN(address)(dev)
    names = []
    i = 0
    while bufts and bufts[i]:
        names.append(buft_name(bufts[i]).decode("utf-8", "replace"))
        i += 1
    return names


class NativeModel:
    def __init__(self, path: Path, *, use_extra_bufts: bool) -> None:
        """Load `path` on the CPU; `use_extra_bufts` lets llama.cpp repack weights (weights.py)."""
        global _load_lines
        init_backend()
        params = ll.llama_model_default_params()
        # CPU only: the prefix identity leaves n_gpu_layers out on that ground (identity.py).
        params.n_gpu_layers = 0
        params.use_extra_bufts = use_extra_bufts
        self.path = path
        lines: list[str] = []
        with _backend_lock:
            _load_lines = lines
            try:
                self.ptr = ll.llama_model_load_from_file(str(path).encode("utf-8"), params)
            finally:
                _load_lines = None
        if not self.ptr:
            raise NativeError(f"llama.cpp could not load the model {path}")
        #: MiB of weights per buffer type (`CPU_Mapped`, `CPU_REPACK`, `AMX`), as llama.cpp logged them.
        self.weight_buffers: dict[str, float] = {}
        for line in lines:
            for name, mib in _BUFFER_LINE.findall(line):
                self.weight_buffers[name] = self.weight_buffers.get(name, 0.0) + float(mib)
        if not self.weight_buffers:
            # A build that logs otherwise: name the switch, which still tells the layouts apart.
            self.weight_buffers = {"extra-bufts" if use_extra_bufts else "plain": 0.0}
        self.vocab = ll.llama_model_get_vocab(self.ptr)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        self.n_layer = ll.llama_model_n_layer(self.ptr)
        self.n_embd = ll.llama_model_n_embd(self.ptr)
        self.n_head = ll.llama_model_n_head(self.ptr)
        self.n_head_kv = ll.llama_model_n_head_kv(self.ptr)
        self.bos = ll.llama_vocab_bos(self.vocab)
        self.eos = ll.llama_vocab_eos(self.vocab)
        #: The kind of memory its sequences keep (family.py).
        self.is_recurrent = bool(ll.llama_model_is_recurrent(self.ptr))
        self.is_hybrid = bool(ll.llama_model_is_hybrid(self.ptr))
        self.n_swa = int(ll.llama_model_n_swa(self.ptr))
        #: The longest sequence the model was trained on (0: the GGUF does not say).
        self.n_ctx_train = int(ll.llama_model_n_ctx_train(self.ptr))
        buf = ctypes.create_string_buffer(256)
        ll.llama_model_desc(self.ptr, buf, len(buf))
        self.description = buf.value.decode("utf-8", "replace")

    def kv_bytes_per_token(self, type_k: str, type_v: str) -> int:
        """KV bytes one token occupies in every layer (the cache's byte estimate)."""
        n_embd_gqa = self.n_embd // max(self.n_head, 1) * self.n_head_kv
        per_layer = n_embd_gqa * (_KV_TYPE_BYTES[type_k] + _KV_TYPE_BYTES[type_v])
        return int(self.n_layer * per_layer)

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        while True:
            out = (ll.llama_token * capacity)()
            n = ll.llama_tokenize(self.vocab, data, len(data), out, capacity, add_special, parse_special)
            if n >= 0:
                return list(out[:n])
            capacity = -n

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The bytes of one token; control tokens render empty unless `special`."""
        buf = ctypes.create_string_buffer(64)
        n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    @functools.cached_property
    def control_texts(self) -> tuple[str, ...]:
        """The texts of the vocabulary's control tokens (`<|im_start|>`): what tokenizing with
        `parse_special` turns into those tokens, wherever the text comes from."""
        texts = {self.token_bytes(t, special=True).decode("utf-8", "replace")
                 for t in range(self.n_vocab) if ll.llama_vocab_get_attr(self.vocab, t) & ll.LLAMA_TOKEN_ATTR_CONTROL}
        return tuple(sorted(t for t in texts if t))

    @functools.cached_property
    def grammar_tokenizer(self) -> LLTokenizer:
        """llguidance's view of the vocabulary (a quarter second to build, once).

        Every end-of-generation token ends a grammar's output, not only `eos`: a chat model ends
        its turn with its end-of-turn token."""
        eog = [t for t in range(self.n_vocab) if self.is_eog(t)]
        with warnings.catch_warnings():
            # It reads each token's attributes through a call llama-cpp-python marks deprecated:
            # one warning per token otherwise.
            warnings.simplefilter("ignore", DeprecationWarning)
            return lltokenizer_from_vocab(self.vocab, eos_token=eog or None)

    def special_text(self, token: int) -> str:
        """A special token's text (`<|im_start|>`), or "" when the model has none (-1)."""
        return self.token_bytes(token, special=True).decode("utf-8", "replace") if token >= 0 else ""

    def is_eog(self, token: int) -> bool:
        return bool(ll.llama_vocab_is_eog(self.vocab, token))

    def close(self) -> None:
        if self.ptr:
            ll.llama_model_free(self.ptr)
            self.ptr = None


@dataclass(frozen=True, slots=True)
class ContextParams:
    n_ctx: int
    n_batch: int
    n_seq_max: int
    n_threads: int
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = True
    #: False gives each sequence a stream of its own, `n_ctx / n_seq_max` cells (llama-server
    #: without `--kv-unified`); seq_cp then copies whole streams, so the runtime never does this.
    #: `benchmarks/stream_layout.py` measures what the unified pool costs against it.
    kv_unified: bool = True


class NativeContext:
    """One llama.cpp context whose `n_ctx` cells are one pool for all sequences."""

    def __init__(self, model: NativeModel, params: ContextParams) -> None:
        cp = ll.llama_context_default_params()
        cp.n_ctx = params.n_ctx
        cp.n_batch = params.n_batch
        # One ubatch per batch: a split would change which tokens share a
        # kernel call, and with it the float summation order.
        cp.n_ubatch = params.n_batch
        cp.n_seq_max = params.n_seq_max
        cp.n_threads = params.n_threads
        cp.n_threads_batch = params.n_threads
        cp.type_k = KV_TYPES[params.type_k]
        cp.type_v = KV_TYPES[params.type_v]
        cp.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if params.flash_attn else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        # Unified: seq_cp shares cells inside one pool instead of copying streams.
        cp.kv_unified = params.kv_unified
        cp.no_perf = True
        self.model = model
        self.ptr = ll.llama_init_from_model(model.ptr, cp)
        if not self.ptr:
            raise NativeError(f"llama.cpp could not create a context with {params}")
        self.n_ctx = ll.llama_n_ctx(self.ptr)
        self.memory = ll.llama_get_memory(self.ptr)

    def set_threads(self, n_threads: int) -> None:
        """The team the next decodes run with (one thread: no OpenMP team, no barriers)."""
        ll.llama_set_n_threads(self.ptr, n_threads, n_threads)

    def decode(self, batch: Batch) -> int:
        """`llama_decode`; 0 on success (1: no KV slot, <0: error; memory is restored)."""
        return int(ll.llama_decode(self.ptr, batch.native(batch.n_tokens)))

    def logits(self, index: int) -> np.ndarray:
        """A copy of the logits of batch row `index` (the pointer dies with the next decode)."""
        ptr = ll.llama_get_logits_ith(self.ptr, index)
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).copy()

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        ll.llama_memory_seq_cp(self.memory, src, dst, p0, p1)

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        return bool(ll.llama_memory_seq_rm(self.memory, seq_id, p0, p1))

    def seq_pos_max(self, seq_id: int) -> int:
        return int(ll.llama_memory_seq_pos_max(self.memory, seq_id))

    def seq_pos_min(self, seq_id: int) -> int:
        """The sequence's lowest position held (-1: none); in a sliding-window model, of its window's layers."""
        return int(ll.llama_memory_seq_pos_min(self.memory, seq_id))

    def state_seq_get(self, seq_id: int) -> bytearray:
        """The sequence's exact state (its cells' positions and K/V rows), written straight into a new buffer."""
        size = int(ll.llama_state_seq_get_size(self.ptr, seq_id))
        buf = bytearray(size)
        written = ll.llama_state_seq_get_data(self.ptr, (ctypes.c_uint8 * size).from_buffer(buf), size, seq_id)
        if written != size:
            raise NativeError(f"llama_state_seq_get_data wrote {written} of {size} bytes for seq {seq_id}")
        return buf

    def state_seq_set(self, seq_id: int, payload: bytes | bytearray | memoryview) -> bool:
        """Replace `seq_id` with a saved state in free cells; False if llama.cpp refused (no room, bad data)."""
        n = len(payload)
        if isinstance(payload, bytearray) or (isinstance(payload, memoryview) and not payload.readonly):
            src = (ctypes.c_uint8 * n).from_buffer(payload)
        else:
            src = (ctypes.c_uint8 * n).from_buffer_copy(payload)
        return int(ll.llama_state_seq_set_data(self.ptr, src, n, seq_id)) == n

    def close(self) -> None:
        if self.ptr:
            ll.llama_free(self.ptr)
            self.ptr = None


class Batch:
    """A reusable `llama_batch` whose arrays are numpy views (filling stays out of Python loops).

    Every row belongs to exactly one sequence: `seq_id[i]` points at row i of
    one int32 array, so setting the sequences is a vectorised write.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        seq_base = self.seq.ctypes.data
        self._seq_ptrs = (ctypes.POINTER(ll.llama_seq_id) * capacity)(
            *[ctypes.cast(seq_base + 4 * i, ctypes.POINTER(ll.llama_seq_id)) for i in range(capacity)]
        )
        self.n_tokens = 0

    def clear(self) -> None:
        self.n_tokens = 0

    def add(self, seq_id: int, tokens: list[int] | np.ndarray, pos0: int, want_logits_last: bool) -> int:
        """Append a run of tokens for one sequence at positions pos0...; returns the row of its last token."""
        n = len(tokens)
        start = self.n_tokens
        end = start + n
        if end > self.capacity:
            raise NativeError(f"batch overflow: {end} > {self.capacity}")
        self.token[start:end] = tokens
        self.pos[start:end] = np.arange(pos0, pos0 + n, dtype=np.int32)
        self.seq[start:end] = seq_id
        self.logits[start:end] = 0
        if want_logits_last:
            self.logits[end - 1] = 1
        self.n_tokens = end
        return end - 1

    def native(self, n_tokens: int) -> ll.llama_batch:
        b = ll.llama_batch()
        b.n_tokens = n_tokens
        b.token = self.token.ctypes.data_as(ctypes.POINTER(ll.llama_token))
        b.embd = ctypes.POINTER(ctypes.c_float)()
        b.pos = self.pos.ctypes.data_as(ctypes.POINTER(ll.llama_pos))
        b.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(ctypes.POINTER(ll.llama_seq_id)))
        b.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        return b


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token. temperature 0 is greedy.

    The chain is llama.cpp's common sampler's, in its order: logit bias,
    penalties, top-k, top-p, min-p, temperature, then a seeded draw (or the
    greedy pick); a grammar is checked against the pick, as `common_sampler_sample` does.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    #: Multiplies down the logit of every token among the last `PENALTY_LAST_N` (1: off).
    repeat_penalty: float = 1.0
    #: Subtracted from a recent token's logit once per occurrence (0: off).
    frequency_penalty: float = 0.0
    #: Subtracted from a recent token's logit once if it occurs at all (0: off).
    presence_penalty: float = 0.0
    #: (token id, bias) pairs added to those tokens' logits; -100 bans a token, 100 forces it.
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: A grammar every output must match (llguidance's: Lark text with start rule `start`, or what
    #: `json_grammar` makes); None: any text.
    grammar: str | None = None
    #: Makes `grammar` lazy: the output is free until a token ends it with this text, and
    #: follows `grammar` from the next token on (a tool call's opening tag). A token that runs
    #: past the text does not switch the grammar on (see `Sampler`).
    grammar_trigger: str | None = None

    @property
    def penalised(self) -> bool:
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


#: How many recent tokens the penalties count: llama-server's default (`--repeat-last-n 64`).
PENALTY_LAST_N = 64


#: Bounds every grammar's compile and every mask: whatever the schema, a grammar that would pass
#: them is refused when it is checked (`grammar_error`), and a step that would pass them mid-output
#: ends its own request. Tighter than llguidance's defaults, since a mask is computed on the
#: engine thread, where every lane waits for it: its lexer work per step is a quarter (a regex
#: like `a{1000000000}` stopped after about 40 ms of one step here, not 300), and its lexer states
#: a fifth (each is 1-2 kB, and one tenant's schema must not take the server's memory).
GRAMMAR_LIMITS = LLParserLimits(max_lexer_states=50_000, initial_lexer_fuel=200_000, step_lexer_fuel=50_000,
                                verbose_errors=False)

#: How a schema's JSON is spelled: `lenient` ignores keywords llguidance does not implement
#: (`format`, `$comment`, ...) as llama.cpp's converter does, rather than refuse real tool
#: schemas; whitespace is bounded, so a small model cannot pad its output with it forever.
_JSON_OPTIONS = {"lenient": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,20}"}


def json_grammar(schema: dict | bool | None = None) -> str:
    """The grammar (llguidance's) of JSON output: any JSON object (`schema` None), or JSON that
    follows `schema`. ValueError for a schema that is not JSON (a lone surrogate, say) or
    that does not compile (one that admits nothing, or is past `GRAMMAR_LIMITS`)."""
    grammar = LLMatcher.grammar_from_json_schema({"type": "object"} if schema is None else schema,
                                                 defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
    error = grammar_error(grammar)
    if error:
        raise ValueError(f"the JSON schema cannot be turned into a grammar: {error}")
    return grammar


@dataclass(frozen=True)
class FreeText:
    """A value that is text rather than JSON: any text (`syntax` "text", ended by the text that
    follows it), or text a user's grammar allows (`syntax` "lark" or "regex", `definition` the
    grammar: llguidance's Lark, or a Rust `regex` pattern, as OpenAI's custom tools give them)."""

    syntax: str
    definition: str = ""


def literal_json_grammar(alternatives: Sequence[tuple[str, str, dict | FreeText, str]], *,
                         repeat_with: str | None) -> str:
    """The grammar of one of `alternatives` (a label for errors, text before, a value, text after),
    or, with `repeat_with`, one or more of them joined by that text: the shape of tool calls,
    whose wrapping is fixed text and whose arguments follow each tool's JSON schema (or, for a
    `FreeText` value, are text). ValueError, led by its label, for a schema that is not JSON or a
    value's grammar that does not compile."""
    rules = []
    subgrammars: list[dict[str, str]] = []
    for i, (label, _, value, after) in enumerate(alternatives):
        try:
            if isinstance(value, FreeText):
                rule, sub = _free_text_rule(i, value, after)
                rules.append(rule)
                subgrammars += sub
                continue
            json_grammar(value)
            body = json.dumps(_with_options(value), ensure_ascii=True)
        except ValueError as exc:
            raise ValueError(f"{label}: {exc}") from None
        rules.append(f"value{i}: %json {body}")
    # Lark string literals are JSON strings: json.dumps escapes whatever the text holds. Any
    # text's rule ends with the text after it (its suffix), so that text is not repeated here.
    one = "one: " + " | ".join(
        f"{json.dumps(before)} value{i}" + ("" if _any_text(value) else f" {json.dumps(after)}")
        for i, (_, before, value, after) in enumerate(alternatives))
    start = f"start: one ({json.dumps(repeat_with)} one)*" if repeat_with is not None else "start: one"
    main = "\n".join([start, one, *rules]) + "\n"
    if not subgrammars:
        return LLMatcher.grammar_from_lark(main)
    return json.dumps({"grammars": [{"lark_grammar": main}, *subgrammars]})


def _any_text(value: dict | FreeText) -> bool:
    return isinstance(value, FreeText) and value.syntax == "text"


def _free_text_rule(i: int, value: FreeText, after: str) -> tuple[str, list[dict[str, str]]]:
    """Rule `value{i}` for text, and the user's grammar it refers to (its own lexer: its tokens
    and `%ignore` cannot change how the wrapping around it lexes). ValueError for a grammar that
    does not compile."""
    if value.syntax == "text":
        # Any text up to the first `after`: a lazy lexeme ended by that suffix, which the
        # model writes too. A greedy `/(.|\n)*/` would never end.
        return f"value{i}[suffix={json.dumps(after)}]: /(.|\\n)*/", []
    if value.syntax == "lark":
        grammar = value.definition
    elif value.syntax == "regex":
        # A Lark regex literal ends at an unescaped slash; an escaped one is a slash to `regex`.
        pattern = re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", value.definition)
        # ...and at the end of its line: a line break in the pattern is its escape to `regex`.
        grammar = "start: /" + pattern.replace("\n", "\\n").replace("\r", "\\r") + "/\n"
    else:
        raise ValueError(f"grammar syntax {value.syntax!r} is not supported (only 'lark' and 'regex')")
    # Checked alone, so a reference to another grammar (`@text0`, this one's own name among
    # them) is unknown: the names are this module's, not the client's.
    error = grammar_error(grammar)
    if error:
        raise ValueError(f"the {value.syntax} grammar cannot be used: {error}")
    name = f"text{i}"
    return f"value{i}: @{name}", [{"name": name, "lark_grammar": grammar}]


def _with_options(schema: dict) -> dict | bool:
    """`schema` with the JSON options in its `x-guidance` (how a Lark `%json` rule takes them)."""
    if not isinstance(schema, dict):
        return schema
    return {**schema, "x-guidance": {**_JSON_OPTIONS, **schema.get("x-guidance", {})}}


def grammar_error(grammar: str) -> str:
    """Why `grammar` cannot be used ("" when it can): a syntax error, a schema that admits nothing,
    or a grammar past `GRAMMAR_LIMITS`. Bounded in time by those limits (a large grammar takes a
    few hundred milliseconds: call it off the event loop), GIL released. Remembered by digest:
    the server checks a grammar where it is made and the engine again where it is submitted,
    and the second check must not cost the compile again on the caller's thread."""
    key = blake3(grammar.encode("utf-8", "surrogatepass")).digest()
    with _checked_lock:
        known = _checked.get(key)
        if known is not None:
            _checked.move_to_end(key)
            return known
    error = LLMatcher.validate_grammar(grammar, None, limits=GRAMMAR_LIMITS)
    with _checked_lock:
        _checked[key] = error
        while len(_checked) > _CHECKED_GRAMMARS:
            _checked.popitem(last=False)
    return error


#: Grammars checked lately, by digest (32 bytes each: the grammars themselves are not kept).
_CHECKED_GRAMMARS = 4096
_checked: OrderedDict[bytes, str] = OrderedDict()
_checked_lock = threading.Lock()


@functools.cache
def builtin_chat_templates() -> tuple[str, ...]:
    """The names of llama.cpp's built-in chat templates (`llama_chat_builtin_templates`); fixed
    by the build, so asked once: every chat request rendered with one checks its name here."""
    count = ll.llama_chat_builtin_templates((ctypes.c_char_p * 0)(), 0)
    names = (ctypes.c_char_p * count)()
    ll.llama_chat_builtin_templates(names, count)
    return tuple(names[i].decode() for i in range(count))


def apply_builtin_chat_template(name: str, messages: Sequence[tuple[str, str]]) -> str:
    """`messages` (role, content) rendered by llama.cpp's built-in template `name`, with the
    assistant's opening added (`llama_chat_apply_template`); ValueError for an unknown name."""
    if name not in builtin_chat_templates():
        # Given anything else, llama.cpp guesses a template from the text: never a silent guess.
        raise ValueError(f"{name!r} is not one of llama.cpp's built-in chat templates")
    keep = [(role.encode(), content.encode()) for role, content in messages]
    chat = (ll.llama_chat_message * len(keep))(*(ll.llama_chat_message(role, content) for role, content in keep))
    size = 2 * sum(len(r) + len(c) for r, c in keep) + 256
    while True:
        buf = ctypes.create_string_buffer(size)
        n = ll.llama_chat_apply_template(name.encode(), chat, len(keep), True, buf, size)
        if n < 0:
            raise ValueError(f"llama.cpp's built-in chat template {name!r} refused the messages")
        if n <= size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n


#: Memory layout of `llama_token_data` (id, logit, p).
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])

#: llama.cpp's "pick a random seed" value.
_DEFAULT_SEED = 0xFFFFFFFF


def _grammar_failure(matcher: LLMatcher) -> str:
    # Without verbose errors llguidance still appends a marker that says nothing to a client.
    error = matcher.get_error().replace("<non-verbose/>", "").strip()
    return f"the grammar (from response_format or tools) went past this server's grammar limits or failed: {error}"


class Sampler:
    """A llama.cpp sampler chain for one request, and its grammar if it has one.

    The grammar is an llguidance matcher: its compile and each of its steps are
    bounded (`GRAMMAR_LIMITS`), so no schema can make it take unbounded time or
    memory, and it reports a failure instead of aborting the process as
    llama.cpp's grammar does. It is kept out of the chain and checked against
    the chain's pick (one token), the chain running again over the grammar's
    mask only when the pick breaks it, as llama.cpp's `common_sampler_sample`
    does: most picks already fit, and checking one costs less than a mask.

    A lazy grammar (`grammar_trigger`) is made only once a token ends the output
    with the trigger, and holds from the next token. llama.cpp's own lazy grammar
    is not used: on its trigger it feeds the firing token's text past the trigger
    to the grammar in one go, and text the grammar refuses there throws through
    its C API, which aborts the process. Here the grammar only ever sees tokens
    it allows; a token that runs past the trigger leaves the output free.
    """

    def __init__(self, params: SamplingParams, model: NativeModel, prompt: Sequence[int] = ()) -> None:
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        self.ptr = chain
        self.grammar = None
        if params.logit_bias:
            biases = (ll.llama_logit_bias * len(params.logit_bias))(*params.logit_bias)
            # llama.cpp copies the array.
            ll.llama_sampler_chain_add(
                chain, ll.llama_sampler_init_logit_bias(model.n_vocab, len(params.logit_bias), biases)
            )
        if params.penalised:
            # This build's signature leads with n_vocab (upstream llama.cpp dropped it).
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_penalties(
                model.n_vocab, PENALTY_LAST_N, params.repeat_penalty, params.frequency_penalty,
                params.presence_penalty))
        if params.temperature <= 0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(params.top_k))
            if params.top_p < 1.0:
                ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0.0:
                ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_min_p(params.min_p, 1))
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_temp(params.temperature))
            seed = _DEFAULT_SEED if params.seed is None else params.seed & 0xFFFFFFFF
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dist(seed))
        if params.penalised:
            # The penalties count the prompt too: llama-server feeds every prompt
            # token through its sampler (`common_sampler_accept(..., false)`, grammar
            # left out) before the first pick, so a request penalised here gets the
            # tokens it would get there. The window holds the last PENALTY_LAST_N
            # tokens only, so feeding those gives the same counts as feeding all.
            # Done here, from the prompt, so a cached and an uncached run agree.
            for token in prompt[-PENALTY_LAST_N:]:
                ll.llama_sampler_accept(chain, token)
        self._model = model
        #: A lazy grammar not yet switched on, its trigger, and the output's last bytes.
        self._dormant: str | None = None
        self._trigger = b""
        self._tail = b""
        if params.grammar is not None and params.grammar_trigger:
            self._dormant = params.grammar
            self._trigger = params.grammar_trigger.encode("utf-8")
        elif params.grammar is not None:
            try:
                self.grammar = self._make_grammar(params.grammar)
            except NativeError:
                self.close()
                raise

    def _make_grammar(self, text: str) -> LLMatcher:
        matcher = LLMatcher(self._model.grammar_tokenizer, text, limits=GRAMMAR_LIMITS, log_level=0)
        if matcher.is_error():
            raise NativeError(_grammar_failure(matcher))
        return matcher

    def sample(self, ctx: NativeContext, row: int) -> int:
        """Sample from batch row `row`'s logits and accept the token (`llama_sampler_sample`)."""
        if self.grammar is None:
            token = int(ll.llama_sampler_sample(self.ptr, ctx.ptr, row))
            self._watch(token)
            return token
        ptr = ll.llama_get_logits_ith(ctx.ptr, row)
        return self.sample_logits(np.ctypeslib.as_array(ptr, shape=(ctx.model.n_vocab,)))

    def sample_logits(self, logits: np.ndarray) -> int:
        """What `sample` does, on logits kept from an earlier decode: apply the chain, accept."""
        token = self._pick(logits)
        if self.grammar is not None:
            if self.grammar.validate_tokens([token]) != 1:
                token = self._pick(logits, self._allowed(logits.shape[0]))
            if not self.grammar.consume_token(token):
                raise NativeError(_grammar_failure(self.grammar))
        ll.llama_sampler_accept(self.ptr, token)
        self._watch(token)
        return token

    def forced(self, limit: int) -> list[int]:
        """The next tokens the grammar allows alone from here (llguidance's fast-forward tokens:
        `<tool_call>\\n{"name": "` before a call, the rest of a tool's name once its first token
        tells it apart), at most `limit`. Sampling picks each of them whatever the logits, unless
        the chain bans one; [] without an active grammar."""
        if self.grammar is None or limit <= 0 or self.grammar.is_stopped():
            return []
        tokens = self.grammar.compute_ff_tokens()
        # A grammar past its limits here reports it on the next sample, as without this call.
        return [] if self.grammar.is_error() else tokens[:limit]

    def _watch(self, token: int) -> None:
        """Switch a lazy grammar on once a token ends the output with its trigger."""
        if self._dormant is None:
            return
        self._tail = (self._tail + self._model.token_bytes(token))[-len(self._trigger):]
        if self._tail == self._trigger:
            self.grammar = self._make_grammar(self._dormant)
            self._dormant = None

    def _pick(self, logits: np.ndarray, allowed: np.ndarray | None = None) -> int:
        """The chain's choice over all of `logits`, or only over the tokens `allowed` (a grammar's mask)."""
        n = logits.shape[0]
        data = np.empty(n, dtype=_TOKEN_DATA)
        data["id"] = np.arange(n, dtype=np.int32)
        data["logit"] = logits if allowed is None else np.where(allowed, logits, -np.inf)
        data["p"] = 0.0
        cur = ll.llama_token_data_array(
            data=data.ctypes.data_as(ll.llama_token_data_p), size=n, selected=-1, sorted=False
        )
        ll.llama_sampler_apply(self.ptr, ctypes.byref(cur))
        if not 0 <= cur.selected < cur.size:
            raise NativeError(f"the sampler chain selected no token ({cur.selected})")
        chosen = cur.data[cur.selected]
        if allowed is not None and chosen.logit == -np.inf:
            # Every token the grammar allows was ruled out by the chain (a logit bias of -inf).
            raise NativeError("the grammar allows no token here")
        return int(chosen.id)

    def _allowed(self, n_vocab: int) -> np.ndarray:
        """The grammar's mask over the vocabulary, as booleans; NativeError when it allows nothing."""
        assert self.grammar is not None
        bits = np.frombuffer(self.grammar.compute_bitmask(), dtype=np.uint8)
        if self.grammar.is_error():
            raise NativeError(_grammar_failure(self.grammar))
        allowed = np.unpackbits(bits, bitorder="little")[:n_vocab].astype(bool)
        if len(allowed) < n_vocab:
            allowed = np.concatenate([allowed, np.zeros(n_vocab - len(allowed), dtype=bool)])
        if not allowed.any():
            raise NativeError("the grammar allows no token here")
        return allowed

    def close(self) -> None:
        if self.ptr:
            ll.llama_sampler_free(self.ptr)
            self.ptr = None
        self.grammar = None
