"""``decoderlab finetune`` (decoderlab.cli.finetune): the help shows fine-tuning's defaults from the config, and
a closed output costs the run nothing."""

from __future__ import annotations

import json

import pytest

from decoderlab.config import (DEFAULT_TEMPLATE, DEFAULT_TOKENIZER, FINETUNE_EVAL_PROMPTS, FINETUNE_TRAIN,
                               FINETUNE_VAL_FRACTION, PRESETS, TEMPLATES, TOKENIZERS, TRAIN_DEFAULTS)

from .helps import actions, helps


def test_finetune_help_shows_the_fine_tuning_defaults():
    h = helps("finetune")
    assert h["--max-steps"] == "optimizer steps (default 500)"
    assert h["--lr"] == "peak learning rate (default 0.0003)"
    assert h["--n-layer"] == ("decoder blocks (default: baby-shakespeare 4, baby-shakespeare-speedrun 4, "
                              "shakespeare-char 6, gpt2 12)")
    assert "--val-batches" not in h
    a = actions("finetune")
    for field, value in {**TRAIN_DEFAULTS, **FINETUNE_TRAIN}.items():
        if field in a and a[field].help and field not in ("seed",):
            shown = f"{value:g}" if isinstance(value, float) else str(value)
            assert a[field].help.endswith(f"(default {shown})"), field
    assert h["--val-fraction"].endswith(f"(default {FINETUNE_VAL_FRACTION:g})")
    assert h["--eval-prompts"].endswith(f"(default {FINETUNE_EVAL_PROMPTS})")
    assert h["--template"] == f"chat template: {', '.join(TEMPLATES)} (default {DEFAULT_TEMPLATE})"
    assert a["tokenizer"].choices == TOKENIZERS and h["--tokenizer"].endswith(f"(default {DEFAULT_TOKENIZER})")
    assert a["preset"].choices == tuple(PRESETS)


def test_the_templates_the_help_names_are_the_library_s():
    from decoderlab.chat import TEMPLATES as CHAT_TEMPLATES

    assert tuple(CHAT_TEMPLATES) == TEMPLATES


@pytest.mark.slow
def test_a_closed_output_costs_no_fine_tuning_state(closed_stdout_cli, tmp_path):
    data = tmp_path / "lesson.jsonl"
    data.write_text('{"prompt": "what is statquest", "completion": "awesome"}\n'
                    '{"prompt": "statquest is what", "completion": "awesome"}\n')
    out = tmp_path / "lesson"
    status, err = closed_stdout_cli("finetune", "--preset", "statquest", "--tokenizer", "word", "--template",
                                    "lesson", "--data", data, "--val-fraction", "0", "--out", out, "--max-steps",
                                    "4", "--eval-every", "2", "--warmup", "1", "--log-every", "100")
    assert status == 0 and "error" not in err and "Traceback" not in err, err
    assert json.loads((out / "meta.json").read_text())["step"] == 4
    assert (out / "lightning" / "last.ckpt").is_file()
