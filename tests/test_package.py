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
