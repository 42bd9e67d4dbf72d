"""Language-model training's pieces: optimizer groups, schedule, config values, batches and validation windows
(over processes too), the trainer, and option combinations (train_lm's runs: tests/training/test_lm.py; the run
directory: tests/training/test_run.py; `decoderlab train`: tests/cli/test_train.py)."""

import math
import re

import numpy as np
import pytest
import torch

from decoderlab.data import RandomWindowBatches, SequentialWindows, window_offsets
from decoderlab.model import DecoderOnlyTransformer, preset
from decoderlab.training import (TokenDataModule, TrainConfig, configure_optimizers, lr_at, parameter_groups,
                                 train_lm)

# the tiny language-model runs shared with tests/training (one_thread: an autouse fixture)
from tiny_runs import TINY, cache, one_thread, run, text, tiny_config  # noqa: F401,E402


# ---------------------------------------------------------------------------------------------------------
# optimizer and schedule
# ---------------------------------------------------------------------------------------------------------


def test_weight_decay_on_matrices_only():
    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=11, bias=True, **TINY))
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
    untied = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=11, tie_weights=False, **TINY))
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
    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=11, **TINY))
    conf = configure_optimizers(model, cfg)
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    seen = []
    for _ in range(111):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_at(s, cfg) for s in range(111)])


def test_bad_train_config_values():
    with pytest.raises(ValueError, match="max_steps must be an integer >= 1, got 0"):
        TrainConfig(max_steps=0)
    with pytest.raises(ValueError, match=r"lr \(learning rate\) must be a finite number > 0, got -0.001"):
        TrainConfig(lr=-1e-3)
    with pytest.raises(ValueError, match="precision must be one of auto, 32, bf16-mixed, 16-mixed, got '16'"):
        TrainConfig(precision="16")
    with pytest.raises(ValueError, match="min_lr must be between 0 and lr"):
        TrainConfig(lr=1e-4, min_lr=1e-3)


# ---------------------------------------------------------------------------------------------------------
# batches
# ---------------------------------------------------------------------------------------------------------


def test_windows_are_shifted_deterministic_and_split_over_ranks(tmp_path):
    tokens = np.arange(5000, dtype=np.uint16)
    path = tmp_path / "tokens.u16"
    tokens.tofile(path)
    mm = np.memmap(path, dtype=np.uint16, mode="r")[100:4000]  # a view into the file, as split_tokens gives
    whole = RandomWindowBatches(mm, max_len=8, batch_size=6, seed=7)
    for k in (0, 1, 57):
        x, y = whole[k]
        assert x.dtype == torch.int64 and x.shape == (6, 8)
        assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y, x + 1)  # consecutive ids: targets shifted
        starts = window_offsets(7, k, 6, len(mm) - 8) + 100
        assert torch.equal(x[:, 0], torch.from_numpy(starts))
        # 2 ranks with batch 3 take the two halves of the same global batch
        halves = [RandomWindowBatches(mm, 8, 3, 7, rank=r, world_size=2)[k][0] for r in (0, 1)]
        assert torch.equal(torch.cat(halves), x)
    assert not torch.equal(whole[0][0], whole[1][0])
    assert torch.equal(RandomWindowBatches(mm, 8, 6, seed=8)[0][0], RandomWindowBatches(mm, 8, 6, seed=8)[0][0])
    # a pickled dataset (a DataLoader worker) re-opens the file instead of carrying the data
    import pickle

    blob = pickle.dumps(whole)
    assert len(blob) < 2000
    assert torch.equal(pickle.loads(blob)[57][0], whole[57][0])


def test_validation_windows_cover_the_split_once():
    val = torch.arange(1, 102)  # 101 tokens, max_len 10 -> 10 windows predicting tokens 2..101
    ds = SequentialWindows(val.numpy(), max_len=10, batch_size=4)
    xs, ys = zip(*(ds[j] for j in range(len(ds))))
    assert len(ds) == 3 and [len(x) for x in xs] == [4, 4, 2]
    assert torch.equal(torch.cat(xs).flatten(), val[:100]) and torch.equal(torch.cat(ys).flatten(), val[1:101])
    assert len(SequentialWindows(val.numpy(), 10, 4, max_batches=2)) == 2


def test_datamodule_resumes_where_it_stopped():
    tokens = np.arange(3000, dtype=np.int64)
    dm = TokenDataModule(tokens[:2500], tokens[2500:], max_len=8, batch_size=4, seed=3)
    it = iter(dm.train_dataloader())
    first = [next(it)[0] for _ in range(5)]
    dm2 = TokenDataModule(tokens[:2500], tokens[2500:], max_len=8, batch_size=4, seed=0)
    dm2.load_state_dict({"seed": 3, "batches_served": 3, "batch_size": 4, "max_len": 8})
    it2 = iter(dm2.train_dataloader())
    assert torch.equal(next(it2)[0], first[3]) and torch.equal(next(it2)[0], first[4])


@pytest.mark.parametrize("n_train, n_val", [(5, 100), (100, 5)])
def test_split_shorter_than_a_window(n_train, n_val):
    with pytest.raises(ValueError, match=rf"train {n_train}, validation {n_val} tokens"):
        TokenDataModule(np.zeros(n_train, np.int64), np.zeros(n_val, np.int64), max_len=8, batch_size=2)


# ---------------------------------------------------------------------------------------------------------
# the trainer, validation over processes, option combinations
# ---------------------------------------------------------------------------------------------------------

def test_short_runs_log_their_train_loss():
    from decoderlab.training import make_trainer

    trainer = make_trainer(TrainConfig(max_steps=4, warmup=1), progress_bar="plain", logger=False)
    assert trainer.log_every_n_steps == 4  # log_every 50 would log nothing in a 4-step run


def test_validation_windows_split_over_processes_like_one_process():
    tokens = np.arange(1000, dtype=np.int64)

    def targets(ds):
        return [int(t) for j in range(len(ds)) for t in ds[j][1].flatten()]

    for batch_size, max_batches in [(4, None), (4, 3), (1, None), (64, 1), (5, 2)]:
        whole = SequentialWindows(tokens, 10, batch_size, max_batches)
        for world in (2, 3, 5):
            parts = [SequentialWindows(tokens, 10, batch_size, max_batches, rank, world) for rank in range(world)]
            assert all(len(p) >= 1 for p in parts)
            assert all(len(x) <= batch_size for p in parts for j in range(len(p)) for x in [p[j][0]])
            assert sorted(t for p in parts for t in targets(p)) == targets(whole)
    with pytest.raises(ValueError, match="the validation set has 2 windows of max_len\\+1 = 11 tokens for 3 processes"):
        SequentialWindows(tokens, 10, batch_size=1, max_batches=2, rank=2, world_size=3)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_every_combination_of_precision_clipping_compile_accumulation_trains(precision, tmp_path, text, cache):
    import itertools

    for grad_clip, compile, accumulate in itertools.product([0.0, 1.0], [False, "eager"], [1, 2]):
        cfg = tiny_config(max_steps=1, eval_every=1, val_batches=1, precision=precision, grad_clip=grad_clip,
                          compile=compile, accumulate=accumulate)
        _, _, s = run(text, tmp_path / f"{grad_clip}-{compile}-{accumulate}", cache, cfg, logger=False)
        assert s.steps == 1 and math.isfinite(s.train_loss) and math.isfinite(s.val_loss), cfg


@pytest.mark.parametrize("kw, message", [
    (dict(fused=True, precision="bf16-mixed"), "fused=True cannot be combined with precision='bf16-mixed' and "
                                               "grad_clip=1.0"),
    (dict(compile=""), "compile must be True, False or a torch.compile backend name"),
])
def test_combinations_refused_before_training(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(**kw)


