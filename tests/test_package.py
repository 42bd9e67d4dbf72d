"""The package as a whole: a light `import decoderlab` (the command line's start is tests/cli/test_parser.py's),
its lazy names, and the layering contract (import-linter, also run by `make test`)."""

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




def test_lazy_names_resolve_to_their_modules():
    import decoderlab as dl
    from decoderlab import lesson, model, training

    assert dl.SelfAttention is lesson.SelfAttention and dl.DecoderOnlyTransformer is model.DecoderOnlyTransformer
    assert dl.train_lm is training.train_lm
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dl.nope  # noqa: B018



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







def test_lazy_finetune_is_the_function_whatever_was_imported_first():
    """A submodule import sets the package attribute of its name: the function must not share it."""
    code = ("import decoderlab.finetuning, decoderlab.chat, decoderlab as dl; "
            "assert callable(dl.finetune) and dl.finetune is decoderlab.finetuning.finetune; "
            "assert dl.chat_reply is decoderlab.chat.chat_reply; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.stdout.strip() == "ok", r.stderr


def test_the_rewards_load_no_torch():
    """The rewards are read by a reward's own module:function and listed by `rl --help`: no torch behind them."""
    assert _loaded("import decoderlab.reinforcement.rewards") == set()


@pytest.mark.parametrize("old", ["decoderlab.feedback", "decoderlab.feedback.rewards", "decoderlab.storyset",
                                 "decoderlab.watch"])
def test_moved_modules_have_one_home_and_no_alias(old):
    """decoderlab was never released: a moved module leaves no alias behind (its one home is named in
    docs/design.md's tree)."""
    import importlib

    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
