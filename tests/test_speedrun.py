"""Issue 12 (CPU speedrun): the new architecture options (qk_norm, mlp="relu2", zero_init), their float64
``verify`` exactness, the optimizer options of ``TrainConfig`` (Muon groups, schedules, subset evaluation) and
the intra-op thread choice."""

import pytest
import torch

import decoderlab as dl
from decoderlab.model import ModelConfig

TINY = dict(num_tokens=23, d_model=32, n_layer=2, n_head=4, max_len=12)


def _model(**cfg):
    torch.manual_seed(0)
    return dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", **{**TINY, **cfg})).eval()


# ---------------------------------------------------------------------------------------------------------
# architecture options
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("opts", [dict(qk_norm=True), dict(mlp="relu2"), dict(zero_init=True),
                                  dict(position="rope", mlp="relu2", qk_norm=True, zero_init=True, tie_weights=False)])
def test_new_options_shapes_and_batched_equals_unbatched(opts):
    m = _model(**opts)
    ids = torch.randint(0, 23, (3, 12), generator=torch.Generator().manual_seed(1))
    out = m(ids)
    assert out.shape == (3, 12, 23)
    torch.testing.assert_close(m(ids[1]), out[1], rtol=1e-5, atol=1e-5)


def test_qk_norm_normalises_each_heads_queries_and_keys():
    m = _model(qk_norm=True)
    att = m.blocks[0].attention
    att.record = {}
    m(torch.arange(12))
    q, k = att.record["q"], att.record["k"]  # (B, H, T, d_head), after the norm (learned positions: no rope); 1 up to eps
    att.record = None
    torch.testing.assert_close(q.pow(2).mean(-1), torch.ones(q.shape[:-1]), rtol=0, atol=5e-3)
    torch.testing.assert_close(k.pow(2).mean(-1), torch.ones(k.shape[:-1]), rtol=0, atol=5e-3)
    # and it changes the function (the option is not a no-op)
    plain = _model()
    assert not torch.allclose(plain(torch.arange(12)), m(torch.arange(12)))


def test_relu2_mlp_is_relu_squared():
    m = _model(mlp="relu2")
    mlp = m.blocks[0].mlp
    x = torch.randn(5, 32)
    torch.testing.assert_close(mlp(x), mlp.proj(torch.relu(mlp.fc(x)) ** 2))


def test_zero_init_makes_every_block_the_identity_at_start():
    m = _model(zero_init=True)
    for b in m.blocks:
        assert b.attention.proj.weight.abs().sum() == 0 and b.mlp.proj.weight.abs().sum() == 0
        x = torch.randn(2, 5, 32)
        torch.testing.assert_close(b(x), x)
    # gradients still flow into the zeroed projections (they are trained, not frozen)
    m.train()
    m(torch.arange(12)).sum().backward()
    assert m.blocks[0].mlp.proj.weight.grad.abs().sum() > 0


def test_defaults_leave_the_existing_presets_unchanged():
    for name in ("statquest", "baby-shakespeare", "shakespeare-char", "gpt2"):
        cfg = dl.preset(name)
        assert (cfg.qk_norm, cfg.zero_init) == (False, False)
        assert cfg.mlp in ("none", "gelu")


@pytest.mark.parametrize("field,value", [("qk_norm", 1), ("zero_init", "yes"), ("mlp", "relu")])
def test_bad_option_values_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{**TINY, field: value})


def test_config_json_round_trip_keeps_the_new_fields():
    cfg = dl.preset("baby-shakespeare", qk_norm=True, mlp="relu2", zero_init=True)
    assert ModelConfig.from_json(cfg.to_json()) == cfg


def test_gpt2_export_refuses_options_it_cannot_express():
    from decoderlab.hf import model_config_to_gpt2_config

    for opts, field in ((dict(qk_norm=True), "qk_norm"), (dict(mlp="relu2"), "mlp")):
        with pytest.raises(ValueError, match=field):
            model_config_to_gpt2_config(dl.preset("baby-shakespeare", **opts))


# ---------------------------------------------------------------------------------------------------------
# verify: the float64 NumPy reference covers each new option
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("opts", [dict(qk_norm=True), dict(mlp="relu2"),
                                  dict(position="rope", qk_norm=True, mlp="relu2", norm="rmsnorm"),
                                  dict(position="rope", qk_norm=True, mlp="relu2", tie_weights=False)])
def test_verify_is_exact_for_the_new_options(opts):
    m = _model(**opts)
    with torch.no_grad():  # non-zero output projections, so every step carries signal
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = torch.randint(0, 23, (2, 9), generator=torch.Generator().manual_seed(2))
    rep = dl.verify(m, ids)
    assert rep.ok, rep.table()
    assert rep.max_abs_diff < 1e-4


@pytest.mark.parametrize("field", ["qk_norm", "mlp"])
def test_verify_fails_when_the_module_disagrees_with_the_config(field):
    """The reference follows the config: a model computing without the option is caught (the check can fail)."""
    m = _model(qk_norm=True, mlp="relu2")
    if field == "qk_norm":
        for b in m.blocks:
            b.attention.qk_norm = False
        first_bad = "layer 0 q"
    else:
        for b in m.blocks:
            b.mlp.relu2 = False
        first_bad = "layer 0 mlp out"
    rep = dl.verify(m, torch.arange(9))
    assert not rep.ok
    assert [s.name for s in rep.steps if not s.ok][0] == first_bad
