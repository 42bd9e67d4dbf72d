"""``decoderlab rl`` (decoderlab.cli.rl): the help shows the defaults from the config, a tiny run writes a chat
checkpoint with its curves, and every bad input is one ``decoderlab: error:`` line naming it (a failing reward
keeps the run's last checkpoint)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from decoderlab import cli
from decoderlab.config import RL_DEFAULTS, RL_TRAIN, TRAIN_DEFAULTS, RLConfig
from reinforcement.letters import letter_checkpoint, letter_prompts

from .helps import actions, helps


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def files(tmp_path):
    return letter_checkpoint(tmp_path / "base"), letter_prompts(tmp_path / "prompts.jsonl")


def rl_args(files, out, *more):
    checkpoint, prompts = files
    return ["rl", "--checkpoint", str(checkpoint), "--prompts", str(prompts), "--out", str(out), "--reward", "regex",
            "--group-size", "4", "--max-new-tokens", "2", "--max-steps", "2", "--eval-every", "1", "--lr", "0.01",
            "--no-progress-bar", *map(str, more)]


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("decoderlab: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_rl_help_shows_the_defaults_of_the_config():
    h, a = helps("rl"), actions("rl")
    for field, value in {**TRAIN_DEFAULTS, **RL_TRAIN}.items():
        if field in a and a[field].help and field != "seed":
            shown = f"{value:g}" if isinstance(value, float) else str(value)
            assert a[field].help.endswith(f"(default {shown})"), field
    for f in dataclasses.fields(RLConfig):  # the help's defaults are the dataclass's
        if f.name in a and f.name != "scale_rewards":
            assert a[f.name].help.endswith(f"(default {f.default})"), f.name
    assert RLConfig().to_dict() == RL_DEFAULTS
    assert "contains_words, exact, regex, number" in h["--reward"] and "--lora-rank" in h and "--val-batches" not in h


def test_a_tiny_run_writes_a_chat_checkpoint_and_its_curves(files, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(rl_args(files, out, "--log-every", "1")) == 0
    printed = capsys.readouterr().out
    assert "step 2/2  reward " in printed and " kl " in printed and "end of turn" in printed
    assert printed.endswith(f"checkpoint written to {out}; talk with it: decoderlab chat --checkpoint {out}\n")
    assert (out / "rl.png").is_file() and json.loads((out / "meta.json").read_text())["step"] == 2
    assert cli.main(["rl", "--resume", "--out", str(out), "--max-steps", "3", "--no-progress-bar"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    assert capsys.readouterr().err.startswith("decoderlab: resuming from step 2 of 3 (")  # its first line
    assert cli.main(["rl", "--resume", str(out), "--max-steps", "4", "--no-progress-bar"]) == 0  # the directory alone
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    capsys.readouterr()
    prompts = files[1]
    prompts.write_text(prompts.read_text().splitlines()[0] + "\n")
    assert cli.main(["rl", "--resume", str(out), "--max-steps", "5"]) == 2
    assert "the prompts differ from those it was trained on" in one_error(capsys)


@pytest.mark.parametrize("spec, says", [
    ("nosuchmodule_xyz:f", "reward 'nosuchmodule_xyz:f': cannot import module 'nosuchmodule_xyz': "
                           "ModuleNotFoundError"),
    ("rewards_here:nothing", "reward 'rewards_here:nothing': module 'rewards_here' has no attribute 'nothing'"),
    ("best", "unknown reward 'best'; built-in rewards: contains_words, exact, regex, number"),
])
def test_a_reward_naming_nothing_importable_is_one_line(files, tmp_path, capsys, monkeypatch, spec, says):
    (tmp_path / "rewards_here.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main([*rl_args(files, tmp_path / "run"), "--reward", spec]) == 2
    assert one_error(capsys).startswith(f"decoderlab: error: {says}")


@pytest.mark.parametrize("name, body, says", [
    ("raises", "    raise ZeroDivisionError('division by zero')", "raised ZeroDivisionError: division by zero on a "
                                                                   "reply to the prompt on line"),
    ("says_yes", "    return 'yes'", "returned 'yes' (str) for a reply to the prompt on line"),
])
def test_a_reward_that_raises_or_returns_a_non_number_keeps_the_last_checkpoint(files, tmp_path, capsys, monkeypatch,
                                                                                 name, body, says):
    """The first step's 16 replies score; then the reward fails, on step 2: step 1's checkpoint is kept."""
    (tmp_path / f"flaky_{name}.py").write_text(f"calls = []\n\ndef reward(reply, row, ended):\n    calls.append(1)\n"
                                       f"    if len(calls) <= 16:\n        return 0.5\n{body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    assert cli.main([*rl_args(files, out), "--reward", f"flaky_{name}:reward"]) == 2
    line = one_error(capsys)
    assert line.startswith(f"decoderlab: error: reward 'flaky_{name}:reward' ") and says in line, line
    assert json.loads((out / "meta.json").read_text())["step"] == 1
    assert torch.load(out / "lightning" / "last.ckpt", weights_only=False)["global_step"] == 1


def test_prompts_lacking_a_field_the_reward_needs_name_the_line(files, tmp_path, capsys):
    bad = letter_prompts(tmp_path / "bad.jsonl", [{"prompt": "a", "pattern": "^a"}, {"prompt": "b"}])
    assert cli.main([*rl_args(files, tmp_path / "run"), "--prompts", str(bad)]) == 2
    line = one_error(capsys)
    assert "line 2" in line and "'pattern'" in line, line


@pytest.mark.parametrize("more, says", [
    (("--group-size", "1"), "--group-size must be an integer >= 2"),
    (("--lora-rank", "0"), "LoRA rank must be an integer >= 1, got 0"),
    (("--lora-rank", "999"), "999"),
    (("--lora-rank", "2", "--lora-targets", "attention"), "'attention'"),
    (("--lora-alpha", "4"), "--lora-alpha needs --lora-rank R"),
])
def test_bad_settings_are_one_line_naming_the_value(files, tmp_path, capsys, more, says):
    assert cli.main([*rl_args(files, tmp_path / "run"), *more]) == 2
    line = one_error(capsys)
    assert says in line, line
    assert not (tmp_path / "run" / "lightning").exists()


def test_a_base_checkpoint_without_a_chat_template_is_told_to_fine_tune_first(tmp_path, capsys):
    plain = letter_checkpoint(tmp_path / "plain", template=False)
    files = (plain, letter_prompts(tmp_path / "p.jsonl"))
    assert cli.main(rl_args(files, tmp_path / "run")) == 2
    line = one_error(capsys)
    assert f"{plain} has no chat template" in line and "fine-tune it on conversations first" in line, line


def test_rl_without_a_checkpoint_or_prompts_is_one_line(tmp_path, capsys):
    assert cli.main(["rl", "--out", str(tmp_path / "run")]) == 2
    assert "give --checkpoint PATH (a chat checkpoint) and --prompts PATH" in one_error(capsys)
