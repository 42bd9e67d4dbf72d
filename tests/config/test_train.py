"""TrainConfig (decoderlab.config.train): bad values and refused combinations, each a ValueError naming the field
and what is allowed, before anything trains."""

import re

import pytest

from decoderlab.config import TrainConfig


def test_bad_train_config_values():
    with pytest.raises(ValueError, match="max_steps must be an integer >= 1, got 0"):
        TrainConfig(max_steps=0)
    with pytest.raises(ValueError, match=r"lr \(learning rate\) must be a finite number > 0, got -0.001"):
        TrainConfig(lr=-1e-3)
    with pytest.raises(ValueError, match="precision must be one of auto, 32, bf16-mixed, 16-mixed, got '16'"):
        TrainConfig(precision="16")
    with pytest.raises(ValueError, match="min_lr must be between 0 and lr"):
        TrainConfig(lr=1e-4, min_lr=1e-3)


@pytest.mark.parametrize("kw, message", [
    (dict(fused=True, precision="bf16-mixed"), "fused=True cannot be combined with precision='bf16-mixed' and "
                                               "grad_clip=1.0"),
    (dict(compile=""), "compile must be True, False or a torch.compile backend name"),
])
def test_combinations_refused_before_training(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(**kw)
