"""decoderlab's configuration floor: every setting, default, preset, recipe, limit and name as plain data.

This package imports no torch and nothing else of decoderlab, so the command line's ``--help`` and
anything that only reads settings stay light; the model, training, serving and the CLI import their values
from here (one definition each).

    names     the choices: positions, norms, MLPs, kernels, tokenizers, templates, dtypes, precisions,
              optimizers, schedules, worked examples
    defaults  every default as plain data: TrainConfig's, fine-tuning's, the lesson's, generation's,
              serving's, the glass box's
    presets   PRESETS (ModelConfig fields by preset name)
    settings  Settings: the one to_dict / from_dict / replace of the dataclasses below
    recipes   Recipe, RECIPES, DEFAULT_RECIPE, TRAIN_CHOICES, resolve(), finetune_defaults()
    model     ModelConfig, preset()
    train     TrainConfig, check_train_seed
    limits    ServeLimits
    rl        RLConfig (the stages after fine-tuning; their names and defaults in names and defaults)

The names below load their module on first use (PEP 562): ``names``, ``defaults``, ``presets`` and
``recipes`` import no dataclasses, so ``decoderlab --help`` reads them for about a millisecond.
"""

from __future__ import annotations

import importlib

#: public name -> the submodule that defines it
_EXPORTS = {
    **dict.fromkeys(("DEFAULT_MAX_NEW_TOKENS", "DEFAULT_TEMPERATURE", "EXPLAIN_TOP_K", "FINETUNE_EVAL_PROMPTS",
                     "FINETUNE_TRAIN", "FINETUNE_VAL_FRACTION", "LESSON_FINETUNE", "PAIR_TRAIN", "RL_TRAIN",
                     "SCRATCH_FIELDS", "SERVE_HOST", "SERVE_LIMITS",
                     "SERVE_LIMIT_DEFAULTS", "SERVE_LIMIT_HELP", "SERVE_PORT", "SERVE_PREFILL_CHUNK_HELP", "TRAIN_DEFAULTS", "VERIFY_TOL"),
                    "defaults"),
    **dict.fromkeys(("DEFAULT_BPE_VOCAB_SIZE", "DEFAULT_TEMPLATE", "DEFAULT_TOKENIZER", "DTYPES", "EXAMPLES",
                     "FINETUNE_METHODS",
                     "HEAD_DETECTORS", "INITS", "KERNELS", "MLPS", "NORMS", "OPTIMIZERS", "OWN_STRATEGIES",
                     "PATCH_AXES", "PATCH_POINTS", "POSITIONS", "PRECISION_ALIASES", "PRECISIONS",
                     "ROPE_LAYOUTS", "SCHEDULES", "TEMPLATES", "TOKENIZERS"), "names"),
    "PRESETS": "presets",
    **dict.fromkeys(("DEFAULT_RECIPE", "RECIPES", "Recipe", "TRAIN_CHOICES", "finetune_defaults", "recipe_of",
                    "resolve"), "recipes"),
    "ModelConfig": "model", "preset": "model",
    **dict.fromkeys(("MAX_TRAIN_SEED", "TrainConfig", "check_train_seed"), "train"),
    "ServeLimits": "limits",
    **dict.fromkeys(("DEFAULT_LORA_TARGETS", "DEFAULT_REWARD", "LORA_TARGETS", "REWARDS"), "names"),
    **dict.fromkeys(("DPO_BETA", "END_OF_TURN_BONUS", "RL_DEFAULTS"), "defaults"),
    "RLConfig": "rl", "Settings": "settings",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # next time a plain attribute
        return value
    raise AttributeError(f"module 'decoderlab.config' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
