"""Prefix identity: every hashed field changes the id, framing is unambiguous, ids are stable."""

from __future__ import annotations

import dataclasses
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st

import skippy_cache
from skippy_cache.config import ContextConfig
from skippy_cache.identity import IdentityKey, PrefixHasher, prefix_identities, prefix_identity

SRC = Path(skippy_cache.__file__).resolve().parent.parent

KEY = IdentityKey(
    model_id="smollm2-135m-instruct",
    model_digest="sha256:0123456789abcdef",
    stage_id="stage-0",
    stage_index=0,
    layer_start=0,
    layer_end=30,
    runtime_abi="llama-cpp-python-0.3.36",
    weight_layout="CPU_Mapped",
    type_k="f16",
    type_v="f16",
    flash_attn=True,
    kv_unified=True,
    ctx_size=8192,
)
TOKENS = [1, 9690, 198, 2683, 359, 253, 5356, 11173, 30, 2] * 13  # 130 tokens

HASH_RE = re.compile(r"blake3:[0-9a-f]{64}")

# One changed value per hashed field; the test below fails if IdentityKey grows a
# field this table does not cover.
CHANGED = {
    "model_id": "smollm2-360m-instruct",
    "model_digest": "sha256:0123456789abcdee",
    "stage_id": "stage-1",
    "stage_index": 1,
    "layer_start": 1,
    "layer_end": 29,
    "runtime_abi": "llama-cpp-python-0.3.37",
    # Repacked weights run other matmul kernels: a state computed with them is another state.
    "weight_layout": "CPU_Mapped+CPU_REPACK",
    "type_k": "q8_0",
    "type_v": "q8_0",
    "flash_attn": False,
    "kv_unified": False,
    "ctx_size": 8193,
    "namespace": "chat-template:chatml",
    "extra": (("n_gpu_layers", "99"),),
}


def test_changed_table_covers_every_field() -> None:
    assert {f.name for f in dataclasses.fields(IdentityKey)} == set(CHANGED)


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_each_field_changes_the_identity(field: str) -> None:
    base = prefix_identity(KEY, TOKENS)
    changed_key = dataclasses.replace(KEY, **{field: CHANGED[field]})
    changed = prefix_identity(changed_key, TOKENS)
    assert changed.hash != base.hash
    assert changed.page_id != base.page_id
    assert changed.page_id.rsplit(":", 1)[1] != base.page_id.rsplit(":", 1)[1]


def test_extra_pairs_are_ordered_and_split_name_from_value() -> None:
    ids = {
        prefix_identity(dataclasses.replace(KEY, extra=extra), TOKENS).hash
        for extra in [
            (),
            (("a", "1"), ("b", "2")),
            (("b", "2"), ("a", "1")),
            (("a1", ""),),
            (("a", "1"),),
            (("", "a1"),),
        ]
    }
    assert len(ids) == 6


def test_token_start_changes_the_identity() -> None:
    at0 = prefix_identity(KEY, TOKENS, token_start=0)
    at1 = prefix_identity(KEY, TOKENS, token_start=1)
    assert at0.hash != at1.hash
    assert at1.page_id.startswith("stage-0:1:130:0:")
    assert at1.token_start == 1


def test_negative_token_start_is_refused() -> None:
    with pytest.raises(ValueError, match="token_start"):
        prefix_identity(KEY, TOKENS, token_start=-1)


def test_a_token_change_changes_the_identity() -> None:
    base = prefix_identity(KEY, TOKENS)
    for i in (0, 64, len(TOKENS) - 1):
        tokens = list(TOKENS)
        tokens[i] += 1
        assert prefix_identity(KEY, tokens).hash != base.hash, i


def test_token_order_changes_the_identity() -> None:
    assert prefix_identity(KEY, [1, 2, 3]).hash != prefix_identity(KEY, [1, 3, 2]).hash
    assert prefix_identity(KEY, [7, 8]).hash != prefix_identity(KEY, [8, 7]).hash


def test_token_count_changes_the_identity() -> None:
    hashes = {prefix_identity(KEY, TOKENS[:n]).hash for n in range(len(TOKENS) + 1)}
    assert len(hashes) == len(TOKENS) + 1
    # Trailing zeros are tokens too, not padding.
    assert prefix_identity(KEY, [5]).hash != prefix_identity(KEY, [5, 0]).hash
    assert prefix_identity(KEY, []).hash != prefix_identity(KEY, [0]).hash


def test_namespace_none_differs_from_empty() -> None:
    none = prefix_identity(KEY.with_namespace(None), TOKENS)
    empty = prefix_identity(KEY.with_namespace(""), TOKENS)
    assert none.hash != empty.hash
    assert none.page_id != empty.page_id


def test_with_namespace_replaces_only_namespace() -> None:
    assert KEY.with_namespace("t") == dataclasses.replace(KEY, namespace="t")
    assert KEY.with_namespace("t").with_namespace(None) == KEY


def test_hash_and_page_id_format() -> None:
    ident = prefix_identity(KEY, TOKENS)
    assert HASH_RE.fullmatch(ident.hash), ident.hash
    hex_digest = ident.hash.removeprefix("blake3:")
    assert ident.page_id == f"stage-0:0:130:0:{hex_digest[:16]}"
    assert ident.token_start == 0
    assert ident.token_count == 130


def test_page_id_fields_follow_key_and_run() -> None:
    key = dataclasses.replace(KEY, stage_id="s7", layer_start=12, layer_end=24)
    ident = prefix_identity(key, TOKENS[:100], token_start=30)
    stage, start, count, layer, short = ident.page_id.split(":")
    assert (stage, start, count, layer) == ("s7", "30", "100", "12")
    assert re.fullmatch(r"[0-9a-f]{16}", short)
    assert ident.hash == f"blake3:{short}" + ident.hash[len("blake3:") + 16 :]


def _framed(name: bytes, tag: bytes, value: bytes) -> bytes:
    return struct.pack("<B", len(name)) + name + tag + struct.pack("<Q", len(value)) + value


def test_hash_is_blake3_over_the_documented_stream() -> None:
    # Rebuilt from the framing rules by hand: length-prefixed name, type tag,
    # 8-byte length, value; then token_start, the tokens as int32 LE, and the count.
    def s(name: str, v: str) -> bytes:
        return _framed(name.encode(), b"s", v.encode())

    def i(name: str, v: int) -> bytes:
        return _framed(name.encode(), b"i", struct.pack("<q", v))

    def b(name: str, v: bool) -> bytes:
        return _framed(name.encode(), b"b", b"\x01" if v else b"\x00")

    key = KEY.with_namespace("tenant-a")
    header = b"".join(
        [
            s("domain", "skippy-cache/prefix-identity/v2"),
            s("model_id", key.model_id),
            s("model_digest", key.model_digest),
            s("stage_id", key.stage_id),
            i("stage_index", key.stage_index),
            i("layer_start", key.layer_start),
            i("layer_end", key.layer_end),
            s("runtime_abi", key.runtime_abi),
            s("weight_layout", key.weight_layout),
            s("type_k", key.type_k),
            s("type_v", key.type_v),
            b("flash_attn", key.flash_attn),
            b("kv_unified", key.kv_unified),
            i("ctx_size", key.ctx_size),
            s("namespace", "tenant-a"),
            i("extra_count", 0),
        ]
    )
    assert key.header_bytes() == header
    tokens = [1, 2, -3, 2**31 - 1]
    stream = header + i("token_start", 5) + b"tokens" + struct.pack("<4i", *tokens) + struct.pack("<Q", 4)
    assert prefix_identity(key, tokens, token_start=5).hash == "blake3:" + blake3(stream).hexdigest()
    assert KEY.header_bytes().endswith(_framed(b"namespace", b"n", b"") + i("extra_count", 0))


# Pinned: a change here means every stored page id changes (bump the domain string).
GOLDEN_TOKENS = list(range(100, 164))
GOLDEN_HASH = "blake3:d61a9557dcb0ce95023f594b5092386d6e62384fd86a09cf0611738fec287e44"


def test_golden_identity() -> None:
    ident = prefix_identity(KEY, GOLDEN_TOKENS)
    assert ident.hash == GOLDEN_HASH
    assert ident.page_id == f"stage-0:0:64:0:{GOLDEN_HASH[7:23]}"


def test_same_inputs_same_id_in_another_process() -> None:
    code = (
        "from skippy_cache.identity import IdentityKey, prefix_identity\n"
        f"key = IdentityKey(**{dataclasses.asdict(KEY)!r})\n"
        f"ident = prefix_identity(key, {GOLDEN_TOKENS!r})\n"
        "print(ident.hash, ident.page_id)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    ident = prefix_identity(KEY, GOLDEN_TOKENS)
    assert out.stdout.split() == [ident.hash, ident.page_id]
    assert ident.hash == GOLDEN_HASH


def test_identity_key_from_stage() -> None:
    stage = ContextConfig(
        stage_id="s1",
        stage_index=1,
        layer_start=10,
        layer_end=20,
        ctx_size=16384,
        cache_type_k="q8_0",
        cache_type_v="q4_0",
        flash_attn=False,
        kv_unified=True,
        model_id="m",
    )
    key = IdentityKey.from_context(stage, model_digest="d", runtime_abi="abi", weight_layout="CPU", namespace="ns")
    assert key == IdentityKey(
        model_id="m",
        model_digest="d",
        stage_id="s1",
        stage_index=1,
        layer_start=10,
        layer_end=20,
        runtime_abi="abi",
        weight_layout="CPU",
        type_k="q8_0",
        type_v="q4_0",
        flash_attn=False,
        kv_unified=True,
        ctx_size=16384,
        namespace="ns",
        extra=(),
    )
    # Documented exclusion: the lane count does not move the id.
    other = dataclasses.replace(stage, lane_count=1)
    assert IdentityKey.from_context(other, model_digest="d", runtime_abi="abi", weight_layout="CPU",
                                  namespace="ns") == key


# -- incremental hashing -----------------------------------------------------------------

token_lists = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=300)


@settings(max_examples=150, deadline=None)
@given(token_lists, st.data())
def test_prefix_identities_equal_one_shot_identities(tokens: list[int], data: st.DataObject) -> None:
    counts = data.draw(st.lists(st.integers(0, len(tokens)), max_size=12))
    start = data.draw(st.integers(0, 10_000))
    got = prefix_identities(KEY, tokens, counts, token_start=start)
    assert sorted(got) == sorted(set(counts))
    for n in counts:
        assert got[n] == prefix_identity(KEY, tokens[:n], token_start=start)
        assert got[n].token_count == n


def test_prefix_identities_of_policy_candidates() -> None:
    counts = [130, 128, 96, 64]
    got = prefix_identities(KEY, TOKENS, counts)
    assert list(got) == [64, 96, 128, 130]
    assert [got[n].page_id.split(":")[2] for n in counts] == ["130", "128", "96", "64"]
    assert got[130] == prefix_identity(KEY, TOKENS)


def test_prefix_hasher_refuses_descending_requests() -> None:
    hasher = PrefixHasher(KEY, TOKENS)
    assert hasher.identity(96) == prefix_identity(KEY, TOKENS[:96])
    assert hasher.identity(96) == prefix_identity(KEY, TOKENS[:96])  # the same length again is fine
    with pytest.raises(ValueError, match="ascending"):
        hasher.identity(64)
    assert hasher.identity(130) == prefix_identity(KEY, TOKENS)


@pytest.mark.parametrize("n", [-1, 131])
def test_prefix_hasher_refuses_out_of_range_counts(n: int) -> None:
    with pytest.raises(ValueError, match="outside"):
        PrefixHasher(KEY, TOKENS).identity(n)


# -- framing -----------------------------------------------------------------------------


def test_stage_id_and_index_framing_does_not_collide() -> None:
    a = prefix_identity(dataclasses.replace(KEY, stage_id="a1", stage_index=2), TOKENS)
    b = prefix_identity(dataclasses.replace(KEY, stage_id="a", stage_index=12), TOKENS)
    assert a.hash != b.hash


def test_string_fields_do_not_bleed_into_each_other() -> None:
    a = dataclasses.replace(KEY, model_id="ab", model_digest="c")
    b = dataclasses.replace(KEY, model_id="a", model_digest="bc")
    assert prefix_identity(a, TOKENS).hash != prefix_identity(b, TOKENS).hash
    c = dataclasses.replace(KEY, type_k="f16", type_v="q8_0")
    d = dataclasses.replace(KEY, type_k="q8_0", type_v="f16")
    assert prefix_identity(c, TOKENS).hash != prefix_identity(d, TOKENS).hash


def test_namespace_cannot_fake_tokens() -> None:
    # A namespace that spells out token bytes must not equal those tokens.
    fake = KEY.with_namespace("\x01\x00\x00\x00")
    assert prefix_identity(fake, []).hash != prefix_identity(KEY, [1]).hash


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.text(max_size=12)), st.one_of(st.none(), st.text(max_size=12)), token_lists)
def test_different_namespaces_never_collide(ns_a: str | None, ns_b: str | None, tokens: list[int]) -> None:
    a = prefix_identity(KEY.with_namespace(ns_a), tokens)
    b = prefix_identity(KEY.with_namespace(ns_b), tokens)
    assert (a.hash == b.hash) == (ns_a == ns_b)
    assert (a.page_id == b.page_id) == (ns_a == ns_b)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=6), st.integers(0, 200), st.text(max_size=6), st.integers(0, 200))
def test_stage_framing_never_collides(sid_a: str, idx_a: int, sid_b: str, idx_b: int) -> None:
    a = prefix_identity(dataclasses.replace(KEY, stage_id=sid_a, stage_index=idx_a), [1, 2, 3])
    b = prefix_identity(dataclasses.replace(KEY, stage_id=sid_b, stage_index=idx_b), [1, 2, 3])
    assert (a.hash == b.hash) == ((sid_a, idx_a) == (sid_b, idx_b))


def test_regression_hashing_is_length_framed() -> None:
    # The prefix [1] of the run [1, 2] must be the identity of [1] alone (the count,
    # not the run, ends the stream), and must differ from [1, 2] and from any run
    # whose token bytes spell the count trailer of a shorter run.
    short = prefix_identity(KEY, [1])
    assert prefix_identities(KEY, [1, 2], [1])[1] == short
    assert prefix_identity(KEY, [1, 2]).hash != short.hash
    # [1] + count 1 as u64 LE is the byte stream 01000000 01000000 00000000;
    # tokens [1, 1, 0] without a count would be exactly those bytes.
    assert prefix_identity(KEY, [1, 1, 0]).hash != short.hash
    assert prefix_identity(KEY, [1, 1]).hash != short.hash

