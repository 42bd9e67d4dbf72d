"""HeadWatch: the Lightning callback that records head scores and the loss while a model trains."""

import lightning as L
import pytest
import torch

import decoderlab as dl
from decoderlab.glassbox.watching import read_records
from decoderlab.training import LitModel
from decoderlab.headwatch import HeadWatch


def _data(num_tokens, n=12, t=8):
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, num_tokens, (n, t + 1), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(seq[:, :-1], seq[:, 1:]), batch_size=2)


def test_head_watch_records_every_n_steps_with_the_mean_loss(tmp_path):
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", n_layer=2, d_model=16, n_head=2, max_len=16),
                                      lr=1e-3)
    watch = HeadWatch(tmp_path / "run", every=2)
    trainer = L.Trainer(max_steps=6, callbacks=[watch], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(LitModel(model), _data(model.config.num_tokens))
    records = read_records(tmp_path / "run")
    assert [r["step"] for r in records] == [0, 2, 4, 6]
    assert records[0]["loss"] is None and all(2.0 < r["loss"] < 6.0 for r in records[1:])
    for r in records:
        assert set(r["scores"]) == {"previous_token", "duplicate_token", "induction"}
        assert [len(row) for row in r["scores"]["induction"]] == [2, 2]
    assert model.training  # the scores were taken in eval mode, and the mode restored
    assert all(mod.hooks is None for mod in model.modules() if hasattr(mod, "hooks"))


def test_head_watch_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"every must be an integer >= 1 \(steps between records\), got 0"):
        HeadWatch(tmp_path, every=0)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", n_layer=1, d_model=16, n_head=2, max_len=16))
    watch = HeadWatch(tmp_path, probe=torch.tensor([[1, 99]]))
    trainer = L.Trainer(max_steps=1, callbacks=[watch], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    with pytest.raises(ValueError, match="token id 99 is out of range"):
        trainer.fit(LitModel(model), _data(model.config.num_tokens))
