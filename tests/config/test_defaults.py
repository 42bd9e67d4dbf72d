"""The plain-data floor of the config (decoderlab.config.defaults, .names, .presets, .recipes): readable
without building a class, and the one definition the dataclasses take their defaults from."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import decoderlab.config as config


def test_the_plain_modules_import_no_dataclasses():
    code = ("import sys\nfrom decoderlab.config import defaults, names, presets, recipes\n"
            "from decoderlab.config import TRAIN_DEFAULTS, PRESETS, RECIPES, TRAIN_CHOICES, EXAMPLES\n"
            "print(' '.join(m for m in ('dataclasses', 'inspect', 'json', 'typing', 'torch') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout) == (0, "\n"), r.stderr


def test_every_public_name_resolves():
    for name in config.__all__:
        assert getattr(config, name) is not None, name
    assert set(config.__all__) <= set(dir(config))


def test_the_dataclasses_take_their_defaults_from_the_plain_data():
    assert {f.name: f.default for f in dataclasses.fields(config.TrainConfig)} == config.TRAIN_DEFAULTS
    assert {f.name: f.default for f in dataclasses.fields(config.ServeLimits)} == config.SERVE_LIMITS
    assert config.SERVE_LIMIT_DEFAULTS == {k: config.SERVE_LIMITS[k] for k in config.SERVE_LIMIT_HELP}
    assert config.TrainConfig(**config.FINETUNE_TRAIN).max_steps == config.FINETUNE_TRAIN["max_steps"]


def test_the_presets_field_defaults_are_model_configs():
    """--help lists a preset's value of each shape flag without building a class: a field a preset leaves out
    shows FIELD_DEFAULTS' value, which must be ModelConfig's own."""
    from decoderlab.config.model import ModelConfig
    from decoderlab.config.presets import FIELD_DEFAULTS

    assert FIELD_DEFAULTS == {k: getattr(ModelConfig(), k) for k in FIELD_DEFAULTS}
