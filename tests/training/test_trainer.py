"""The Lightning Trainer of a run (decoderlab.training.trainer): its logging cadence, and every combination of
precision, clipping, compile and accumulation training (train_lm's runs: tests/training/test_lm.py)."""

import math

import pytest

from decoderlab.training import TrainConfig

# the tiny language-model runs (one_thread: an autouse fixture)
from tiny_runs import cache, one_thread, run, text, tiny_config  # noqa: F401,E402


def test_short_runs_log_their_train_loss():
    from decoderlab.training import make_trainer

    trainer = make_trainer(TrainConfig(max_steps=4, warmup=1), progress_bar="plain", logger=False)
    assert trainer.log_every_n_steps == 4  # log_every 50 would log nothing in a 4-step run


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_every_combination_of_precision_clipping_compile_accumulation_trains(precision, tmp_path, text, cache):
    import itertools

    for grad_clip, compile, accumulate in itertools.product([0.0, 1.0], [False, "eager"], [1, 2]):
        cfg = tiny_config(max_steps=1, eval_every=1, val_batches=1, precision=precision, grad_clip=grad_clip,
                          compile=compile, accumulate=accumulate)
        _, _, s = run(text, tmp_path / f"{grad_clip}-{compile}-{accumulate}", cache, cfg, logger=False)
        assert s.steps == 1 and math.isfinite(s.train_loss) and math.isfinite(s.val_loss), cfg
