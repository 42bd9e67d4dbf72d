"""The shared option groups (decoderlab.cli.options): a row is a flag of every command of the group, read back
with the others; the readers return only what was given."""

from __future__ import annotations

import argparse

from decoderlab.cli.options import (SAMPLING_OPTIONS, add_options, dest, given, model_overrides, option,
                                    train_overrides)

from .helps import command_parser


def test_a_row_is_a_flag_of_the_group_and_its_reader():
    # a made-up flag, not one of the group's: a row with a callable help
    rows = (*SAMPLING_OPTIONS, option("--typical-p", type=float, metavar="P", help=lambda w: f"typical ({w['where']})"))
    p = argparse.ArgumentParser()
    add_options(p, rows, temperature_help="t", where="here")
    args = p.parse_args(["--typical-p", "0.1", "--top-k", "5"])
    assert given(args, rows) == {"top_k": 5, "typical_p": 0.1}
    assert [dest(r) for r in rows] == ["max_new_tokens", "temperature", "top_k", "top_p", "seed", "min_p",
                                       "repetition_penalty", "frequency_penalty", "presence_penalty", "json_schema",
                                       "typical_p"]
    assert {a.dest: a.help for a in p._actions}["typical_p"] == "typical (here)"


def test_the_readers_return_what_was_given():
    args = command_parser("train").parse_args(["--lr", "0.01", "--n-layer", "2", "--seed", "3", "--compile"])
    assert train_overrides(args) == {"lr": 0.01, "seed": 3, "compile": True}
    assert model_overrides(args) == {"n_layer": 2}
    args = command_parser("finetune").parse_args(["--data", "d", "--out", "o", "--max-steps", "9"])
    assert train_overrides(args, ("val_batches", "full_val_below")) == {"max_steps": 9}
