"""``verify``: the whole forward pass recomputed in float64 NumPy, step by step."""

import numpy as np
import pytest
import torch

import decoderlab as dl
from decoderlab import glassbox as gb
from decoderlab.cli import main as cli_main

from .models import SMALL, VARIANT_CONFIGS, VARIANTS, small_model, variant_ids, variant_model


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", list(SMALL))
def test_verify_agrees_to_1e5_on_every_preset_family(name, variant):
    m = small_model(name, variant)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, m.config.num_tokens, (2, min(9, m.config.max_len)), generator=gen)
    rep = dl.verify(m, ids)
    assert rep.ok, rep.table()
    names = [s.name for s in rep.steps]
    assert names[0] == "word embeddings" and names[-1] == "logits"
    assert "layer 0 percents" in names and "layer 0 sims Q K^T" in names
    # a model without norms (the lesson's) lists no norm steps: "final norm" would be a copy
    assert ("final norm" in names) == ("layer 0 norm_1" in names) == (m.config.norm != "none")
    assert (m.config.mlp == "gelu") == ("layer 0 mlp out" in names)
    # absolute agreement too, for these untrained models: float32 vs float64
    assert rep.max_abs_diff < 1e-4
    assert rep.step("logits").shape == (2, ids.size(1), m.config.num_tokens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_model_is_checked_on_its_weights_in_float32_and_its_drift_said(dtype):
    """``--dtype bfloat16``: the arithmetic on the 16-bit weights passes at float32's tolerance (the 16-bit pass
    alone fails it: its rounding is the format's, not a fault), the note gives that pass's drift, and the model
    itself is left in its dtype."""
    m = small_model("baby-shakespeare")
    ids = torch.arange(12) % m.config.num_tokens
    m.to(dtype)
    rep = dl.verify(m, ids)
    assert rep.ok and not rep.overflow, rep.table()
    assert rep.dtype == str(dtype).removeprefix("torch.")
    assert f"the pass here in float32; the {rep.dtype} pass drifts from float64 by up to" in rep.note
    assert next(m.parameters()).dtype == dtype
    drift = float(rep.note.split("by up to ")[1].split(" ")[0])
    assert 1e-5 < drift < 0.1  # the rounding is there, and it is the format's size


def test_a_float16_pass_that_overflows_fails_naming_the_step():
    m = small_model("baby-shakespeare")
    ids = torch.arange(12) % m.config.num_tokens
    with torch.no_grad():
        m.blocks[0].attention.proj.weight.mul_(1.5e6)  # weights under 65,504 (float16's largest), outputs past it
    m.to(torch.float16)
    rep = dl.verify(m, ids)
    assert all(s.ok for s in rep.steps)  # the float32 arithmetic on these weights is right
    assert not rep.ok and rep.overflow.startswith("layer 0"), rep.note
    assert f"overflows on this text (at {rep.overflow})" in rep.note
    assert rep.table().splitlines()[-2].endswith(f"all ok in float32, but the float16 pass overflows at {rep.overflow}")


def test_verify_catches_a_wrong_step():
    """A model whose attention output is off by 1e-3 fails at exactly that step (the check can fail)."""
    m = small_model("baby-shakespeare")
    ids = torch.arange(10) % m.config.num_tokens
    h = m.blocks[1].attention.register_forward_hook(lambda mod, args, out: out + 1e-3)
    try:
        rep = dl.verify(m, ids)
    finally:
        h.remove()
    assert not rep.ok
    bad = [s.name for s in rep.steps if not s.ok]
    assert bad[0] == "layer 1 attention out"
    assert "layer 0 residual 2" not in bad and "layer 1 percents" not in bad
    assert "FAIL" in rep.table()


def test_verify_cli_on_the_trained_checkpoint(statquest_checkpoint, capsys):
    assert cli_main(["verify", "--checkpoint", str(statquest_checkpoint), "what is statquest <EOS> awesome"]) == 0
    out = capsys.readouterr().out
    assert "layer 0 percents" in out and "all ok" in out
    assert cli_main(["verify", "--checkpoint", str(statquest_checkpoint), "what is statquest", "--tol", "1e-14"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_cli_verify_lists_no_norm_steps_without_norms(statquest_checkpoint, decoderlab_cli):
    r = decoderlab_cli("verify", "--checkpoint", statquest_checkpoint, "what is statquest <EOS>")
    assert (r.returncode, r.stderr) == (0, "")
    steps = [ln.split()[0] + " " + ln.split()[1] for ln in r.stdout.splitlines()[2:-1]]
    assert "norm" not in r.stdout
    assert r.stdout.splitlines()[-1] == (f"{len(steps)} steps, float32 model vs float64 NumPy, tolerance 1e-05 "
                                         "(x max(1, max |ref|)): all ok")



@pytest.mark.parametrize("variant", list(VARIANT_CONFIGS))
def test_numpy_recomputes_what_each_head_writes(variant):
    """The float64 NumPy reference's head outputs (percents @ V through each head's columns of the output
    projection) are the cache's, for every variant."""
    m = variant_model(variant)
    ids = variant_ids(m)
    cache = gb.run_with_cache(m, ids)[1]
    ref = gb.numpy_head_results(m, ids)
    assert len(ref) == m.config.n_layer
    for i, heads in enumerate(ref):
        ours = cache.head_results(i).numpy()
        assert heads.shape == ours.shape == (*ids.shape, m.config.n_head, m.config.d_model)
        assert np.abs(heads - ours).max() < 1e-12


LLAMA_VARIANTS = ["llama-gqa-swiglu", "qwen-mqa-biases-gains", "gemma-sliding-sandwich"]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)], ids=["float32", "float64"])
@pytest.mark.parametrize("variant", LLAMA_VARIANTS)
def test_verify_recomputes_the_llama_family(variant, dtype, tol):
    """Grouped-query attention, SwiGLU, rotate-half rope with its base, q/k/v biases and the QK-norm's gains --
    and Gemma's sliding window, second rope base, sandwich norms, GeGLU, scaled embedding and attention scale --
    recomputed in float64 NumPy: every step agrees (float64 to 1e-12, with the rope tables made in float64)."""
    m = variant_model(variant, dtype=dtype)
    rep = dl.verify(m, variant_ids(m), tol=tol)
    assert rep.ok, rep.table()
    cfg = m.config
    assert rep.step("layer 0 k").shape == (2, cfg.n_head, 9, cfg.d_head)  # each query head's keys
    assert rep.step("layer 0 head out").shape == (2, cfg.n_head, 9, cfg.d_head)
    if cfg.sliding_window:  # the sliding layer's mask hides the keys W or more positions back: the window matters
        assert rep.step("layer 0 mask").max_abs_ref == 1 and cfg.sliding_window < 9


def _perturbed(key: str, rows=slice(None)):
    """A stand-in for the reference's weights: the model's, with ``key``'s ``rows`` moved by 1e-2."""
    from decoderlab.glassbox import reference

    real = reference._np_weights

    def weights(model):
        w = real(model)
        w[key] = w[key].copy()
        w[key][rows] += 1e-2
        return w
    return weights


@pytest.mark.parametrize("key,rows,first", [
    ("blocks.0.attention.q_norm.weight", slice(None), "layer 0 q"),
    ("blocks.0.attention.k_norm.weight", slice(None), "layer 0 k"),
    ("blocks.0.attention.qkv.bias", slice(24, 30), "layer 0 k"),  # the key head's bias (after 4 query heads of 6)
    ("blocks.0.attention.qkv.bias", slice(30, 36), "layer 0 v"),  # the value head's
    ("blocks.1.mlp.gate.weight", slice(None), "layer 1 mlp out"),
    ("blocks.1.mlp.fc.weight", slice(None), "layer 1 mlp out"),
])
def test_verify_fails_where_a_llama_weight_differs(monkeypatch, key, rows, first):
    """The reference reads each of the Llama family's weights itself: one moved by 1e-2 in its copy fails verify
    at the first step that weight makes, and not before."""
    from decoderlab.glassbox import reference

    m = variant_model("qwen-mqa-biases-gains", dtype=torch.float32)
    ids = variant_ids(m)
    monkeypatch.setattr(reference, "_np_weights", _perturbed(key, rows))
    rep = dl.verify(m, ids)
    bad = [s.name for s in rep.steps if not s.ok]
    assert bad and bad[0] == first, rep.table()
    names = [s.name for s in rep.steps]
    assert all(s.ok for s in rep.steps[: names.index(first)])


@pytest.mark.parametrize("change,first", [
    ("theta", "layer 0 q"), ("layout", "layer 0 q"), ("groups", "layer 0 k"),
])
def test_verify_fails_on_a_model_with_another_rope_or_grouping(monkeypatch, change, first):
    """A model that turns by another rope base, pairs its rope in the other layout, or gives the query heads the
    wrong key/value heads (repeat instead of repeat_interleave) fails verify: the reference recomputes each."""
    m = variant_model("llama-gqa-swiglu", dtype=torch.float32)
    rope = m.blocks[0].attention.rope
    if change == "theta":
        rope.base = 2 * rope.base
        rope.cos, rope.sin = rope._table()
    elif change == "layout":
        monkeypatch.setattr(rope, "layout", "interleaved")
    else:
        for block in m.blocks:
            attn = block.attention
            monkeypatch.setattr(attn, "expand_kv", lambda t, g=attn.group: t.repeat(1, g, 1, 1))
    rep = dl.verify(m, variant_ids(m))
    bad = [s.name for s in rep.steps if not s.ok]
    assert bad and bad[0] == first, rep.table()


@pytest.mark.slow
def test_verify_passes_on_a_smollm2_135m_shaped_model():
    """SmolLM2-135M's shape (30 layers, d_model 576, 9 query and 3 key/value heads, SwiGLU 1536, vocabulary
    49,152, rope base 100000 rotate-half, tied; random weights): the whole pass recomputed in float64 agrees to 1e-5
    (about 5-10 s on one thread, bench/generate.py --shape smollm2-135m)."""
    torch.manual_seed(0)
    m = dl.DecoderOnlyTransformer("smollm2-135m").eval()
    ids = torch.randint(0, m.config.num_tokens, (1, 8), generator=torch.Generator().manual_seed(1))
    rep = dl.verify(m, ids)
    assert rep.ok, rep.table()
    assert len(rep.steps) == 2 + 30 * 14 + 2 and rep.step("logits").shape == (1, 8, 49152)


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
def test_verify_recomputes_a_block_quantized_model_from_its_dequantized_weights(kind):
    """GGUF's block types change the weights, not the arithmetic: the float64 reference takes the dequantized
    values and every step agrees at float32's tolerance; the report names the block type."""
    from decoderlab.quant import quantize_model

    from .models import _BASE

    torch.manual_seed(0)
    spec = {**_BASE, **VARIANT_CONFIGS["llama-gqa-swiglu"], "d_model": 32, "d_ff": 64}
    m = quantize_model(dl.DecoderOnlyTransformer(dl.ModelConfig(**spec)).eval(), kind)
    rep = dl.verify(m, variant_ids(m), tol=1e-5)
    assert rep.ok and rep.dtype == kind, rep
