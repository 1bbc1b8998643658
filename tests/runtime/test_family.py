"""Recurrent and hybrid models never reuse KV alone."""

from __future__ import annotations

import numpy as np
import pytest

from skippy_cache.config import StageKvCacheMode, StageKvCachePayload
from skippy_cache.family import classify_tensor_names, resolve_mode
from skippy_cache.runtime.gguf_info import read_gguf_info

LLAMA_TENSORS = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_up.weight"]


@pytest.mark.parametrize(
    "recurrent_name",
    ["blk.0.ssm_conv1d.weight", "blk.3.time_mix_key.weight", "blk.1.recurrent_gate.weight", "rwkv.head.weight"],
)
def test_recurrent_tensors_disable_auto_mode(recurrent_name):
    verdict = classify_tensor_names([*LLAMA_TENSORS, recurrent_name])
    assert verdict.recurrent and verdict.evidence == recurrent_name
    mode, why = resolve_mode(StageKvCacheMode.AUTO, StageKvCachePayload.AUTO, verdict)
    assert mode is StageKvCacheMode.DISABLED
    assert recurrent_name in why


def test_attention_only_model_gets_lookup_record():
    verdict = classify_tensor_names(LLAMA_TENSORS)
    assert resolve_mode(StageKvCacheMode.AUTO, StageKvCachePayload.AUTO, verdict) == (
        StageKvCacheMode.LOOKUP_RECORD,
        None,
    )


def test_explicit_lookup_record_is_refused_for_recurrent_models():
    verdict = classify_tensor_names(["blk.0.ssm_in.weight"])
    mode, why = resolve_mode(StageKvCacheMode.LOOKUP_RECORD, StageKvCachePayload.RESIDENT_KV, verdict)
    assert mode is StageKvCacheMode.DISABLED and "ssm_in" in why


def test_tiny_gguf_with_ssm_tensor_is_classified_recurrent(tmp_path):
    import gguf

    path = tmp_path / "tiny-mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.add_tensor("blk.0.ssm_a", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    info = read_gguf_info(path)
    assert info.architecture == "mamba"
    assert info.family.recurrent and info.family.evidence == "blk.0.ssm_a"


def test_default_model_is_attention_only():
    from skippy_cache.runtime.gguf_info import default_model_path

    info = read_gguf_info(default_model_path())
    assert not info.family.recurrent
    assert info.chat_template and "im_start" in info.chat_template
