"""What a new user's first hour ran into, each one clear line: step-like options past a bound that names
itself, a DPO pairs file given to SFT, an unknown character's advice in the command line's terms, RL's closing
comparison of distinct steps."""

from __future__ import annotations

import json
import os

import pytest
from tiny_runs import write

from decoderlab import cli
from decoderlab.cli.errors import error_message
from decoderlab.reinforcement.run import edge_steps
from decoderlab.tokenizers import CharTokenizer


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("decoderlab: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, says", [
    (["train", "--max-steps", "100000000000000000000"], "--max-steps must be <= 1,000,000,000 (MAX_STEPS"),
    (["train", "--eval-every", "10000000000"], "--eval-every must be <= 1,000,000,000"),
    (["train", "--warmup", "10000000000"], "--warmup must be <= 1,000,000,000"),
    (["train", "--preset", "statquest", "--epochs", "100000000000000000000"], "--epochs must be >= 1 and <= "
                                                                              "1,000,000,000 (MAX_STEPS)"),
    (["finetune", "--preset", "statquest", "--data", "d.jsonl", "--log-every", "10000000000"],
     "--log-every must be <= 1,000,000,000"),
])
def test_step_like_options_are_bounded_naming_the_bound(argv, says, tmp_path, capsys):
    assert cli.main([*argv, "--out", str(tmp_path / "run")]) == 2
    assert says in _one_line(capsys)
    assert not (tmp_path / "run").exists()


def test_a_dpo_pairs_file_given_to_sft_hints_method_dpo(tmp_path, capsys):
    data = write(tmp_path, json.dumps({"prompt": "hi", "chosen": "hello", "rejected": "go away"}))
    assert cli.main(["finetune", "--preset", "statquest", "--data", str(data), "--out", str(tmp_path / "r")]) == 2
    err = _one_line(capsys)
    assert "preference pair (prompt, chosen, rejected)" in err and "--method dpo" in err


def test_an_unknown_character_s_advice_is_one_a_command_line_user_can_follow():
    with pytest.raises(ValueError) as e:
        CharTokenizer.from_text("caf").encode("café")
    assert "unk=True" in str(e.value)  # the library's advice, in Python's terms
    line = error_message(e.value)
    assert "unk=True" not in line and "--tokenizer bpe" in line and "'é' (U+00E9)" in line


@pytest.mark.parametrize("rewards, first, last, words", [
    ([0.0, 1.0], 0.0, 1.0, "first and last 1 step"),
    ([0.0] * 4 + [1.0] * 4, 0.0, 1.0, "first and last 4 steps"),  # 8 steps: never the same steps twice
    ([0.0] * 10 + [0.5] * 10 + [1.0] * 10, 0.0, 1.0, "first and last 10 steps"),
    ([0.5], 0.5, 0.5, "its one step"),
])
def test_rl_s_closing_comparison_never_compares_a_step_with_itself(rewards, first, last, words):
    assert edge_steps([{"reward": r} for r in rewards]) == (first, last, words)


def test_other_libraries_import_notices_are_quiet_unless_verbose(tmp_path):
    """LoRA runs printed torchao's "Failed to load ..._C_mxfp8" and torch pytree deprecations, which look like a
    broken install: quiet by default, shown with --verbose (DECODERLAB_VERBOSE=1)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("peft")
    code = "import decoderlab.lora as lora; lora._peft()"
    env = {k: v for k, v in os.environ.items() if k != "DECODERLAB_VERBOSE"}
    loud = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={**env, "DECODERLAB_VERBOSE": "1"})
    assert loud.returncode == 0
    if "Failed to load" not in loud.stderr and "_pytree" not in loud.stderr:  # (asked first: a process saved)
        pytest.skip("this torchao logs nothing on import: nothing to quiet here")
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert quiet.returncode == 0 and "Failed to load" not in quiet.stderr and "_pytree" not in quiet.stderr


def test_verbose_is_taken_anywhere_on_the_line(monkeypatch, capsys):
    """--verbose before or after the command is no argparse error; it holds for that command only (the
    variable is put back, so a later main() in the same process is quiet again)."""
    monkeypatch.delenv("DECODERLAB_VERBOSE", raising=False)
    for argv in (["generate", "--verbose", "--help"], ["--verbose", "train", "--help"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0 and "usage: decoderlab" in capsys.readouterr().out
    seen = {}
    monkeypatch.setattr("decoderlab.cli.errors.run_command",
                        lambda args: seen.update(env=os.environ.get("DECODERLAB_VERBOSE"), verbose=args.verbose) or 0)
    assert cli.main(["--verbose", "tasks", "make", "--task", "arithmetic", "--n", "1", "--out", "x.jsonl"]) == 0
    assert seen == {"env": "1", "verbose": True} and "DECODERLAB_VERBOSE" not in os.environ


@pytest.mark.slow
def test_resuming_a_pretraining_run_with_finetune_or_rl_names_the_command_that_continues_it(
        tmp_path, capsys, small_corpus, tiny_lm_flags):
    """`finetune --resume` on a pretraining run said "it was fine-tuned on conversations given as a list, which
    run.json does not hold": it is a pretraining run, and `train --resume` continues it."""
    run = tmp_path / "lm"
    assert cli.main(["train", "--data", str(small_corpus), *tiny_lm_flags, "--max-steps", "2", "--out",
                     str(run)]) == 0
    capsys.readouterr()
    for command in ("finetune", "rl"):
        assert cli.main([command, "--resume", str(run)]) == 2
        err = _one_line(capsys)
        assert "is a pretraining run" in err and f"`decoderlab train --resume {run}`" in err, err
        assert "conversations" not in err and "run.json" not in err


def test_an_export_into_a_missing_directory_names_that_directory(lm_checkpoint, tmp_path, capsys):
    """`export ... /nonexist/dir/x.gguf` named an internal temporary file (/nonexist/dir/.x.gguf.tmp-13069)."""
    out = tmp_path / "missing" / "x.gguf"
    assert cli.main(["export", "--format", "gguf", "--checkpoint", str(lm_checkpoint), "--out", str(out)]) == 2
    err = _one_line(capsys)
    assert f"directory {out.parent} does not exist" in err and ".tmp" not in err, err
    assert not out.parent.exists()


@pytest.mark.parametrize("command", ["verify", "explain", "lens", "heads"])
def test_empty_text_is_said_in_words_not_tensor_shapes(lm_checkpoint, capsys, command):
    """`verify ''` answered "need at least one token, as ids of shape (T,) or (B, T); got shape (1, 0)"."""
    assert cli.main([command, "--checkpoint", str(lm_checkpoint), ""]) == 2
    err = _one_line(capsys)
    assert "empty" in err and "at least one token of text" in err and "shape" not in err, err


def test_chat_on_a_base_model_says_it_continues_text(lm_checkpoint, capsys, monkeypatch):
    """`chat` on a base model without a chat template continued text without a word why."""
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.StringIO("to be\n"))
    assert cli.main(["chat", "--checkpoint", str(lm_checkpoint), "--max-new-tokens", "3", "--seed", "0"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [f"({lm_checkpoint} has no chat template: each line continues the text so far, as a base model "
                   "does; `decoderlab finetune` makes a chat checkpoint)"]
