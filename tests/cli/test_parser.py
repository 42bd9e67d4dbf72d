"""The parser (decoderlab.cli.parser): every command's help without torch, a help line for every option with its
default and choices, the defaults read from decoderlab.config when the parser is built, one-line argument
errors, unknown flags named alone, and the start that builds only the command it runs."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from decoderlab import cli
from decoderlab.cli.parser import COMMANDS

HEAVY = ("lightning", "matplotlib", "transformers")
PROBE = """
import sys
sys.argv = ["decoderlab", *{argv!r}]
{body}
print("LOADED " + " ".join(m for m in {heavy!r} + ("torch",) if m in sys.modules), file=sys.stderr)
"""
HELP = "from decoderlab.cli import main\ntry:\n    main()\nexcept SystemExit:\n    pass"


def _loaded(body: str, argv=(), heavy=HEAVY) -> set[str]:
    code = PROBE.format(argv=list(argv), body=body, heavy=heavy)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("LOADED")][-1]
    return set(line.split()[1:])


def _subparsers(parser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _helps(parser) -> dict[str, str]:
    return {a.option_strings[-1]: a.help for a in parser._actions if a.option_strings}


def test_help_imports_neither_torch_nor_lightning():
    assert _loaded(HELP, ["--help"]) == set()
    assert _loaded(HELP, ["explain", "--help"]) == set()
    for command in COMMANDS:
        assert _loaded(HELP, [command, "--help"]) == set(), command


def test_help_reads_the_config_without_building_a_class():
    """The defaults come from decoderlab.config's plain data: importing dataclasses (and the inspect module it
    imports) alone costs about as much as argparse, so no command's --help may load them (bench/startup.py)."""
    for command in COMMANDS:
        assert _loaded(HELP, [command, "--help"], heavy=("dataclasses", "inspect", "json")) == set(), command


def test_every_option_has_a_help_line_its_default_and_its_choices():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {"train", "sample", "generate", "chat", "finetune", "rl", "verify", "explain", "lens",
                                "heads", "patch", "sae", "features", "serve", "export", "tasks", "report"}
    for name, p in sub.choices.items():
        text = p.format_help()
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            where = f"decoderlab {name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, where
            if action.option_strings and not action.required:
                assert "default" in action.help, where
            if action.choices:
                assert "{" + ",".join(map(str, action.choices)) + "}" in text, where
    helps = {a.option_strings[-1]: a.help for a in sub.choices["train"]._actions if a.option_strings}
    # train's defaults are the default recipe's (baby-shakespeare-speedrun), a plain preset's TrainConfig()'s
    assert ("--preset {statquest,baby-shakespeare,baby-shakespeare-speedrun,baby-shakespeare-nanogpt,"
            "shakespeare-char,gpt2,smollm2-135m}") in sub.choices["train"].format_help()
    assert helps["--max-steps"] == "optimizer steps (default 450; 2000 with a plain model preset)"
    assert helps["--lr"] == ("peak learning rate (statquest: Adam's learning rate) (default 0.003; 0.001 with a plain "
                             "model preset; statquest 0.1)")
    assert helps["--optimizer"].endswith("(default muon; adamw with a plain model preset)")
    for command in ("train", "generate", "sample", "chat", "serve"):
        assert "--threads" in {a.option_strings[-1] for a in sub.choices[command]._actions if a.option_strings}
    assert helps["--n-layer"] == ("decoder blocks (default: baby-shakespeare 4, baby-shakespeare-speedrun 4, "
                                  "shakespeare-char 6, gpt2 12, smollm2-135m 30)")


def test_the_help_is_built_from_the_config(monkeypatch):
    """No copy of a library value in the CLI: a config value changed before the parser is built is the one the
    help shows."""
    from decoderlab.config import FINETUNE_TRAIN, PRESETS, SERVE_LIMIT_DEFAULTS, TRAIN_DEFAULTS

    monkeypatch.setitem(FINETUNE_TRAIN, "max_steps", 777)
    monkeypatch.setitem(TRAIN_DEFAULTS, "grad_clip", 0.5)
    monkeypatch.setitem(PRESETS["gpt2"], "n_layer", 48)
    monkeypatch.setitem(SERVE_LIMIT_DEFAULTS, "max_n", 3)
    sub = _subparsers(cli.build_parser())
    assert _helps(sub["finetune"])["--max-steps"] == "optimizer steps (default 777)"
    assert _helps(sub["train"])["--grad-clip"] == "clip the gradient norm to this, 0 = no clipping (default 0.5)"
    assert _helps(sub["train"])["--n-layer"].endswith(", gpt2 48, smollm2-135m 30)")
    assert sub["serve"].parse_args(["--checkpoint", "x"]).max_n == 3


def test_a_start_builds_only_the_command_it_runs():
    """`decoderlab CMD ...` adds the options of CMD alone (the others are listed by name), and CMD's options
    are those of the whole parser."""
    whole = _subparsers(cli.build_parser())
    for command in COMMANDS:
        lazy = _subparsers(cli.build_parser(["--version", command, "--help"]))
        assert lazy[command].format_help() == whole[command].format_help(), command
        others = {name: [a for a in p._actions if not isinstance(a, argparse._HelpAction)]
                  for name, p in lazy.items() if name != command}
        assert others == {name: [] for name in others}, command
    top = cli.build_parser(["--help"])
    assert top.format_help() == cli.build_parser().format_help()


def test_version_and_one_line_argument_errors(decoderlab_cli):
    from decoderlab import __version__

    r = decoderlab_cli("--version")
    assert (r.returncode, r.stdout, r.stderr) == (0, f"decoderlab {__version__}\n", "")
    r = decoderlab_cli("train", "--max-steps", "abc")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "decoderlab: error: --max-steps must be an integer, got 'abc' (see decoderlab train --help)\n"
    r = decoderlab_cli("train", "--preset", "gpt3")
    assert r.returncode == 2
    assert r.stderr.startswith("decoderlab: error: --preset: invalid choice: 'gpt3' (choose from ")
    assert r.stderr.endswith("smollm2-135m') (see decoderlab train --help)\n") and r.stderr.count("\n") == 1


def test_unknown_flags_are_named_alone(decoderlab_cli, tmp_path):
    """`generate --checkpoint X --devices 2 The` said "unrecognized arguments: --devices The"."""
    for argv, line in ((("--devices", "2", "The"), "unrecognized option: --devices; did you mean --device?"),
                       (("--bogus=3", "-x", "what", "is"), "unrecognized options: --bogus, -x")):
        r = decoderlab_cli("generate", "--checkpoint", tmp_path, *argv)
        assert (r.returncode, r.stdout, r.stderr) == (2, "", f"decoderlab: error: {line} (see decoderlab generate "
                                                            f"--help)\n")
    r = decoderlab_cli("verify", "--checkpoint", tmp_path, "a", "--nope")
    assert r.stderr == "decoderlab: error: unrecognized option: --nope (see decoderlab verify --help)\n"


def _error(capsys, *argv) -> str:
    """The error line of ``decoderlab ARGV``'s parser (in this process: no command runs)."""
    with pytest.raises(SystemExit) as e:
        cli.build_parser(list(argv)).parse_args(list(argv))
    out, err = capsys.readouterr()
    assert (e.value.code, out, err.count("\n")) == (2, "", 1), err
    return err


def test_an_unknown_option_is_named_before_a_missing_one(capsys):
    """`generate --chekpoint runs/statquest "what is statquest"` said "the following arguments are required:
    --checkpoint": the misspelling is the mistake, and its near spelling is suggested."""
    assert _error(capsys, "generate", "--chekpoint", "runs/statquest", "what is statquest") == (
        "decoderlab: error: unrecognized option: --chekpoint; did you mean --checkpoint? (see decoderlab generate "
        "--help)\n")
    assert _error(capsys, "verify", "--chekpoint=x", "--tol", "1") .startswith(
        "decoderlab: error: unrecognized option: --chekpoint; did you mean --checkpoint?")
    # nothing unknown: the missing option is still what is said; a negative number is no option
    assert "required: --checkpoint" in _error(capsys, "generate", "--top-k", "-0", "what")
    assert "required: --checkpoint" in _error(capsys, "generate", "--chat", "--system", "-be brief", "what")
    assert _error(capsys, "export", "--nothing-near").startswith("decoderlab: error: unrecognized option: "
                                                                 "--nothing-near (see")


def _parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_no_option_is_abbreviated(capsys):
    """`--max-new-token 5` was taken as --max-new-tokens (argparse's abbreviations): one spelling per option."""
    parsers = list(_parsers(cli.build_parser()))
    assert len(parsers) > len(COMMANDS) and not any(p.allow_abbrev for p in parsers)
    assert _error(capsys, "generate", "--checkpoint", "x", "--max-new-token", "5", "hi").startswith(
        "decoderlab: error: unrecognized option: --max-new-token; did you mean --max-new-tokens?")
    assert "unrecognized option: --max-step;" in _error(capsys, "train", "--max-step", "3")


@pytest.mark.parametrize("argv", [["bogus"], ["--help"], []])
def test_no_command_or_an_unknown_one_is_one_line_or_the_list(decoderlab_cli, argv):
    r = decoderlab_cli(*argv)
    if argv == ["--help"]:
        assert r.returncode == 0 and all(name in r.stdout for name in COMMANDS)
    else:
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("decoderlab: error: ")


def test_a_misspelt_command_is_told_its_near_spelling(capsys):
    err = _error(capsys, "verfy", "x")
    assert err.startswith("decoderlab: error: COMMAND: invalid choice: 'verfy' (choose from 'train', ")
    assert err.endswith("'serve'); did you mean verify? (see decoderlab --help)\n")
    assert "did you mean" not in _error(capsys, "zzz", "x")
