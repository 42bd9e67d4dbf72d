"""Training recipes (a model preset with its ``TrainConfig``): the data lives in
:mod:`decoderlab.config.recipes`; this module re-exports it for ``decoderlab.training`` users."""

from __future__ import annotations

from ..config.recipes import DEFAULT_RECIPE, RECIPES, Recipe, resolve

__all__ = ["DEFAULT_RECIPE", "RECIPES", "Recipe", "resolve"]
