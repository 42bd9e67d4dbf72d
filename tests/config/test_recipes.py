"""Recipes as plain data (decoderlab.config.recipes)."""

from __future__ import annotations

import pytest

from decoderlab.config import DEFAULT_RECIPE, PRESETS, RECIPES, TRAIN_CHOICES, Recipe, TrainConfig, resolve


def _shape(name: str) -> dict:
    return PRESETS[RECIPES[name].preset if name in RECIPES else name]


def test_train_choices_list_every_preset_and_recipe_smallest_model_first():
    assert sorted(TRAIN_CHOICES) == sorted(set(PRESETS) | set(RECIPES)) and len(set(TRAIN_CHOICES)) == len(TRAIN_CHOICES)
    sizes = [_shape(name)["n_layer"] * _shape(name)["d_model"] for name in TRAIN_CHOICES]
    assert sizes == sorted(sizes) and TRAIN_CHOICES[0] == "statquest" and TRAIN_CHOICES[-1] == "smollm2-135m"


def test_a_recipe_is_a_preset_and_its_train_config():
    r = RECIPES[DEFAULT_RECIPE]
    assert isinstance(r, Recipe) and r.preset in PRESETS
    cfg = r.train_config()
    assert isinstance(cfg, TrainConfig) and cfg.max_steps == r.train["max_steps"]
    assert resolve(DEFAULT_RECIPE) == (r.preset, cfg) and resolve("gpt2") == ("gpt2", None)
    assert Recipe("gpt2", {}).description == ""
    with pytest.raises(ValueError, match="unknown preset 'gpt3'; recipes: .*; model presets: "):
        resolve("gpt3")
