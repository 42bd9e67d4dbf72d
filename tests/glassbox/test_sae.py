"""Sparse autoencoders (decoderlab.glassbox.sae): the forward passes against float64 NumPy, unit-norm decoder
rows, a planted dictionary recovered, resampling, SAELens's files and the size and hook checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny_models import one_thread  # noqa: F401 -- autouse

import decoderlab as dl
from decoderlab.glassbox.sae import (SAE_CFG_FILE, SAE_WEIGHTS_FILE, SparseAutoencoder, check_sae_hook,
                                     check_sae_size, load_sae, read_log_sparsity, resample_dead, sae_hook,
                                     sae_hook_names, sae_losses)


def _perturbed(sae: SparseAutoencoder, seed: int = 1) -> SparseAutoencoder:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in sae.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return sae


def _numpy_forward(sae: SparseAutoencoder, x: np.ndarray):
    w_enc, b_enc = sae.W_enc.detach().double().numpy(), sae.b_enc.detach().double().numpy()
    w_dec, b_dec = sae.W_dec.detach().double().numpy(), sae.b_dec.detach().double().numpy()
    pre = (x - b_dec) @ w_enc + b_enc
    f = np.zeros_like(pre)
    for r in range(pre.shape[0]):
        if sae.k is None:
            f[r] = np.maximum(pre[r], 0.0)
        else:
            top = np.argsort(-pre[r], kind="stable")[:sae.k]
            f[r, top] = np.maximum(pre[r, top], 0.0)
    return f, f @ w_dec + b_dec


@pytest.mark.parametrize("k", [None, 1, 5, 48])
def test_forward_equals_a_float64_computation_by_hand(k):
    sae = _perturbed(SparseAutoencoder(12, 48, k, seed=3))
    x = torch.randn(40, 12, generator=torch.Generator().manual_seed(7))
    f_ref, x_hat_ref = _numpy_forward(sae, x.double().numpy())
    f = sae.encode(x)
    assert np.abs(f.detach().double().numpy() - f_ref).max() < 1e-5
    assert np.abs(sae(x).detach().double().numpy() - x_hat_ref).max() < 1e-5
    if k is not None:
        assert int((f > 0).sum(-1).max()) <= k
    # float64 SAE: equal to rounding
    sae64 = SparseAutoencoder(12, 48, k, seed=3, dtype=torch.float64)
    sae64.load_state_dict({n: p.double() for n, p in sae.state_dict().items()})
    assert np.abs(sae64(x.double()).detach().numpy() - x_hat_ref).max() < 1e-12


def test_decoder_rows_stay_unit_norm_after_a_step():
    sae = SparseAutoencoder(8, 32, 4, seed=0)
    opt = torch.optim.Adam(sae.parameters(), lr=0.05)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 3
    before = sae.W_dec.detach().clone()
    for _ in range(3):
        opt.zero_grad()
        sae_losses(sae, x)["loss"].backward()
        sae.remove_parallel_grad_()
        # the gradient left is orthogonal to every row
        assert float((sae.W_dec.grad * sae.W_dec.detach()).sum(1).abs().max()) < 1e-5
        opt.step()
        sae.normalize_decoder_()
        assert torch.allclose(sae.W_dec.norm(dim=1), torch.ones(32), atol=1e-6)
    assert not torch.allclose(before, sae.W_dec)  # it did move


def _planted(n: int, d_in: int, atoms: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    dictionary = torch.randn(atoms, d_in, generator=g)
    dictionary /= dictionary.norm(dim=1, keepdim=True)
    codes = torch.zeros(n, atoms)
    idx = torch.stack([torch.randperm(atoms, generator=g)[:k] for _ in range(n)])
    codes.scatter_(1, idx, 0.5 + torch.rand(n, k, generator=g))
    return codes @ dictionary, dictionary


@pytest.mark.parametrize("variant", ["topk", "l1"])
def test_a_planted_sparse_code_is_recovered(variant):
    d_in, atoms, k = 16, 24, 3
    x, dictionary = _planted(12000, d_in, atoms, k, seed=0)
    sae = SparseAutoencoder(d_in, 2 * atoms, k if variant == "topk" else None, seed=1)
    opt = torch.optim.Adam(sae.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(2)
    for step in range(1500):
        batch = x[torch.randint(0, x.size(0), (256,), generator=g)]
        opt.zero_grad()
        losses = sae_losses(sae, batch, l1_coefficient=0.3)
        losses["loss"].backward()
        sae.remove_parallel_grad_()
        opt.step()
        sae.normalize_decoder_()
        if step in (300, 700):  # dead latents back into use
            dead = sae.encode(x[:2048]).amax(0) == 0
            resample_dead(sae, batch, dead, seed=step)
    cos = dictionary @ sae.W_dec.detach().T  # (atoms, d_sae): each atom against every learned direction
    best = cos.max(dim=1).values
    assert float((best >= 0.95).float().mean()) >= 0.8, best


def test_resampling_revives_dead_features():
    sae = SparseAutoencoder(8, 16, None, seed=0)
    x = torch.randn(200, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sae.b_enc[:6] = -100.0  # six features that never fire
    dead = sae.encode(x).amax(0) == 0
    assert int(dead.sum()) == 6
    assert resample_dead(sae, x, dead, seed=0) == 6
    assert int((sae.encode(x).amax(0) == 0).sum()) < 6  # they fire again on the inputs they were drawn from
    assert torch.allclose(sae.W_dec.norm(dim=1), torch.ones(16), atol=1e-6)
    assert resample_dead(sae, x, torch.zeros(16, dtype=torch.bool)) == 0


def test_auxk_loss_is_zero_without_dead_features_and_positive_with():
    sae = SparseAutoencoder(8, 32, 2, seed=0)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 2
    assert float(sae_losses(sae, x, dead=torch.zeros(32, dtype=torch.bool))["auxk"]) == 0.0
    dead = torch.zeros(32, dtype=torch.bool)
    dead[10:20] = True
    assert float(sae_losses(sae, x, dead=dead)["auxk"]) > 0


@pytest.mark.parametrize("k", [None, 4])
def test_saelens_files_round_trip_through_our_reader(tmp_path, k):
    sae = _perturbed(SparseAutoencoder(8, 24, k, metadata={"hook_name": "blocks.0.hook_resid_post",
                                                          "model_name": "tiny", "context_size": 16}))
    sparsity = torch.linspace(-3, 0, 24)
    sae.save(tmp_path, log_sparsity=sparsity)
    cfg = json.loads((tmp_path / SAE_CFG_FILE).read_text())
    assert cfg["architecture"] == ("standard" if k is None else "topk") and cfg["d_in"] == 8 and cfg["d_sae"] == 24
    assert cfg["metadata"]["hook_name"] == "blocks.0.hook_resid_post" and cfg.get("k") == k
    back = load_sae(tmp_path)
    x = torch.randn(10, 8)
    assert torch.equal(back(x), sae(x)) and back.metadata["model_name"] == "tiny"
    assert torch.equal(read_log_sparsity(tmp_path), sparsity)
    (tmp_path / SAE_WEIGHTS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="sae_weights.safetensors"):
        load_sae(tmp_path)


def test_saelens_loads_our_files_and_computes_the_same(tmp_path):
    """SAELens's own loader opens the directory and encodes and decodes equal to ours (needs sae_lens, which
    pins transformer-lens < 4; run with it on the path: see docs/benchmarks.md)."""
    sae_lens = pytest.importorskip("sae_lens")
    for k in (None, 6):
        ours = _perturbed(SparseAutoencoder(16, 64, k, metadata={"hook_name": "blocks.1.hook_resid_post"}))
        ours.save(tmp_path / str(k))
        theirs = sae_lens.SAE.load_from_disk(str(tmp_path / str(k)))
        x = torch.randn(256, 16, generator=torch.Generator().manual_seed(0)) * 2
        assert float((theirs.encode(x) - ours.encode(x)).abs().max()) <= 1e-5
        assert float((theirs.decode(ours.encode(x)) - ours(x)).abs().max()) <= 1e-5
        assert float((theirs(x) - ours(x)).abs().max()) <= 1e-5


@pytest.mark.parametrize("width,k,msg", [
    (0, 32, "width must be a positive integer"), (-2, 32, "width must be a positive integer"),
    (8, 0, "k must be a positive integer"), (8, -1, "k must be a positive integer"),
    (1, 17, "k must be at most the number of features width x d_in = 1 x 16 = 16, got 17"),
    (2.5, 4, "width must be a positive integer")])
def test_bad_sizes_name_the_value_and_the_range(width, k, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        check_sae_size(16, width, k)


def test_sizes():
    assert check_sae_size(16, 8, 32) == (128, 32) and check_sae_size(16, 1, 16) == (16, 16)
    assert check_sae_size(16, 4, None) == (64, None)


def test_a_hook_the_model_lacks_lists_the_valid_names():
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", n_layer=2, d_model=16, n_head=2, max_len=8,
                                                num_tokens=10))
    names = sae_hook_names(model)
    assert "blocks.1.hook_resid_post" in names and "blocks.0.attn.hook_z" in names
    assert not any(n.endswith(("hook_pattern", "hook_attn_scores", "hook_scale", "hook_q")) for n in names)
    with pytest.raises(ValueError, match=r"'blocks.7.hook_resid_post' is not a hook point of this model; valid hooks: "
                                         r"hook_embed, .*blocks\.1\.hook_resid_post"):
        check_sae_hook(model, "blocks.7.hook_resid_post")
    with pytest.raises(ValueError, match="is not a point an SAE reads"):
        check_sae_hook(model, "blocks.0.attn.hook_pattern")


def _pre_6_cfg(sae: SparseAutoencoder, *, topk_as: str) -> dict:
    """The cfg.json SAELens wrote before 6.0 for ``sae``: the hook, layer and model at the top level, no
    ``metadata``; TopK as its own architecture ("topk") or, earlier, as "standard" with a topk activation."""
    cfg = {"d_in": sae.d_in, "d_sae": sae.d_sae, "dtype": "float32", "device": "cpu", "model_name": "tiny",
           "hook_name": "blocks.1.hook_resid_post", "hook_layer": 1, "hook_head_index": None,
           "activation_fn_str": "relu", "activation_fn_kwargs": {}, "apply_b_dec_to_input": True,
           "finetuning_scaling_factor": False, "sae_lens_training_version": "3.13.1", "prepend_bos": True,
           "dataset_path": "text", "context_size": 16, "normalize_activations": False, "architecture": "standard"}
    if sae.k is not None:
        cfg.update(activation_fn_kwargs={"k": sae.k},
                   **({"architecture": "topk"} if topk_as == "topk" else {"activation_fn_str": "topk"}))
    return cfg


@pytest.mark.parametrize("k, topk_as", [(None, ""), (4, "topk"), (4, "standard")])
def test_saelens_files_from_before_6_are_read(tmp_path, k, topk_as):
    """A cfg.json of SAELens < 6 (hook_name / hook_layer / model_name at the top level, no metadata) failed with
    "hook '' is not a hook point of this model": it is read as SAELens 6 reads it."""
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", n_layer=2, d_model=8, n_head=2, max_len=8,
                                                num_tokens=10))
    sae = _perturbed(SparseAutoencoder(8, 24, k))
    sae.save(tmp_path)
    (tmp_path / SAE_CFG_FILE).write_text(json.dumps(_pre_6_cfg(sae, topk_as=topk_as)))
    back = load_sae(tmp_path)
    assert back.k == k and back.metadata["hook_name"] == "blocks.1.hook_resid_post"
    assert back.metadata["model_name"] == "tiny" and back.metadata["context_size"] == 16
    assert check_sae_hook(model, back.metadata["hook_name"]) == "blocks.1.hook_resid_post"
    x = torch.randn(10, 8)
    assert torch.equal(back(x), sae(x))


@pytest.mark.parametrize("change, message", [
    ({"finetuning_scaling_factor": True}, "finetuning_scaling_factor"),
    ({"architecture": "jumprelu"}, "architecture 'jumprelu'"), ({"normalize_activations": True}, "normalize")])
def test_saelens_files_decoderlab_cannot_read_are_refused_naming_the_format(tmp_path, change, message):
    sae = SparseAutoencoder(8, 24, None)
    sae.save(tmp_path)
    cfg = {k: v for k, v in {**_pre_6_cfg(sae, topk_as=""), **change}.items() if v is not None}
    (tmp_path / SAE_CFG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message) as e:
        load_sae(tmp_path)
    assert "SAELens" in str(e.value) and "cfg.json" in str(e.value)


def test_an_sae_whose_files_name_no_hook_loads_and_a_reader_of_its_hook_is_told_so(tmp_path):
    """A hook given beside the SAE (Model.features) needs none in its files; the readers that take the hook from
    the files (decoderlab features, serve --sae) are told where SAELens keeps it, before and after 6."""
    sae = SparseAutoencoder(8, 24, None)
    sae.save(tmp_path)
    cfg = {k: v for k, v in _pre_6_cfg(sae, topk_as="").items() if k != "hook_name"}
    (tmp_path / SAE_CFG_FILE).write_text(json.dumps(cfg))
    back = load_sae(tmp_path)
    with pytest.raises(ValueError, match=r"cfg.json names no hook point: SAELens 6 keeps it as metadata.hook_name"):
        sae_hook(back, tmp_path)
    with pytest.raises(ValueError, match="the SAE names no hook point"):
        sae_hook(back)
