"""Training recipes: a model preset together with the ``TrainConfig`` it is trained with, as plain data.

``decoderlab train`` runs ``DEFAULT_RECIPE``; ``--preset NAME`` takes a recipe name or a plain model preset
(which is trained with ``TrainConfig()``'s defaults, the nanoGPT baseline). The recipes:

* ``baby-shakespeare-nanogpt``: nanoGPT's CPU "baby" run -- the ``baby-shakespeare`` preset (GPT-2 blocks,
  learned positions, tied embeddings), AdamW lr 1e-3 betas (0.9, 0.99), warm-up 100, cosine to 1e-4 over
  2,000 steps of 12 x 64 tokens. Full validation loss about 1.90 after 2,000 steps.
* ``baby-shakespeare-speedrun`` (the default): the same size (4 layers, 4 heads, d_model 128, context 64)
  with rotary positions, QK-norm, ReLU² MLP and zero-initialised output projections, trained with Muon for
  the hidden matrices and AdamW for the rest, for far fewer steps; evaluation on a fixed subset while
  training and on all windows at the end. See docs/training.md ("Recipes and presets") for what each change bought.
"""

from __future__ import annotations

from collections import namedtuple

from .defaults import FINETUNE_TRAIN, LESSON_FINETUNE, SCRATCH_FIELDS, TRAIN_DEFAULTS
from .presets import PRESETS


class Recipe(namedtuple("Recipe", "preset train description", defaults=("",))):
    """A model preset name and the ``TrainConfig`` fields that differ from ``TrainConfig()``'s defaults, as
    plain data (a named tuple: the command line's ``--help`` reads recipes without importing dataclasses)."""

    __slots__ = ()

    def train_config(self):
        """The recipe's ``TrainConfig`` (validated)."""
        from .train import TrainConfig

        return TrainConfig(**self.train)


RECIPES: dict[str, Recipe] = {
    "baby-shakespeare-nanogpt": Recipe(
        "baby-shakespeare", {},
        "nanoGPT's CPU baby recipe: GPT-2 blocks, AdamW 1e-3, cosine over 2,000 steps"),
    "baby-shakespeare-speedrun": Recipe(
        "baby-shakespeare-speedrun",
        dict(max_steps=450, batch_size=12, optimizer="muon", muon_lr=0.05, lr=3e-3, min_lr=3e-4, warmup=50,
             schedule="cosine", eval_every=150, val_batches=4, val_batch_size=64, full_val_at_end=True,
             log_every=50),
        "rope + QK-norm + ReLU² + zero-init projections, Muon + AdamW, 450 steps"),
}

DEFAULT_RECIPE = "baby-shakespeare-speedrun"


def resolve(name: str) -> tuple[str, TrainConfig | None]:  # noqa: F821 (TrainConfig: imported when called)
    """``(model preset name, TrainConfig or None)`` for a recipe name or a plain model preset name.

    Raises:
        ValueError: neither a recipe nor a model preset, listing both.
    """
    if name in RECIPES:
        r = RECIPES[name]
        return r.preset, r.train_config()
    if name in PRESETS:
        return name, None
    raise ValueError(f"unknown preset {name!r}; recipes: {', '.join(RECIPES)}; model presets: {', '.join(PRESETS)}")


def _model_size(name: str) -> int:
    shape = PRESETS[RECIPES[name].preset if name in RECIPES else name]
    return shape["n_layer"] * shape["d_model"]


#: what ``decoderlab train --preset`` takes: every model preset and recipe, the smallest model first (a
#: recipe after the presets of its size)
TRAIN_CHOICES = tuple(sorted([*PRESETS, *(r for r in RECIPES if r not in PRESETS)], key=_model_size))


def recipe_of(preset: str) -> Recipe | None:
    """The recipe that trains the model preset ``preset`` (``baby-shakespeare`` -> nanoGPT's), or None."""
    return next((r for r in RECIPES.values() if r.preset == preset), None)


def finetune_defaults(preset: str | None = None, template: str | None = None) -> dict:
    """The ``TrainConfig`` fields ``decoderlab.finetune`` starts from when no ``train_config`` is given.

    From a base checkpoint: ``FINETUNE_TRAIN`` (a short run at a low learning rate). From scratch (``preset``):
    the same, but with the optimizer settings (``SCRATCH_FIELDS``) of the preset's training recipe
    (:func:`recipe_of`; ``TrainConfig``'s defaults for a preset no recipe trains). With the ``lesson`` template
    or the ``statquest`` preset: the lesson's optimizer, ``LESSON_FINETUNE``.
    """
    out = dict(FINETUNE_TRAIN)
    if template == "lesson" or preset == "statquest":
        out.update(LESSON_FINETUNE)
    elif preset is not None:
        recipe = recipe_of(preset)
        train = {**TRAIN_DEFAULTS, **(recipe.train if recipe is not None else {})}
        out.update({k: train[k] for k in SCRATCH_FIELDS})
    return out
