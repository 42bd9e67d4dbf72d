"""``decoderlab train`` (decoderlab.cli.train): the help shows the config's defaults, a closed output costs no
training state, an --out where no directory can be made is one line before any work."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from decoderlab import cli
from decoderlab.config import (DEFAULT_BPE_VOCAB_SIZE, DEFAULT_RECIPE, DEFAULT_TOKENIZER, MLPS, NORMS, OPTIMIZERS,
                               PAIR_TRAIN, POSITIONS, PRECISIONS, PRESETS, RECIPES, SCHEDULES, TOKENIZERS,
                               TRAIN_CHOICES, TRAIN_DEFAULTS)
from decoderlab.cli.errors import FIELD_FLAGS
from decoderlab.cli.options import SHAPE_FIELDS, TRAIN_CHOICE_OPTIONS, TRAIN_OPTIONS


def _train_parser():
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def _shown(value) -> str:
    return "all" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def test_train_help_shows_the_config_defaults():
    """Each TrainConfig flag's help shows the default recipe's value, and TrainConfig's where the recipe keeps
    it; the lesson's flags show PAIR_TRAIN's; the choices are the config's names."""
    p = _train_parser()
    actions = {a.dest: a for a in p._actions}
    recipe = RECIPES[DEFAULT_RECIPE].train
    for _, field, _, _ in (*TRAIN_OPTIONS, *TRAIN_CHOICE_OPTIONS):
        text = actions[field].help
        base = "never" if field == "full_val_below" else _shown(TRAIN_DEFAULTS[field])
        if field in recipe and recipe[field] != TRAIN_DEFAULTS[field]:
            assert f"(default {_shown(recipe[field])}; {base} with a plain model preset" in text, field
        else:
            assert f"(default {base}" in text, field
        if field in PAIR_TRAIN:
            assert text.endswith(f"; statquest {PAIR_TRAIN[field]:g})"), field
    assert actions["epochs"].help.endswith(f"(default {PAIR_TRAIN['max_epochs']})")
    assert actions["seed"].help.endswith(f"(default {TRAIN_DEFAULTS['seed']})")
    assert actions["preset"].choices == TRAIN_CHOICES and set(TRAIN_CHOICES) == set(PRESETS) | set(RECIPES)
    assert actions["preset"].help.endswith(f"(default {DEFAULT_RECIPE})")
    assert (actions["tokenizer"].choices, actions["optimizer"].choices, actions["schedule"].choices,
            actions["precision"].choices) == (TOKENIZERS, OPTIMIZERS, SCHEDULES, PRECISIONS)
    assert actions["tokenizer"].help.endswith(f"(default {DEFAULT_TOKENIZER})")
    assert f"(default {DEFAULT_BPE_VOCAB_SIZE};" in actions["vocab_size"].help
    assert (actions["position"].choices, actions["norm"].choices, actions["mlp"].choices) == (POSITIONS, NORMS, MLPS)
    for field in SHAPE_FIELDS:
        for name, shape in PRESETS.items():
            assert (f"{name} {shape[field]}" in actions[field].help) == (name != "statquest"), (field, name)
    assert f"for {recipe['max_steps']} steps" in p.description


def test_the_library_reads_the_same_config():
    """What the help shows is what runs: the library's TrainConfig, presets, recipes and names are the config's
    own objects, not copies."""
    from decoderlab import config, model, positions, tokenizers, training
    from decoderlab.training import optim, recipes

    assert training.TrainConfig is config.TrainConfig and model.PRESETS is config.PRESETS
    assert recipes.RECIPES is config.RECIPES and recipes.DEFAULT_RECIPE == config.DEFAULT_RECIPE
    assert (optim.OPTIMIZERS, optim.SCHEDULES, training.PRECISIONS) == (OPTIMIZERS, SCHEDULES, PRECISIONS)
    assert positions.POSITIONS is POSITIONS and (model.NORMS, model.MLPS) == (NORMS, MLPS)
    assert tuple(tokenizers.TOKENIZERS) == TOKENIZERS and tokenizers.DEFAULT_BPE_VOCAB_SIZE == DEFAULT_BPE_VOCAB_SIZE
    # every TrainConfig field with a flag is named by the flag in error messages
    assert {f for _, f, _, _ in TRAIN_OPTIONS} <= set(FIELD_FLAGS)


@pytest.mark.slow
def test_a_closed_output_costs_no_training_state(closed_stdout_cli, small_corpus, tiny_lm_flags, tmp_path):
    """`decoderlab train | head` stopped with "decoderlab: error: [Errno 32] Broken pipe" at the first progress
    line; when that was the first evaluation's, the run had no lightning/last.ckpt and could not be resumed.
    Now the run goes on to its last step, unprinted, and can be resumed."""
    out = tmp_path / "run"
    # --log-every above --max-steps: the first line written is the first evaluation's
    status, err = closed_stdout_cli("train", "--data", small_corpus, "--out", out, "--max-steps", "4",
                                    "--eval-every", "2", "--log-every", "100", *tiny_lm_flags)
    assert (status, err) == (0, "")
    assert json.loads((out / "meta.json").read_text())["step"] == 4
    assert (out / "lightning" / "last.ckpt").is_file()
    status, err = closed_stdout_cli("train", "--resume", out, "--max-steps", "6")
    assert status == 0 and "error" not in err and "Traceback" not in err, err
    assert json.loads((out / "meta.json").read_text())["step"] == 6


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no directory can be made")
def test_an_out_where_no_directory_can_be_made_is_one_line(decoderlab_cli, tmp_path):
    """`train --out /proc/x` said "[Errno 2] No such file or directory: '/proc/x'" after reading the corpus and
    building the model; now one line naming --out, before any work."""
    r = decoderlab_cli("train", "--out", "/proc/x/run")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == ("decoderlab: error: --out /proc/x/run: cannot make this directory (No such file or "
                        "directory)\n")
    r = decoderlab_cli("train", "--out", tmp_path / "new" / "run", "--epochs", "3")  # a later refusal
    assert r.returncode == 2 and "--epochs applies to --preset statquest only" in r.stderr
    assert not (tmp_path / "new").exists()  # the check made nothing that stays
