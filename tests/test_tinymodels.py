"""The tiny random models (tinymodels.py) load, tokenize and decode in llama.cpp.

Each must also report the memory layout it stands for (recurrent, hybrid, sliding window).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import llama_cpp as ll
import numpy as np
import pytest
from tinymodels import ARCHS, build

pytestmark = [pytest.mark.model, pytest.mark.timeout(120)]

#: What each model must report: (llama_model_is_recurrent, llama_model_is_hybrid, llama_model_n_swa).
EXPECTED: dict[str, tuple[bool, bool, int]] = {
    "llama": (False, False, 0),
    "qwen3": (False, False, 0),
    "gemma3": (False, False, 16),
    "mamba2": (True, False, 0),
    "lfm2": (False, True, 0),
    "granitehybrid": (False, True, 0),
    "qwen35": (False, True, 0),
    "rwkv7": (True, False, 0),
}

#: Plain ASCII of about 40 tokens: whole-word pieces, single letters, punctuation, digits.
TEXT = (
    "Hello world, the prefix cache model said: one token at a time, then two more. "
    "Now find the long way down (42 steps)!"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tinymodels")


class Loaded:
    def __init__(self, path: Path) -> None:
        ll.llama_backend_init()
        mp = ll.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = ll.llama_model_load_from_file(str(path).encode(), mp)
        assert self.model, f"llama.cpp could not load {path}"
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        cp = ll.llama_context_default_params()
        cp.n_ctx = 512
        cp.n_batch = 512
        cp.n_ubatch = 512
        cp.n_seq_max = 4
        cp.kv_unified = True
        cp.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cp.n_threads = cp.n_threads_batch = 2
        self.ctx = ll.llama_init_from_model(self.model, cp)
        assert self.ctx, f"llama.cpp could not create a context for {path}"

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        out = (ll.llama_token * (len(data) + 8))()
        n = ll.llama_tokenize(self.vocab, data, len(data), out, len(out), True, False)
        assert n > 0
        return list(out[:n])

    def detokenize(self, tokens: list[int]) -> str:
        arr = (ll.llama_token * len(tokens))(*tokens)
        buf = ctypes.create_string_buffer(4096)
        n = ll.llama_detokenize(self.vocab, arr, len(tokens), buf, len(buf), True, False)
        assert n >= 0
        return buf.raw[:n].decode()

    def piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        assert n >= 0
        return buf.raw[:n]

    def decode(self, tokens: list[int], pos0: int, seq: int) -> np.ndarray:
        """Decode `tokens` at positions pos0.. in sequence `seq`; the logits of every row."""
        batch = ll.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, tok in enumerate(tokens):
                batch.token[i] = tok
                batch.pos[i] = pos0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = True
            batch.n_tokens = len(tokens)
            rc = ll.llama_decode(self.ctx, batch)
            assert rc == 0, f"llama_decode returned {rc}"
        finally:
            ll.llama_batch_free(batch)
        rows = [
            np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).copy()
            for i in range(len(tokens))
        ]
        return np.stack(rows)

    def close(self) -> None:
        ll.llama_free(self.ctx)
        ll.llama_model_free(self.model)


@pytest.fixture(params=ARCHS)
def loaded(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[tuple[str, Loaded]]:
    arch = request.param
    m = Loaded(build(arch, model_dir / f"{arch}.gguf"))
    yield arch, m
    m.close()


def test_expected_table_covers_every_arch() -> None:
    assert set(EXPECTED) == set(ARCHS)


def test_small_and_deterministic(tmp_path: Path) -> None:
    for arch in ARCHS:
        a = build(arch, tmp_path / f"{arch}-a.gguf", seed=1)
        b = build(arch, tmp_path / f"{arch}-b.gguf", seed=1)
        c = build(arch, tmp_path / f"{arch}-c.gguf", seed=2)
        assert a.stat().st_size < 1_000_000, arch
        assert a.read_bytes() == b.read_bytes(), arch
        assert a.read_bytes() != c.read_bytes(), arch


def test_loads_tokenizes_and_decodes(loaded: tuple[str, Loaded]) -> None:
    arch, m = loaded
    model = m.model
    flags = (
        bool(ll.llama_model_is_recurrent(model)),
        bool(ll.llama_model_is_hybrid(model)),
        int(ll.llama_model_n_swa(model)),
    )
    assert flags == EXPECTED[arch]

    bos, eos = ll.llama_vocab_bos(m.vocab), ll.llama_vocab_eos(m.vocab)
    assert (bos, eos) == (1, 2)
    tokens = m.tokenize(TEXT)
    assert tokens[0] == bos
    assert 35 <= len(tokens) <= 60, len(tokens)
    # As with any SPM vocabulary, the leading "▁" is dropped only when no BOS precedes it.
    assert m.detokenize(tokens[1:]) == TEXT
    assert b"".join(m.piece(t) for t in tokens[1:]).decode() == " " + TEXT

    logits = m.decode(tokens, 0, seq=0)
    assert np.isfinite(logits).all()
    assert (logits.std(axis=1) > 1e-3).all(), "a row of near-constant logits"
    assert not np.allclose(logits[0], logits[-1]), "every position predicts the same"

    # One more token on the same sequence, and a second sequence: both must decode.
    nxt = int(np.argmax(logits[-1]))
    assert np.isfinite(m.decode([nxt], len(tokens), seq=0)).all()
    other = m.decode(tokens[:10], 0, seq=1)
    assert np.isfinite(other).all()
    # Same tokens, same positions, fresh sequence: the same predictions up to float
    # rounding (logits are ~0.4 in scale). This caught rwkv7 with a 16-wide head,
    # where the CPU kernel overran the head and the logits moved by 1e-3.
    np.testing.assert_allclose(other[-1], logits[9], rtol=0, atol=1e-4)
