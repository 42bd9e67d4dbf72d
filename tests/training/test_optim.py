"""``decoderlab.training.optim``: Muon + AdamW as one optimizer (its groups, its step, its state in PyTorch's
standard format, under a gradient scaler), the parameter groups named before any wrapping (weight decay on
matrices only), and the schedules (warm-up, cosine, WSD)."""

import copy
from collections import defaultdict

import pytest
import torch

import decoderlab as dl
from decoderlab.model import DecoderOnlyTransformer, preset
from decoderlab.training import TrainConfig, configure_optimizers, lr_at
from decoderlab.training.optim import (MuonAdamW, group_names, muon_parameter_groups, parameter_groups,
                                      schedule_factor)
from tiny_runs import TINY as TINY_LM

TINY = dict(num_tokens=23, d_model=32, n_layer=2, n_head=4, max_len=12)


def _model(**cfg):
    torch.manual_seed(0)
    return dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", **{**TINY, **cfg})).eval()


@pytest.mark.parametrize("opts", [dict(), dict(tie_weights=False, bias=True), dict(position="rope", norm="rmsnorm")])
def test_every_parameter_is_in_exactly_one_group(opts):
    m = _model(**opts)
    muon, decay, no_decay = muon_parameter_groups(m)
    names = muon + decay + no_decay
    assert len(names) == len(set(names))
    params = dict(m.named_parameters())  # shared tensors listed once
    assert set(names) == set(params)
    assert all(params[n].dim() == 2 and n.startswith("blocks.") for n in muon)
    assert sorted(n.rsplit(".", 2)[-2] for n in muon if n.startswith("blocks.0.")) == ["fc", "proj", "proj", "qkv"]
    assert "we.weight" in no_decay  # embeddings (and the tied head) stay with AdamW, undecayed
    if not m.config.tie_weights:
        assert decay == ["fc_layer.weight"]
    opt = configure_optimizers(m, TrainConfig(optimizer="muon"))["optimizer"]
    in_groups = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(in_groups) == sorted(id(p) for p in params.values())


def test_muon_adamw_steps_both_and_the_schedule_scales_both():
    m = _model()
    cfg = TrainConfig(optimizer="muon", muon_lr=0.04, lr=2e-3, min_lr=2e-4, warmup=2, max_steps=10)
    conf = configure_optimizers(m, cfg)
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    assert isinstance(opt, MuonAdamW) and isinstance(opt.muon, torch.optim.Muon)
    assert isinstance(opt.adamw, torch.optim.AdamW)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    m.train()
    for step in range(3):
        assert opt.muon.param_groups[0]["lr"] == pytest.approx(0.04 * lr_at(step, cfg) / 2e-3)
        assert opt.adamw.param_groups[0]["lr"] == pytest.approx(lr_at(step, cfg))
        loss = m(torch.arange(12)[None]).logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    for n, p in m.named_parameters():
        assert not torch.equal(p, before[n]), n  # every parameter moved (zero-init off in this preset)
    # state round trip: a fresh optimizer loaded from the state continues identically
    state = opt.state_dict()
    assert set(state) == {"state", "param_groups"}  # PyTorch's standard format (what DDP and FSDP save)
    m2 = _model()
    m2.load_state_dict(m.state_dict())
    opt2 = configure_optimizers(m2, cfg)["optimizer"]
    opt2.load_state_dict(copy.deepcopy(state))  # torch shares the tensors of a loaded state otherwise
    for mm, oo in ((m, opt), (m2, opt2)):
        mm(torch.arange(12)[None]).logsumexp(-1).mean().backward()
        oo.step()
    for (n, p), p2 in zip(m.named_parameters(), m2.parameters()):
        torch.testing.assert_close(p, p2, rtol=0, atol=0)


def test_muon_rejects_non_matrices():
    with pytest.raises(ValueError, match="2-D"):
        MuonAdamW([torch.nn.Parameter(torch.zeros(3))], [])


def test_wsd_schedule():
    kw = dict(warmup=10, max_steps=100, lr=1.0, min_lr=0.1, schedule="wsd", cooldown=0.4)
    assert schedule_factor(0, **kw) == pytest.approx(0.1)
    assert schedule_factor(9, **kw) == pytest.approx(1.0)
    assert schedule_factor(59, **kw) == pytest.approx(1.0)  # flat until the last 40 steps
    assert schedule_factor(60, **kw) == pytest.approx(1.0)
    assert schedule_factor(80, **kw) == pytest.approx(0.55)  # half way down the line
    assert schedule_factor(100, **kw) == pytest.approx(0.1) and schedule_factor(500, **kw) == pytest.approx(0.1)
    cfg = TrainConfig(lr=2e-3, min_lr=2e-4, warmup=10, max_steps=100, schedule="wsd", cooldown=0.4)
    assert lr_at(80, cfg) == pytest.approx(2e-3 * 0.55)
    # the cosine of schedule_factor is lr_at's
    c = TrainConfig(lr=2e-3, min_lr=2e-4, warmup=10, max_steps=100)
    for s in (0, 5, 10, 37, 99, 100, 150):
        assert lr_at(s, c) == pytest.approx(2e-3 * schedule_factor(s, warmup=10, max_steps=100, lr=2e-3,
                                                                      min_lr=2e-4))


def _step(model, opt, seed=0, scaler=None):
    """One optimizer step on a fixed batch: the loss (a float)."""
    ids = torch.randint(0, 23, (2, 12), generator=torch.Generator().manual_seed(seed))
    loss = model(ids).logsumexp(-1).mean()
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _params_equal(a, b):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)


def test_muon_adamw_state_is_the_standard_format_one_state_for_both():
    m = _model()
    opt = configure_optimizers(m, TrainConfig(optimizer="muon"))["optimizer"]
    _step(m, opt)
    state = opt.state_dict()
    n_params = sum(len(g["params"]) for g in opt.param_groups)
    assert sorted(state["state"]) == list(range(n_params))  # every parameter's state, keyed by its index
    assert [g["params"] for g in state["param_groups"]] == \
        [list(range(a, a + len(g["params"]))) for a, g in zip(
            [sum(len(h["params"]) for h in opt.param_groups[:i]) for i in range(len(opt.param_groups))],
            opt.param_groups)]
    assert "momentum_buffer" in state["state"][0] and "exp_avg" in state["state"][n_params - 1]
    # the inner optimizers write into the one state and the one set of group dicts
    assert opt.muon.state is opt.state and opt.adamw.state is opt.state
    assert opt.muon.param_groups + opt.adamw.param_groups == opt.param_groups
    # a load shares them again
    m2 = _model()
    m2.load_state_dict(m.state_dict())
    opt2 = configure_optimizers(m2, TrainConfig(optimizer="muon"))["optimizer"]
    opt2.load_state_dict(copy.deepcopy(state))
    assert opt2.muon.state is opt2.state
    assert opt2.adamw.param_groups[0] is opt2.param_groups[len(opt2.muon.param_groups)]
    _step(m, opt, seed=1)
    _step(m2, opt2, seed=1)
    _params_equal(m, m2)


def test_muon_adamw_loads_the_state_of_checkpoints_written_before():
    """A run saved with the former {"muon", "adamw"} state resumes: the same next step."""
    m = _model()
    cfg = TrainConfig(optimizer="muon")
    opt = configure_optimizers(m, cfg)["optimizer"]
    _step(m, opt)
    legacy = {}
    for key, inner in (("muon", opt.muon), ("adamw", opt.adamw)):  # each inner optimizer's state alone
        own = {p for g in inner.param_groups for p in g["params"]}
        shared, inner.state = inner.state, defaultdict(dict, {p: v for p, v in opt.state.items() if p in own})
        legacy[key] = inner.state_dict()
        inner.state = shared
    assert set(legacy["muon"]) == {"state", "param_groups"}
    m2 = _model()
    m2.load_state_dict(m.state_dict())
    opt2 = configure_optimizers(m2, cfg)["optimizer"]
    opt2.load_state_dict(copy.deepcopy(legacy))
    assert opt2.muon.state is opt2.state and len(opt2.state) == len(opt.state)
    _step(m, opt, seed=1)
    _step(m2, opt2, seed=1)
    _params_equal(m, m2)
    with pytest.raises(ValueError, match="'adamw' missing"):
        opt2.load_state_dict({"muon": legacy["muon"]})


def test_a_gradient_scaler_steps_muon_adamw_as_without_one():
    """16-mixed's gradient scaler (here on the CPU, with float32 gradients) unscales the gradients of both
    inner optimizers before they step: the weights of the unscaled step."""
    cfg = TrainConfig(optimizer="muon", fused=False)
    a, b = _model(), _model()
    opt_a, opt_b = configure_optimizers(a, cfg)["optimizer"], configure_optimizers(b, cfg)["optimizer"]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for seed in range(2):
        assert _step(a, opt_a, seed) == _step(b, opt_b, seed, scaler=scaler)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)
    assert scaler.get_scale() == 2.0**10  # no step skipped


class Renamed(torch.nn.Module):
    """A wrapper that renames every parameter (as FSDP1's flat parameters do)."""

    def __init__(self, model):
        super().__init__()
        self.flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_groups_are_named_before_wrapping_and_looked_up_by_name(optimizer):
    m = _model(tie_weights=False)  # (an untied output layer: a decayed matrix outside the blocks)
    names = group_names(m, optimizer)
    assert names["decay"] and names["no_decay"] and (optimizer == "adamw" or names["muon"])
    wrapped = torch.nn.Module()
    wrapped.module = m  # a DDP-like wrapper: the same names under .module
    opt = configure_optimizers(wrapped, TrainConfig(optimizer=optimizer), names)["optimizer"]
    params = dict(m.named_parameters())
    in_groups = [[id(p) for p in g["params"]] for g in opt.param_groups]
    kinds = (["muon"] if optimizer == "muon" else []) + ["decay", "no_decay"]
    expected = [[id(params[n]) for n in names[k]] for k in kinds]
    assert in_groups == expected
    with pytest.raises(ValueError, match=r"changed names after the optimizer groups were chosen .*--strategy ddp or "
                                         r"fsdp"):
        configure_optimizers(Renamed(m), TrainConfig(optimizer=optimizer), names)


def test_fused_adamw_is_not_chosen_under_a_mixed_precision_with_clipping():
    from decoderlab.training.optim import use_fused_adamw

    for precision in ("bf16-mixed", "16-mixed"):
        assert not use_fused_adamw(TrainConfig(grad_clip=1.0), precision)
        assert not use_fused_adamw(TrainConfig(grad_clip=1.0, precision=precision))
    with pytest.raises(ValueError, match="fused=True cannot be combined with precision='16-mixed'"):
        TrainConfig(fused=True, precision="16-mixed")


def _legacy(state: dict, muon_groups: int = 1) -> dict:
    """PyTorch's standard MuonAdamW state written as the former {"muon", "adamw"} pair, each numbered alone."""
    out = {}
    for key, groups in (("muon", state["param_groups"][:muon_groups]), ("adamw", state["param_groups"][muon_groups:])):
        number = {i: k for k, i in enumerate(i for g in groups for i in g["params"])}
        out[key] = {"state": {number[i]: v for i, v in state["state"].items() if i in number},
                    "param_groups": [{**g, "params": [number[i] for i in g["params"]]} for g in groups]}
    return out


def test_a_run_saved_with_the_former_optimizer_state_resumes_as_the_uninterrupted_run(shared_dir, tmp_path):
    from decoderlab.training import train_lm

    torch.set_num_threads(1)
    text = (shared_dir / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:12000]
    shape = dict(d_model=16, n_layer=1, n_head=2, max_len=16)
    cfg = TrainConfig(max_steps=4, batch_size=2, warmup=1, eval_every=2, val_batches=1, val_batch_size=8,
                      log_every=1, optimizer="muon")
    kw = dict(text=text, model_overrides=shape, cache_dir=tmp_path / "cache", progress_bar=False,
              accelerator="cpu", logger=False)
    _, _, whole = train_lm(out=tmp_path / "whole", train_config=cfg, **kw)
    train_lm(out=tmp_path / "old", train_config=cfg.replace(max_steps=2), **kw)
    ckpt_path = tmp_path / "old" / "lightning" / "last.ckpt"
    ckpt = torch.load(ckpt_path, weights_only=False)
    ckpt["optimizer_states"] = [_legacy(s) for s in ckpt["optimizer_states"]]
    assert set(ckpt["optimizer_states"][0]) == {"muon", "adamw"}
    torch.save(ckpt, ckpt_path)
    kw.pop("model_overrides")
    _, _, resumed = train_lm(resume=tmp_path / "old", config_overrides={"max_steps": 4}, **kw)
    assert resumed.train_losses == pytest.approx(whole.train_losses, abs=1e-6)
    assert resumed.val_loss == pytest.approx(whole.val_loss, abs=1e-6)


def test_weight_decay_on_matrices_only():
    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=11, bias=True, **TINY_LM))
    decay, no_decay = parameter_groups(model)
    assert sorted(decay) == sorted(
        n for n in dict(model.named_parameters())
        if n.endswith((".qkv.weight", "attention.proj.weight", "mlp.fc.weight", "mlp.proj.weight"))
    )
    assert "we.weight" in no_decay and "pe.weight" in no_decay  # embeddings
    assert "fc_layer.weight" not in decay + no_decay  # tied to we.weight: counted once
    assert any(n.endswith("norm_1.weight") for n in no_decay) and any(n.endswith(".bias") for n in no_decay)
    opt = configure_optimizers(model, TrainConfig(weight_decay=0.1))["optimizer"]
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(p) for n, p in model.named_parameters() if n in decay}
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == model.num_parameters()
    # an untied output layer is a weight matrix like the others
    untied = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=11, tie_weights=False, **TINY_LM))
    assert "fc_layer.weight" in parameter_groups(untied)[0]


def test_schedule_warmup_peak_cosine_end():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup=10, max_steps=110)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(4, cfg) == pytest.approx(5e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)  # peak at the end of warm-up
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(5.5e-4)  # half way down the cosine
    assert lr_at(110, cfg) == pytest.approx(1e-4) and lr_at(500, cfg) == pytest.approx(1e-4)
    # the LambdaLR applies it after each optimizer step
    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=11, **TINY_LM))
    conf = configure_optimizers(model, cfg)
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    seen = []
    for _ in range(111):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_at(s, cfg) for s in range(111)])
