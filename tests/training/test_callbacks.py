"""The Lightning checkpoints of a run (decoderlab.training.callbacks.RunCheckpoint): best-step{N}.ckpt and last.ckpt
were two identical full copies whenever the last evaluation was the best (a LoRA fine-tune of a 98 MB model kept two
565 MB ones); now they are one file under two names then, and two files holding their own steps otherwise."""

from __future__ import annotations

import os

import torch
from tiny_runs import one_thread  # noqa: F401  (an autouse fixture)

from decoderlab.model import DecoderOnlyTransformer, preset
from decoderlab.training import LitModel, TrainConfig, make_trainer

#: the val_loss each evaluation reports, by step: 2 is the best, 4 is not, 6 is the best again
VAL_LOSS = {2: 1.0, 4: 2.0, 6: 0.5}


class Scripted(LitModel):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", VAL_LOSS[self.trainer.global_step], on_epoch=True, batch_size=1)


def fit_until(run_dir, stop: int, ckpt_path=None):
    torch.manual_seed(0)
    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=12, d_model=16, n_layer=1, n_head=2,
                                          max_len=8))
    cfg = TrainConfig(max_steps=stop, batch_size=2, lr=1e-3, warmup=0, eval_every=2, log_every=1)
    batches = [(x[:, :-1], x[:, 1:]) for x in torch.randint(0, 12, (8, 2, 9))]
    data = torch.utils.data.DataLoader(batches, batch_size=None)
    trainer = make_trainer(cfg, run_dir, accelerator="cpu", progress_bar=False, logger=False)
    trainer.fit(Scripted(model, cfg), train_dataloaders=data, val_dataloaders=data, ckpt_path=ckpt_path)


def step_of(path) -> int:
    return torch.load(path, weights_only=False)["global_step"]


def test_last_is_the_best_file_when_they_are_one_step_and_its_own_file_otherwise(tmp_path):
    ckpts = tmp_path / "lightning"
    fit_until(tmp_path, 2)
    assert sorted(p.name for p in ckpts.iterdir()) == ["best-step2.ckpt", "last.ckpt"]
    assert os.path.samefile(ckpts / "last.ckpt", ckpts / "best-step2.ckpt")  # one file, two names
    fit_until(tmp_path, 4, ckpt_path=ckpts / "last.ckpt")  # step 4 is worse: the best stays step 2's
    assert not os.path.samefile(ckpts / "last.ckpt", ckpts / "best-step2.ckpt")
    assert (step_of(ckpts / "last.ckpt"), step_of(ckpts / "best-step2.ckpt")) == (4, 2)  # neither written through
    fit_until(tmp_path, 6, ckpt_path=ckpts / "last.ckpt")  # step 6 is the best: one file again, the old best gone
    assert sorted(p.name for p in ckpts.iterdir()) == ["best-step6.ckpt", "last.ckpt"]
    assert os.path.samefile(ckpts / "last.ckpt", ckpts / "best-step6.ckpt") and step_of(ckpts / "last.ckpt") == 6
