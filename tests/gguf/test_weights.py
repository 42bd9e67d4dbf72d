"""Weights read from GGUF files equal what transformers' own GGUF loader makes of the same file: for each
architecture and each GGML type the gguf package writes (and the K-quants it only reads), our dequantized state
dict equals transformers' (llama's query/key permutation undone, q | k | v fused); an F32 file gives back the
exact weights it was written from; a type gguf cannot dequantize is refused before any weight is read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decoderlab.gguf import GGUFFile, read_gguf
from decoderlab.gguf.weights import dequantizable, unpermute

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

WRITABLE = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "TQ1_0", "TQ2_0", "MXFP4"]
K_QUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def ours_from_hf(arch: str, hf) -> dict[str, torch.Tensor]:
    """A transformers model's weights under our names (the agreed interface, INTERFACE.md)."""
    sd = {k: v.detach().float() for k, v in hf.state_dict().items()}
    out = {}
    if arch == "gpt2":
        sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
        out.update({"we.weight": sd["wte.weight"], "pe.weight": sd["wpe.weight"], "norm_f.weight": sd["ln_f.weight"],
                    "norm_f.bias": sd["ln_f.bias"]})
        names = {"ln_1": "norm_1", "attn.c_attn": "attention.qkv", "attn.c_proj": "attention.proj",
                 "ln_2": "norm_2", "mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}
        for i in range(hf.config.n_layer):
            for theirs, ours in names.items():
                w = sd[f"h.{i}.{theirs}.weight"]
                out[f"blocks.{i}.{ours}.weight"] = w.T if w.ndim == 2 else w
                out[f"blocks.{i}.{ours}.bias"] = sd[f"h.{i}.{theirs}.bias"]
        return out
    out.update({"we.weight": sd["model.embed_tokens.weight"], "norm_f.weight": sd["model.norm.weight"]})
    if not hf.config.tie_word_embeddings:
        out["fc_layer.weight"] = sd["lm_head.weight"]
    names = {"input_layernorm": "norm_1", "post_attention_layernorm": "norm_2", "self_attn.o_proj": "attention.proj",
             "self_attn.q_norm": "attention.q_norm", "self_attn.k_norm": "attention.k_norm",
             "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.fc", "mlp.down_proj": "mlp.proj"}
    for i in range(hf.config.num_hidden_layers):
        p = f"model.layers.{i}."
        for theirs, ours in names.items():
            if p + theirs + ".weight" in sd:
                out[f"blocks.{i}.{ours}.weight"] = sd[p + theirs + ".weight"]
        for param in ("weight", "bias"):
            if p + f"self_attn.q_proj.{param}" in sd:
                out[f"blocks.{i}.attention.qkv.{param}"] = torch.cat(
                    [sd[p + f"self_attn.{x}_proj.{param}"] for x in "qkv"])
    return out


def wide(arch: str, qtype: str) -> dict:
    """Model options whose matrices hold whole blocks of ``qtype`` (256 values for the K-quants and TQ types)."""
    if gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0] < 256:
        return {}
    if arch == "gpt2":
        return dict(model=dict(n_embd=256))
    return dict(model=dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2))


def transformers_gguf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()


def assert_same_state(ours: dict, theirs: dict, exact: bool = True) -> None:
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        assert ours[k].shape == theirs[k].shape, k
        if exact:
            assert torch.equal(ours[k], theirs[k]), k
        else:  # two dequantizers (gguf's NumPy, transformers' torch): float32 rounding apart at most
            torch.testing.assert_close(ours[k], theirs[k], rtol=1e-6, atol=1e-6, msg=k)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gpt2"])
def test_f32_file_gives_back_the_weights_written(tiny_gguf, arch):
    path, hf = tiny_gguf(arch)
    contents = read_gguf(path)
    assert_same_state(contents.state, ours_from_hf(arch, hf))
    assert_same_state(contents.state, ours_from_hf(arch, transformers_gguf(path)))
    assert contents.info.report.types == {"F32": len(GGUFFile(path).tensors)}


@pytest.mark.slow
@pytest.mark.parametrize("qtype", WRITABLE)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_quantized_weights_equal_transformers_dequantized(tiny_gguf, arch, qtype):
    path, _ = tiny_gguf(arch, qtype, **wide(arch, qtype))
    contents = read_gguf(path)
    assert_same_state(contents.state, ours_from_hf(arch, transformers_gguf(path)), exact=False)
    assert contents.info.report.types.get(qtype, 0) > 0, contents.info.report.types


@pytest.mark.parametrize("arch,qtype", [("qwen2", "Q8_0"), ("qwen3", "Q4_1"), ("llama", "Q4_0")])
def test_quantized_weights_equal_transformers_dequantized_fast(tiny_gguf, arch, qtype):
    path, _ = tiny_gguf(arch, qtype)
    contents = read_gguf(path)
    assert contents.info.report.types.get(qtype, 0) > 0
    assert_same_state(contents.state, ours_from_hf(arch, transformers_gguf(path)), exact=False)


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_k_quants_equal_transformers_dequantized(tiny_gguf, qtype):
    path, _ = tiny_gguf("llama", qtype, **wide("llama", qtype))
    contents = read_gguf(path)
    assert contents.info.report.types[qtype] == 1 + 2 * 7  # token_embd and 7 matrices a block, 2 blocks
    assert_same_state(contents.state, ours_from_hf("llama", transformers_gguf(path)), exact=False)


def test_unpermute_inverts_llama_cpp_permutation():
    from support.gguf_files import llama_permute

    rows = np.arange(6 * 8 * 3).reshape(6 * 8, 3)
    assert np.array_equal(unpermute(llama_permute(rows, 6), 6), rows)
    assert not np.array_equal(llama_permute(rows, 6), rows)


def test_type_gguf_cannot_dequantize_is_refused(tiny_gguf, tmp_path, bpe):
    from support.gguf_files import hf_model, write_gguf

    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"} <= set(dequantizable())
    assert "Q8_K" not in dequantizable()
    model = hf_model("llama", bpe.get_vocab_size(), hidden_size=256, intermediate_size=256)
    raw = np.zeros((256, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K][1]), dtype=np.uint8)
    path = write_gguf(tmp_path / "q8k.gguf", "llama", model, bpe, tensors={"blk.1.ffn_gate.weight": raw},
                      types={"blk.1.ffn_gate.weight": "Q8_K"})
    with pytest.raises(ValueError) as e:
        read_gguf(path)
    msg = str(e.value)
    assert "blk.1.ffn_gate.weight is Q8_K" in msg and "cannot dequantize" in msg and "Q4_1" in msg and "\n" not in msg


def test_dequantize_rows_equals_gguf_dequantize(tiny_gguf):
    from decoderlab.gguf.weights import dequantize_rows

    rng = np.random.default_rng(0)
    for qtype in WRITABLE + ["F32"]:
        q = gguf.GGMLQuantizationType[qtype]
        block, _ = gguf.GGML_QUANT_SIZES[q]
        values = rng.normal(size=(7, 4 * max(block, 32))).astype(np.float32)
        raw = gguf.quants.quantize(values, q)
        raw = raw.view(np.uint8).reshape(7, -1)
        assert np.array_equal(dequantize_rows(raw, q), gguf.quants.dequantize(raw, q).reshape(7, -1)), qtype
    for qtype in K_QUANTS:
        from support.gguf_files import k_quant

        q = gguf.GGMLQuantizationType[qtype]
        raw = k_quant(gguf, 5, 512, q)
        assert np.array_equal(dequantize_rows(raw, q), gguf.quants.dequantize(raw, q)), qtype
