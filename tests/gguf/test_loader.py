"""A GGUF file as our model (decoderlab.gguf.load_gguf): logits equal to the model the file was written
from and to transformers' GGUF-loaded model (1e-5 on tiny float32 files of each architecture; 1e-4 on SmolLM2's
real file), llama's query/key permutation undone (skipping it changes the logits), the dtype asked, and the report
of what was dequantized."""

from __future__ import annotations

import pytest
import torch

from decoderlab.gguf import is_gguf_file, load_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return (out.logits if hasattr(out, "logits") else out).float()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gpt2"])
def test_logits_equal_the_written_model_and_transformers_gguf_model(tiny_gguf, arch):
    path, hf = tiny_gguf(arch)
    ours, tok, info = load_gguf(path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    ids = torch.randint(0, tok.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    assert logits(ours, ids).abs().max() > 0.1  # not a degenerate model
    torch.testing.assert_close(logits(ours, ids), logits(hf, ids), rtol=0, atol=1e-5)
    torch.testing.assert_close(logits(ours, ids), logits(theirs, ids), rtol=0, atol=1e-5)
    assert info.architecture == arch and ours.config.rope_layout == "rotate_half" or arch == "gpt2"
    assert not ours.training and tok.vocab_size == ours.config.num_tokens
    assert (tok.eos_id, tok.bos_id, tok.add_bos_token) == (2, 1, False)  # the file's ids, not a guess


def test_permutation_undone_is_what_makes_llama_right(tiny_gguf, monkeypatch):
    from decoderlab.gguf import llama

    path, hf = tiny_gguf("llama")
    ids = torch.arange(12).reshape(1, 12)
    monkeypatch.setattr(llama, "unpermute", lambda rows, n_head: rows)  # as written: interleaved rows
    wrong, _, _ = load_gguf(path)
    assert (logits(wrong, ids) - logits(hf, ids)).abs().max() > 1e-3
    wrong.config.rope_layout = "interleaved"  # ...which llama.cpp's own interleaved rope reads right
    for module in wrong.modules():
        if hasattr(module, "layout"):
            module.layout = "interleaved"
    torch.testing.assert_close(logits(wrong, ids), logits(hf, ids), rtol=0, atol=1e-5)
    monkeypatch.undo()
    right, _, _ = load_gguf(path)
    torch.testing.assert_close(logits(right, ids), logits(hf, ids), rtol=0, atol=1e-5)


def test_dtype_and_report(tiny_gguf):
    path, _ = tiny_gguf("qwen2", "Q8_0")
    model, _, info = load_gguf(path, dtype="bfloat16")
    assert model.we.weight.dtype == torch.bfloat16
    r = info.report
    assert r.types["Q8_0"] > 0 and r.types["F32"] > 0 and r.float_bytes > r.file_bytes > 0
    assert "dequantized" in str(r) and "Q8_0" in str(r) and "MB of float32" in str(r)
    # what is held is bfloat16: said after the float32 the dequantizer wrote
    assert f"all then cast to bfloat16 ({r.float_bytes / 2e6:.1f} MB of matrices)" in str(r)
    assert r.to_dict()["cast"] == "bfloat16" and load_gguf(path, dtype="float32")[2].report.cast is None
    with pytest.raises(ValueError, match="unknown dtype"):
        load_gguf(path, dtype="float8")
    assert "quantized to" not in str(r)


def test_a_type_not_kept_as_blocks_is_said_once_on_the_read_line(tiny_gguf):
    """A block dtype asked of a file whose matrices are another type (here F16 at q8_0): the matrices are
    dequantized and then quantized to the asked type, and the one read line says both."""
    from decoderlab.quant import block_dtype

    path, _ = tiny_gguf("llama", "F16")
    model, _, info = load_gguf(path, dtype="q8_0")
    assert block_dtype(model) == "q8_0" and info.report.requantized == "q8_0"
    assert str(info.report).count("then quantized to q8_0") == 1 and "(" in str(info.report) and "F16" in str(info.report)
    path, _ = tiny_gguf("llama", "Q4_1")
    model, _, info = load_gguf(path, dtype="q4_1")  # the file's own blocks: nothing requantized
    assert info.report.requantized is None and "kept" in str(info.report) and "quantized to" not in str(info.report)
    path, _ = tiny_gguf("llama")  # float32 matrices: said too
    model, _, info = load_gguf(path, dtype="q4_0")
    assert info.report.requantized == "q4_0" and str(info.report).count("the matrices then quantized to q4_0") == 1


def test_is_gguf_file(tmp_path):
    assert is_gguf_file(tmp_path / "m.gguf") and is_gguf_file("x.GGUF") and not is_gguf_file(tmp_path)
    (tmp_path / "d.gguf").mkdir()
    assert not is_gguf_file(tmp_path / "d.gguf")


@pytest.mark.slow
def test_real_file_logits_equal_transformers(smollm_path, shared_dir):
    ours, tok, info = load_gguf(smollm_path, dtype="float32")  # transformers dequantizes too (the default keeps
    assert info.report.types == {"Q4_1": 210, "F32": 61, "Q8_0": 1}  # the blocks: bench/llamacpp.py compares those)
    text = (shared_dir / "data" / "tinystories_val_slice.txt").read_text(encoding="utf-8")[:4000]
    ids = torch.tensor([tok.encode(text)[:256]])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(smollm_path.parent),
                                                               gguf_file=smollm_path.name).eval()
    torch.testing.assert_close(logits(ours, ids), logits(theirs, ids), rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_1"), ("qwen2", "Q8_0"), ("gpt2", "Q4_0")])
def test_block_dtype_keeps_the_file_s_blocks(tiny_gguf, arch, qtype):
    """--dtype of the file's own type (q8_0 / q4_0 / q4_1): its Q8_0 / Q4_0 / Q4_1 matrices kept as they are, no
    float copy; in float64 the same logits as the dequantized float model (float32: the kernels' 8-bit
    activations, within their rounding)."""
    from decoderlab.quant import BlockEmbedding, BlockLinear

    path, _ = tiny_gguf(arch, qtype)
    floats, tok, _ = load_gguf(path, dtype="float32")
    blocks, _, info = load_gguf(path, dtype=qtype.lower())
    assert isinstance(blocks.blocks[0].attention.qkv, BlockLinear) and isinstance(blocks.we, BlockEmbedding)
    assert {m.kind for m in blocks.modules() if isinstance(m, BlockLinear)} == {qtype.lower()}
    n_layer = blocks.config.n_layer
    assert info.report.kept[qtype] == 1 + n_layer * (4 if arch == "gpt2" else 7)  # token_embd + the matrices
    assert info.report.requantized is None  # (gpt2's position table is dequantized: no linear layer)
    ids = torch.randint(0, tok.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    want = logits(floats, ids)
    assert torch.allclose(logits(blocks, ids), want, rtol=0, atol=0.05 * float(want.abs().max()))
    torch.testing.assert_close(logits(blocks.double(), ids), logits(floats.double(), ids), rtol=0, atol=1e-9)


@pytest.mark.parametrize("arch,qtype,asked", [("llama", "Q4_1", "q8_0"), ("qwen2", "Q8_0", "q4_0"),
                                              ("gpt2", "Q4_0", "q4_1")])
def test_a_block_dtype_of_another_type_is_requantized_and_said(tiny_gguf, arch, qtype, asked):
    """--dtype q8_0 of a Q4_1 file (and the like): every matrix is then q8_0, quantized from the file's weights
    dequantized -- the model equals the float model quantized to q8_0 --, its dtype is q8_0, and the read line
    says the file's blocks were dequantized and quantized to q8_0; none of the file's blocks is kept."""
    from decoderlab.dtypes import model_dtype, to_inference_dtype
    from decoderlab.quant import BlockLinear

    path, _ = tiny_gguf(arch, qtype)
    model, tok, info = load_gguf(path, dtype=asked)
    assert {m.kind for m in model.modules() if isinstance(m, BlockLinear)} == {asked} and model_dtype(model) == asked
    assert not info.report.kept and info.report.types[qtype] > 0 and info.report.requantized == asked
    line = str(info.report)
    assert qtype in line.split("dequantized")[1] and line.count(f"the matrices then quantized to {asked}") == 1
    floats = to_inference_dtype(load_gguf(path, dtype="float32")[0], asked)
    assert model.state_dict().keys() == floats.state_dict().keys()
    assert all(torch.equal(a, floats.state_dict()[k]) for k, a in model.state_dict().items())
    ids = torch.randint(0, tok.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits(model, ids), logits(floats, ids))


def test_block_dtype_quantizes_float_matrices_to_the_kind_asked(tiny_gguf):
    from decoderlab.quant import BlockLinear

    path, _ = tiny_gguf("llama", "F16")
    model, _, info = load_gguf(path, dtype="q8_0")
    assert not info.report.kept and {m.kind for m in model.modules() if isinstance(m, BlockLinear)} == {"q8_0"}


def test_the_default_keeps_the_file_s_own_types_and_says_so(tiny_gguf):
    """No dtype (--dtype auto): every matrix of a type the kernels multiply is kept in its blocks -- q | k | v of
    different types as three weights of one layer --, the model holds about the file's bytes, the read line
    starts "weights as in the file"; its logits are within the activations' 8-bit rounding (the kernels') of the
    dequantized float32 model's, and in float64 that model's."""
    from decoderlab.quant import BlockEmbedding, BlockLinear

    path, _ = tiny_gguf("llama", "Q5_0", types={"blk.0.attn_v.weight": "Q8_0", "blk.1.ffn_down.weight": "Q4_1"})
    model, tok, info = load_gguf(path)
    floats, _, _ = load_gguf(path, dtype="float32")
    assert model.blocks[0].attention.qkv.kinds == ("q5_0", "q5_0", "q8_0")
    assert model.blocks[1].mlp.proj.kinds == ("q4_1",) and isinstance(model.we, BlockEmbedding)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    line = str(info.report)
    assert info.report.own and line.startswith("weights as in the file: q5_0 (") and "q8_0 (1)" in line
    assert "dequantized" not in line and info.report.requantized is None
    held = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
    assert sum(held.values()) <= 1.3 * path.stat().st_size
    ids = torch.randint(0, tok.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    got, want = logits(model, ids), logits(floats, ids)
    assert not torch.equal(got, want) and torch.allclose(got, want, rtol=0, atol=0.05 * float(want.abs().max()))
    torch.testing.assert_close(logits(model.double(), ids), logits(floats.double(), ids), rtol=0, atol=1e-9)
    assert {type(m) for m in model.modules()} >= {BlockLinear, BlockEmbedding}


def test_a_16_bit_file_keeps_its_matrices_in_16_bits_by_default_and_says_so(tiny_gguf):
    """F16 matrices: kept in 16 bits by default (decoderlab.half: float32 activations), norms float32; the same
    logits as the file read as float32 (an F16 weight multiplies float32 activations, widened exactly)."""
    from decoderlab.half import HalfLinear

    path, _ = tiny_gguf("llama", "F16")
    model, _, info = load_gguf(path)
    fc = model.blocks[0].mlp.fc
    assert type(fc) is HalfLinear and fc.weight.dtype == torch.float16 and info.report.own_float is None
    assert model.blocks[0].norm_1.weight.dtype == torch.float32
    assert str(info.report).startswith("weights as in the file: f16 (")
    floats, _, _ = load_gguf(path, dtype="float32")
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits(model, ids), logits(floats, ids), rtol=0, atol=1e-5)


def test_a_k_quant_dtype_the_file_does_not_hold_is_refused_naming_the_file_s_types(tiny_gguf):
    path, _ = tiny_gguf("llama", "Q4_1")
    with pytest.raises(ValueError, match=r"--dtype q4_k needs every matrix in q4_k blocks, and this file's are F32, "
                                         r"Q4_1: q4_k has no quantizer here .* use --dtype auto"):
        load_gguf(path, dtype="q4_k")


@pytest.mark.parametrize("enabled", [True, False])
def test_reading_a_file_pauses_the_garbage_collector_and_leaves_it_as_it_was(tiny_gguf, monkeypatch, enabled):
    """The cyclic collector is off while the file is read (its millions of small objects would start pass after
    pass), and as the caller had it afterwards -- also when the read fails."""
    import gc

    from decoderlab.gguf import loader

    seen = []
    real = loader._tokenizer
    monkeypatch.setattr(loader, "_tokenizer", lambda *a: (seen.append(gc.isenabled()), real(*a))[1])
    (gc.enable if enabled else gc.disable)()
    try:
        load_gguf(tiny_gguf("llama")[0])
        assert seen == [False] and gc.isenabled() is enabled
        with pytest.raises(ValueError):
            monkeypatch.setattr(loader, "_tokenizer", lambda *a: (_ for _ in ()).throw(ValueError("broken")))
            load_gguf(tiny_gguf("llama")[0])
        assert gc.isenabled() is enabled
    finally:
        gc.enable()
