"""Host-device syncs in training, counted (on the CPU, where they cost nothing but are the same calls that
stall a GPU): a steady training step makes none, a logging step a bounded few. And the counter itself."""

import pytest
import torch
from support.host_syncs import HostSyncCounter, step_syncs_callback

from decoderlab.training import TrainConfig, train_lm

SHAPE = dict(d_model=16, n_layer=1, n_head=2, max_len=16)
#: host syncs a logging step may make: the step losses and the non-finite check copied once each, and what
#: Lightning reads back to log them
LOGGING_STEP_BUDGET = 4


def test_the_counter_counts_each_kind_of_sync_and_names_the_line():
    x = torch.arange(6.0)
    with HostSyncCounter() as c:
        x.sum().item()
        x.tolist()
        bool(x[0] == 0)
        int(x[1])
        float(x[2])
        x.nonzero()
        x[x > 2]
        y = x.clone()
        y[y > 4] = 0
        (x * 2 + 1).exp()  # no sync
    kinds = [e.kind for e in c.events]
    assert kinds == ["item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "boolean indexing",
                     "boolean index_put"]
    assert all(e.where.name.endswith("test_the_counter_counts_each_kind_of_sync_and_names_the_line")
               for e in c.events)
    assert len(HostSyncCounter()) == 0


@pytest.mark.parametrize("progress_bar", ["plain", True])
def test_a_steady_training_step_makes_no_host_sync(progress_bar, shared_dir, tmp_path, capsys):
    """Steps 1 and 3 are steady; 2 logs (log_every 2); 4 logs, validates and writes the checkpoints."""
    torch.set_num_threads(1)
    text = (shared_dir / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:12000]
    cfg = TrainConfig(max_steps=4, batch_size=4, warmup=1, eval_every=4, val_batches=2, val_batch_size=8,
                      log_every=2, grad_clip=1.0)
    counter = HostSyncCounter()
    with counter:
        train_lm(text=text, out=tmp_path / "run", train_config=cfg, model_overrides=SHAPE,
                 cache_dir=tmp_path / "cache", progress_bar=progress_bar, accelerator="cpu", logger=False,
                 callbacks=[step_syncs_callback(counter)])
    per_step = counter.by_tag()
    for step in (1, 3):
        assert per_step[step] == 0, f"step {step} waited for the device:\n{counter.report(step)}"
    assert 1 <= per_step[2] <= LOGGING_STEP_BUDGET, counter.report(2)
    # the last step also validates and writes two checkpoints (Lightning compares and names them)
    assert per_step[4] <= LOGGING_STEP_BUDGET + 4, counter.report(4)


def test_the_forward_checks_ids_on_the_host_unless_the_caller_did():
    """The public forward keeps its error for bad ids (it reads the smallest and largest id: 2 syncs);
    training and evaluation, whose ids were checked where they came from, skip it (0 syncs)."""
    import numpy as np

    from decoderlab.model import DecoderOnlyTransformer, preset
    from decoderlab.training.evaluation import evaluation_sums

    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=30, **SHAPE)).eval()
    ids = torch.randint(0, 30, (2, 8), generator=torch.Generator().manual_seed(0))
    with HostSyncCounter() as checked:
        expected = model(ids)
    with HostSyncCounter() as unchecked:
        got = model(ids, check_ids=False)
        model.compute_loss((ids, ids), check_ids=False)
    assert [e.kind for e in checked.events] == ["__int__", "__int__"] and len(unchecked) == 0
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"token id 30 is out of range; allowed ids are 0 .. 29"):
        model(torch.tensor([[1, 30]]))
    with pytest.raises(ValueError, match=r"token id 30 is out of range; allowed ids are 0 .. 29"):
        model.compute_loss((torch.tensor([[1, 30]]), torch.tensor([[1, 2]])))
    tokens = np.arange(40) % 30
    tokens[25] = 31
    with pytest.raises(ValueError, match=r"token id 31 is out of range; allowed ids are 0 .. 29"):
        evaluation_sums(model, tokens, max_len=8, batch_size=2)
