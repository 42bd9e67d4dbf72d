"""The package as a whole: a light start (what `import decoderlab`, `decoderlab --help` and `generate` load)
and the layering contract (import-linter, also run by `make test`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("lightning", "matplotlib", "transformers")
PROBE = """
import sys
sys.argv = ["decoderlab", *{argv!r}]
{body}
print("LOADED " + " ".join(m for m in {heavy!r} + ("torch",) if m in sys.modules), file=sys.stderr)
"""


def _loaded(body: str, argv=()) -> set[str]:
    code = PROBE.format(argv=list(argv), body=body, heavy=HEAVY)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("LOADED")][-1]
    return set(line.split()[1:])


def test_import_decoderlab_loads_no_framework():
    assert _loaded("import decoderlab; decoderlab.__version__") == set()


def test_help_imports_neither_torch_nor_lightning():
    body = "from decoderlab.cli import main\ntry:\n    main()\nexcept SystemExit:\n    pass"
    assert _loaded(body, ["--help"]) == set()
    assert _loaded(body, ["explain", "--help"]) == set()


def test_generate_on_a_checkpoint_does_not_import_lightning(statquest_checkpoint):
    body = "from decoderlab.cli import main\nmain()"
    assert _loaded(body, ["generate", "--checkpoint", str(statquest_checkpoint), "what is statquest"]) == {"torch"}


def test_lazy_names_resolve_to_their_modules():
    import decoderlab as dl
    from decoderlab import lesson, model, training

    assert dl.SelfAttention is lesson.SelfAttention and dl.DecoderOnlyTransformer is model.DecoderOnlyTransformer
    assert dl.train_lm is training.train_lm
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dl.nope  # noqa: B018


def test_cli_example_names_are_the_glassbox_examples():
    from decoderlab.cli import EXAMPLE_NAMES
    from decoderlab.glassbox import EXAMPLES

    assert tuple(EXAMPLES) == EXAMPLE_NAMES


@pytest.mark.skipif(shutil.which("lint-imports", path=str(Path(sys.executable).parent)) is None,
                    reason="import-linter is not installed in this environment")
def test_layers_contract_holds_and_an_upward_import_breaks_it(tmp_path):
    """import-linter keeps the layers; a module that imports one above it fails, naming both."""
    exe = str(Path(sys.executable).parent / "lint-imports")
    root = Path(__file__).resolve().parents[1]
    ok = subprocess.run([exe, "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # a copy of the package in which model.py imports the generation engine (an upward import)
    src = tmp_path / "src"
    shutil.copytree(root / "src" / "decoderlab", src / "decoderlab")
    (src / "decoderlab" / "model.py").write_text(
        (src / "decoderlab" / "model.py").read_text() + "\nfrom .generation import engine  # noqa\n")
    shutil.copy(root / "pyproject.toml", tmp_path / "pyproject.toml")
    env = {"PYTHONPATH": str(src), "PATH": str(Path(sys.executable).parent)}
    bad = subprocess.run([exe, "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode != 0
    assert "decoderlab.model -> decoderlab.generation" in bad.stdout


# ---------------------------------------------------------------------------------------------------------
# the command line's help: defaults from one source, choices, a help line for every option (issue 14)
# ---------------------------------------------------------------------------------------------------------


def test_cli_mirrors_agree_with_the_library():
    """--help reads its defaults and choices from mirrors in cli.py (no torch); they equal the library's."""
    import dataclasses
    import inspect

    from decoderlab import cli
    from decoderlab.model import MLPS, NORMS, PRESETS
    from decoderlab.positions import POSITIONS
    from decoderlab.tokenizers import DEFAULT_BPE_VOCAB_SIZE, TOKENIZERS
    from decoderlab.training import PRECISIONS, TrainConfig, train_pairs

    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    assert cli.TRAIN_DEFAULTS == {k: defaults[k] for k in cli.TRAIN_DEFAULTS}
    params = inspect.signature(train_pairs).parameters
    assert cli.PAIR_DEFAULTS == {k: params[k].default for k in cli.PAIR_DEFAULTS}
    assert cli.PRECISIONS == PRECISIONS
    assert cli.PRESET_NAMES == tuple(PRESETS)
    assert cli.PRESET_SHAPES == {name: {f: PRESETS[name][f] for f in cli.SHAPE_FIELDS} for name in PRESETS}
    assert cli.MODEL_CHOICES == {"position": POSITIONS, "norm": NORMS, "mlp": MLPS}
    assert cli.TOKENIZER_KINDS == tuple(TOKENIZERS) and cli.DEFAULT_BPE_VOCAB_SIZE == DEFAULT_BPE_VOCAB_SIZE
    from decoderlab.serve import Limits

    limits = {f.name: f.default for f in dataclasses.fields(Limits)}
    assert cli.SERVE_LIMITS == {k: limits[k] for k in cli.SERVE_LIMITS}
    from decoderlab.training.optim import OPTIMIZERS, SCHEDULES
    from decoderlab.training.recipes import DEFAULT_RECIPE, RECIPES

    assert (cli.OPTIMIZERS, cli.SCHEDULES) == (OPTIMIZERS, SCHEDULES)
    assert cli.RECIPE_NAMES == tuple(RECIPES) and cli.DEFAULT_RECIPE == DEFAULT_RECIPE
    assert cli.DEFAULT_RECIPE_TRAIN == RECIPES[DEFAULT_RECIPE].train
    assert sorted(cli.TRAIN_PRESET_NAMES) == sorted(set(PRESETS) | set(RECIPES))
    # every TrainConfig field with a flag is named by the flag in error messages
    assert {f for _, f, _, _ in cli.TRAIN_OPTIONS} <= set(cli.FIELD_FLAGS)


def test_cli_finetune_mirrors_agree_with_the_library():
    """finetune's --help defaults (and the chat template names) come from mirrors equal to the library's."""
    import inspect

    from decoderlab import cli
    from decoderlab.chat import TEMPLATES
    from decoderlab.finetuning import FINETUNE_DEFAULTS, finetune

    assert cli.FINETUNE_CONFIG == FINETUNE_DEFAULTS and cli.CHAT_TEMPLATES == tuple(TEMPLATES)
    from decoderlab.config import DEFAULT_TEMPLATE, DEFAULT_TOKENIZER, FINETUNE_VAL_FRACTION

    params = inspect.signature(finetune).parameters  # None there: the default below, or a resumed run's own
    library = {"template": DEFAULT_TEMPLATE, "val_fraction": FINETUNE_VAL_FRACTION, "tokenizer": DEFAULT_TOKENIZER}
    assert cli.FINETUNE_DEFAULTS == {k: library.get(k, params[k].default) for k in cli.FINETUNE_DEFAULTS}
    helps = {a.option_strings[-1]: a.help for a in cli.build_parser()._subparsers._group_actions[0]
             .choices["finetune"]._actions if a.option_strings}
    assert helps["--max-steps"] == "optimizer steps (default 500)"
    assert helps["--lr"] == "peak learning rate (default 0.0003)"
    assert helps["--n-layer"] == ("decoder blocks (default: baby-shakespeare 4, baby-shakespeare-speedrun 4, "
                                  "shakespeare-char 6, gpt2 12)")
    assert "--val-batches" not in helps


def test_every_option_has_a_help_line_its_default_and_its_choices():
    import argparse

    from decoderlab import cli

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {"train", "sample", "generate", "chat", "finetune", "verify", "explain", "serve"}
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
    # issue 12: train's defaults are the default recipe's (baby-shakespeare-speedrun), a plain preset's TrainConfig()'s
    assert ("--preset {statquest,baby-shakespeare,baby-shakespeare-speedrun,baby-shakespeare-nanogpt,"
            "shakespeare-char,gpt2}") in sub.choices["train"].format_help()
    assert helps["--max-steps"] == "optimizer steps (default 450; 2000 with a plain model preset)"
    assert helps["--lr"] == ("peak learning rate (statquest: Adam's learning rate) (default 0.003; 0.001 with a plain "
                             "model preset; statquest 0.1)")
    assert helps["--optimizer"].endswith("(default muon; adamw with a plain model preset)")
    for command in ("train", "generate", "sample", "chat", "serve"):
        assert "--threads" in {a.option_strings[-1] for a in sub.choices[command]._actions if a.option_strings}
    assert helps["--n-layer"] == ("decoder blocks (default: baby-shakespeare 4, baby-shakespeare-speedrun 4, "
                                  "shakespeare-char 6, gpt2 12)")


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
    assert r.stderr.endswith("gpt2') (see decoderlab train --help)\n") and r.stderr.count("\n") == 1


def test_unknown_flags_are_named_alone(decoderlab_cli, tmp_path):
    """`generate --checkpoint X --devices 2 The` said "unrecognized arguments: --devices The"."""
    for argv, line in ((("--devices", "2", "The"), "unrecognized option: --devices"),
                       (("--bogus=3", "-x", "what", "is"), "unrecognized options: --bogus, -x")):
        r = decoderlab_cli("generate", "--checkpoint", tmp_path, *argv)
        assert (r.returncode, r.stdout, r.stderr) == (2, "", f"decoderlab: error: {line} (see decoderlab generate "
                                                            f"--help)\n")
    r = decoderlab_cli("verify", "--checkpoint", tmp_path, "a", "--nope")
    assert r.stderr == "decoderlab: error: unrecognized option: --nope (see decoderlab verify --help)\n"


def test_lazy_finetune_is_the_function_whatever_was_imported_first():
    """A submodule import sets the package attribute of its name: the function must not share it."""
    code = ("import decoderlab.finetuning, decoderlab.chat, decoderlab as dl; "
            "assert callable(dl.finetune) and dl.finetune is decoderlab.finetuning.finetune; "
            "assert dl.chat_reply is decoderlab.chat.chat_reply; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.stdout.strip() == "ok", r.stderr
