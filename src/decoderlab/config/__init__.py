"""decoderlab's configuration floor: every setting, default, preset, recipe, limit and name as plain data.

This package imports no torch and nothing else of decoderlab, so the command line's ``--help`` and
anything that only reads settings stay light; the model, training, serving and the CLI import their values
from here (one definition each).

    names     the choices: positions, norms, MLPs, kernels, tokenizers, templates, dtypes, precisions,
              optimizers, schedules
    model     ModelConfig, PRESETS, preset()
    train     TrainConfig, check_train_seed, FINETUNE_TRAIN, FINETUNE_VAL_FRACTION, PAIR_TRAIN
    recipes   Recipe, RECIPES, DEFAULT_RECIPE, resolve()
    limits    ServeLimits, DEFAULT_MAX_NEW_TOKENS
    rl        RLConfig, REWARDS, END_OF_TURN_BONUS, DPO_BETA, LORA_TARGETS (the stages after fine-tuning)
"""

from __future__ import annotations

from .limits import DEFAULT_MAX_NEW_TOKENS, SERVE_LIMIT_DEFAULTS, SERVE_LIMIT_HELP, ServeLimits
from .model import PRESETS, ModelConfig, preset
from .names import (DEFAULT_BPE_VOCAB_SIZE, DEFAULT_TEMPLATE, DEFAULT_TOKENIZER, DTYPES, INITS, KERNELS, MLPS, NORMS,
                    OPTIMIZERS, POSITIONS, PRECISION_ALIASES, PRECISIONS, SCHEDULES, TEMPLATES, TOKENIZERS)
from .recipes import DEFAULT_RECIPE, RECIPES, Recipe, resolve
from .rl import (DEFAULT_LORA_TARGETS, DEFAULT_REWARD, DPO_BETA, END_OF_TURN_BONUS, LORA_TARGETS, REWARDS,
                 RLConfig)
from .train import FINETUNE_TRAIN, FINETUNE_VAL_FRACTION, MAX_TRAIN_SEED, PAIR_TRAIN, TrainConfig, check_train_seed

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS", "SERVE_LIMIT_DEFAULTS", "SERVE_LIMIT_HELP", "ServeLimits",
    "PRESETS", "ModelConfig", "preset",
    "DEFAULT_BPE_VOCAB_SIZE", "DEFAULT_TEMPLATE", "DEFAULT_TOKENIZER", "DTYPES", "INITS", "KERNELS", "MLPS", "NORMS",
    "OPTIMIZERS", "POSITIONS", "PRECISION_ALIASES", "PRECISIONS", "SCHEDULES", "TEMPLATES", "TOKENIZERS",
    "DEFAULT_RECIPE", "RECIPES", "Recipe", "resolve",
    "FINETUNE_TRAIN", "FINETUNE_VAL_FRACTION", "MAX_TRAIN_SEED", "PAIR_TRAIN", "TrainConfig", "check_train_seed",
    "DEFAULT_LORA_TARGETS", "DEFAULT_REWARD", "DPO_BETA", "END_OF_TURN_BONUS", "LORA_TARGETS", "REWARDS", "RLConfig",
]
