"""The CPU speedrun: the architecture options (qk_norm, mlp="relu2", zero_init), their float64
``verify`` exactness, the optimizer options of ``TrainConfig`` (Muon groups, schedules, subset evaluation) and
the intra-op thread choice."""


import pytest
import torch

import decoderlab as dl
from decoderlab.glassbox import run_with_cache
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
    _, cache = run_with_cache(m, torch.arange(12), ["blocks.0.attn.hook_q_normed", "blocks.0.attn.hook_k_normed"])
    # (B, T, H, d_head), after the norm (learned positions: no rope); 1 up to eps
    q, k = cache["blocks.0.attn.hook_q_normed"], cache["blocks.0.attn.hook_k_normed"]
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


def test_hf_export_takes_the_speedrun_options_where_a_class_computes_them():
    from decoderlab.hf import export_family

    assert export_family(dl.preset("baby-shakespeare", mlp="relu2"))[1] == "GPT2LMHeadModel"  # relu2 activation
    assert export_family(dl.preset("baby-shakespeare-speedrun"))[1] == "ApertusForCausalLM"
    with pytest.raises(ValueError, match="qk_norm=True"):  # learned positions with a QK-norm: no class has both
        export_family(dl.preset("baby-shakespeare", qk_norm=True))


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


# ---------------------------------------------------------------------------------------------------------
# optimizer options
# ---------------------------------------------------------------------------------------------------------

from decoderlab.training import TrainConfig, configure_optimizers, lr_at, train_lm  # noqa: E402


@pytest.mark.parametrize("field,value,match", [
    ("optimizer", "sgd", "allowed: adamw, muon"), ("schedule", "linear", "allowed: cosine, wsd"),
    ("muon_lr", 0.0, "muon_lr"), ("muon_momentum", 1.0, "muon_momentum"), ("cooldown", 1.5, "cooldown"),
    ("full_val_at_end", "yes", "full_val_at_end"), ("full_val_below", "low", "full_val_below")])
def test_bad_train_options_are_named(field, value, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{field: value})


def test_recipes_resolve_and_the_nanogpt_recipe_is_the_old_default():
    from decoderlab.config.recipes import DEFAULT_RECIPE, RECIPES, resolve

    name, cfg = resolve("baby-shakespeare-nanogpt")
    assert name == "baby-shakespeare" and cfg == TrainConfig()
    name, cfg = resolve(DEFAULT_RECIPE)
    assert dl.preset(name).qk_norm and cfg.optimizer == "muon" and cfg.full_val_at_end
    assert resolve("gpt2") == ("gpt2", None)
    with pytest.raises(ValueError, match="recipes: .*baby-shakespeare-nanogpt"):
        resolve("nope")
    assert set(RECIPES) >= {"baby-shakespeare-nanogpt", "baby-shakespeare-speedrun"}


def test_train_lm_with_muon_subset_eval_and_full_eval_at_end(shared_dir, tmp_path):
    torch.set_num_threads(1)
    text = (shared_dir / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:12000]
    cfg = TrainConfig(max_steps=6, batch_size=4, warmup=2, eval_every=3, val_batches=1, val_batch_size=4,
                      log_every=1, optimizer="muon", full_val_at_end=True, full_val_below=100.0)
    model, tok, s = train_lm(text=text, out=tmp_path / "run", train_config=cfg, model_overrides={k: v for k, v in TINY.items() if k != "num_tokens"},
                             cache_dir=tmp_path / "cache", progress_bar=False, accelerator="cpu", logger=False)
    kinds = [(e["step"], e["windows"]) for e in s.eval_log]
    # subset at 3 and 6, each <= 100 so also all windows; the end reuses step 6's full evaluation
    assert kinds == [(3, "subset"), (3, "all"), (6, "subset"), (6, "all")]
    secs = [e["seconds"] for e in s.eval_log]
    assert secs == sorted(secs) and secs[0] > 0
    from decoderlab.data import split_tokens
    from decoderlab.training import evaluate_lm

    import numpy as np
    _, val = split_tokens(np.array(tok.encode(text)), 0.1)
    full = evaluate_lm(model, val, model.config.max_len, 4)
    assert s.val_loss == pytest.approx(full, rel=1e-6)
    assert s.eval_log[-1]["val_loss"] == pytest.approx(full, rel=1e-6)
    assert s.eval_log[-2]["val_loss"] != pytest.approx(full, rel=1e-9)  # the subset is not all windows


# ---------------------------------------------------------------------------------------------------------
# threads
# ---------------------------------------------------------------------------------------------------------

from decoderlab.threads import choose_threads  # noqa: E402


@pytest.mark.parametrize("cores,load,expected", [(2, 0.0, 2), (2, 0.4, 2), (2, 0.6, 1), (2, 2.0, 1), (2, 7.0, 1),
                                                 (1, 0.0, 1), (16, 0.0, 2), (16, 13.8, 2), (16, 14.6, 1)])
def test_choose_threads_from_cores_and_load(cores, load, expected):
    assert choose_threads(cores=cores, load=load) == expected


def test_requested_threads_win_and_bad_values_are_named():
    assert choose_threads(3, cores=2, load=5.0) == 3
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="threads must be a positive integer"):
            choose_threads(bad)


def test_cli_threads_option(capsys):
    from decoderlab.cli import main

    with pytest.raises(SystemExit) as e:  # refused by argparse, before anything is built
        main(["train", "--threads", "0"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "decoderlab: error: --threads must be >= 1, got 0 (see decoderlab train --help)\n"


def test_kv_cache_decoding_equals_the_no_cache_loop_for_the_speedrun_model():
    """qk_norm and relu2 in the cached decode path: the same tokens and the same logits as the lesson's loop."""
    from decoderlab.generation import KVCache, generate

    m = _model(position="rope", qk_norm=True, mlp="relu2", zero_init=False)
    prompt = [1, 5, 7]
    fast = generate(m, prompt, 8, temperature=0)
    slow = generate(m, prompt, 8, temperature=0, use_cache=False)
    assert fast == slow and len(fast) == 8
    ids = torch.tensor([prompt + fast])
    cache = KVCache.for_model(m)
    with torch.no_grad():
        steps = [m(ids[:, :3], cache=cache)] + [m(ids[:, t:t + 1], cache=cache) for t in range(3, ids.size(1))]
        torch.testing.assert_close(torch.cat(steps, dim=1), m(ids), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# in the package's training run: resume honours the Muon settings, the CLI's default is the recipe
# ---------------------------------------------------------------------------------------------------------

import json  # noqa: E402

import lightning as L  # noqa: E402

SHAPE = {k: v for k, v in TINY.items() if k != "num_tokens"}


class MuonLrs(L.Callback):
    """The Muon group's learning rate and momentum at each optimizer step (0-based)."""

    def __init__(self):
        self.seen = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        g = trainer.optimizers[0].muon.param_groups[0]
        self.seen[trainer.global_step] = (g["lr"], g["momentum"])


def _muon_run(text, out, cache, **kw):
    torch.set_num_threads(1)
    return train_lm(text=text, out=out, model_overrides=SHAPE, cache_dir=cache, progress_bar=False,
                    accelerator="cpu", logger=False, **kw)


def test_resume_honours_changed_muon_settings_and_refuses_another_optimizer(shared_dir, tmp_path):
    text = (shared_dir / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:6000]
    cfg = TrainConfig(max_steps=3, batch_size=2, warmup=1, eval_every=3, val_batches=1, val_batch_size=2,
                      log_every=1, optimizer="muon", muon_lr=0.02)
    out, cache = tmp_path / "run", tmp_path / "cache"
    _muon_run(text, out, cache, train_config=cfg)
    rec = MuonLrs()
    _, _, s = _muon_run(text, None, cache, resume=out, config_overrides={"max_steps": 5, "muon_lr": 0.04,
                                                                         "muon_momentum": 0.9}, callbacks=[rec])
    new = cfg.replace(max_steps=5, muon_lr=0.04, muon_momentum=0.9)
    assert s.steps == 5 and sorted(rec.seen) == [3, 4]
    for k in (3, 4):
        assert rec.seen[k] == (pytest.approx(0.04 * lr_at(k, new) / new.lr), 0.9)
    assert json.loads((out / "run.json").read_text())["resumes"][-1]["changed"]["muon_lr"] == [0.02, 0.04]
    with pytest.raises(ValueError, match=r"optimizer='adamw': the run was trained with optimizer='muon'"):
        _muon_run(text, None, cache, resume=out, config_overrides={"max_steps": 6, "optimizer": "adamw"})


def test_cli_train_defaults_to_the_speedrun_recipe(shared_dir, tmp_path, monkeypatch):
    """`decoderlab train` (no --preset): the recipe's model and settings, a full evaluation at the end."""
    from decoderlab.cli import main

    monkeypatch.setenv("DECODERLAB_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    # 1,200 validation tokens: 74 windows of 16, so the subset (--val-batches 1 = 64 windows) is not all of them
    corpus.write_text((shared_dir / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:12000],
                      encoding="utf-8")
    out = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--out", str(out), "--max-steps", "2", "--eval-every", "2",
                 "--val-batches", "1", "--batch-size", "2", "--n-layer", "1", "--n-head", "2", "--d-model", "16",
                 "--max-len", "16", "--no-progress-bar", "--threads", "1"]) == 0
    assert torch.get_num_threads() == 1
    run = json.loads((out / "run.json").read_text())
    assert run["preset"] == "baby-shakespeare-speedrun"
    assert {k: run["train_config"][k] for k in ("optimizer", "lr", "min_lr", "full_val_at_end", "val_batches")} == \
        dict(optimizer="muon", lr=3e-3, min_lr=3e-4, full_val_at_end=True, val_batches=1)
    config = json.loads((out / "config.json").read_text())
    assert (config["position"], config["qk_norm"], config["mlp"], config["zero_init"], config["d_model"]) == \
        ("rope", True, "relu2", True, 16)
    summary = json.loads((out / "summary.json").read_text())
    assert [(e["step"], e["windows"]) for e in summary["eval_log"]] == [(2, "subset"), (2, "all")]
    assert summary["val_loss"] == summary["eval_log"][-1]["val_loss"] != summary["eval_log"][0]["val_loss"]
