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
