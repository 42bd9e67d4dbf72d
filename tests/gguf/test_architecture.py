"""A GGUF file's metadata -> ModelConfig fields (llama / qwen2 / qwen3 / gpt2), and the files refused, one line
each naming what is wrong: an architecture not carried (with those allowed), a feature the model lacks, tensors
whose count or shapes disagree with the metadata, a missing size."""

from __future__ import annotations

import numpy as np
import pytest

from decoderlab.gguf import read_gguf
from decoderlab.gguf.architecture import ARCHITECTURES

pytest.importorskip("gguf")


def refused(path) -> str:
    with pytest.raises(ValueError) as e:
        read_gguf(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_llama_fields(tiny_gguf):
    path, hf = tiny_gguf("llama")
    f = read_gguf(path).fields
    assert f == dict(num_tokens=300, d_model=64, n_layer=2, n_head=4, n_kv_head=2, head_dim=0, max_len=64, d_ff=96,
                     attention="sdpa", tie_weights=True, dropout=0.0, norm="rmsnorm", position="rope",
                     rope_layout="rotate_half", rope_theta=50000.0, norm_eps=pytest.approx(1e-5), mlp="swiglu",
                     bias=False, qkv_bias=False, qk_norm=False, qk_norm_gain=False, attn_out_proj=True,
                     lm_head_bias=False)


def test_qwen_and_gpt2_fields(tiny_gguf):
    q2 = read_gguf(tiny_gguf("qwen2", model=dict(tie_word_embeddings=False))[0]).fields
    assert q2["qkv_bias"] and not q2["qk_norm_gain"] and not q2["tie_weights"]
    q3 = read_gguf(tiny_gguf("qwen3")[0]).fields
    assert q3["qk_norm"] and q3["qk_norm_gain"] and q3["head_dim"] == 128 and q3["n_head"] == 2 and not q3["qkv_bias"]
    g = read_gguf(tiny_gguf("gpt2")[0]).fields
    assert (g["position"], g["norm"], g["mlp"], g["bias"], g["max_len"], g["d_ff"]) == ("learned", "layernorm",
                                                                                       "gelu", True, 1024, 256)


def test_architecture_not_carried_names_those_allowed(tiny_gguf, tmp_path, bpe):
    from support.gguf_files import hf_model, write_gguf

    path = write_gguf(tmp_path / "phi3.gguf", "phi3", hf_model("llama", 300), bpe)
    msg = refused(path)
    assert "'phi3'" in msg and all(a in msg for a in ARCHITECTURES)


@pytest.mark.parametrize("key,value,what", [("llama.rope.scaling.type", "yarn", "rotary position scaling"),
                                            ("llama.expert_count", 8, "mixture of experts"),
                                            ("llama.rope.dimension_count", 8, "rope.dimension_count"),
                                            ("llama.embedding_length", None, "embedding_length is missing")])
def test_feature_not_carried_or_missing_is_named(tiny_gguf, key, value, what):
    path, _ = tiny_gguf("llama", extra={key: value})
    assert what in refused(path)


def test_tensor_count_and_shapes_must_match_metadata(tiny_gguf):
    msg = refused(tiny_gguf("llama", extra={"llama.block_count": 3})[0])
    assert "blk.2.attn_norm.weight is missing" in msg and "3 blocks" in msg
    msg = refused(tiny_gguf("llama", extra={"llama.block_count": 1})[0])
    assert "blk.1." in msg and "not one of the llama architecture's tensors" in msg
    msg = refused(tiny_gguf("llama", extra={"llama.feed_forward_length": 128})[0])
    assert "has shape (96, 64)" in msg and "says (128, 64)" in msg
    path, _ = tiny_gguf("llama", tensors={"blk.0.attn_q.weight": np.zeros((60, 64), np.float32)})
    assert "blk.0.attn_q.weight has shape (60, 64)" in refused(path)


@pytest.mark.parametrize("overrides,architecture", [
    (dict(), "gpt2"), (dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False), "llama"),
    (dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=True), "qwen2"),
    (dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, qk_norm=True), "qwen3"),
])
def test_a_model_is_written_as_the_architecture_that_computes_it(overrides, architecture):
    import decoderlab as dl
    from decoderlab.gguf import gguf_architecture

    assert gguf_architecture(dl.preset("gpt2", **overrides)) == architecture


@pytest.mark.parametrize("overrides,option", [
    (dict(position="rope"), "--position rope"), (dict(mlp="relu2"), "--mlp relu2"),
    (dict(qk_norm=True), "ModelConfig.qk_norm"),
])
def test_a_model_no_architecture_computes_is_refused_naming_the_field(overrides, option):
    import decoderlab as dl
    from decoderlab.gguf import ExportError, gguf_architecture

    with pytest.raises(ExportError, match="--format gguf writes the models a llama.cpp architecture computes exactly "
                                          r"\(llama, qwen2, qwen3, gpt2, gemma3\); the nearest is gpt2") as e:
        gguf_architecture(dl.preset("gpt2", **overrides))
    assert option in str(e.value) and e.value.field == next(iter(overrides)) and "\n" not in str(e.value)
