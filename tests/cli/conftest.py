import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")


def cli_env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("DECODERLAB_RUN_DIR", None)
    return env


@pytest.fixture(scope="session")
def closed_stdout_cli():
    """Run ``python -m decoderlab.cli ARGS`` with its standard output a pipe whose read end is closed before the
    command writes anything (as ``decoderlab ... | head -0`` would, with no race): every write to it fails with
    EPIPE. ``stdin`` is fed to the command. Returns ``(exit status, standard error as text)``."""

    def run(*args, stdin: str = "", timeout: float = 300):
        p = subprocess.Popen([sys.executable, "-m", "decoderlab.cli", *map(str, args)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env())
        p.stdout.close()
        try:
            _, err = p.communicate(stdin.encode(), timeout=timeout)
        except BaseException:
            p.kill()
            raise
        return p.returncode, err.decode()

    return run


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """A few kilobytes of words, enough windows of 16 characters for a training run of a few steps."""
    import random

    rng = random.Random(0)
    words = "the king and queen of the realm spoke to the people about bread and peace".split()
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tiny_lm_flags() -> tuple[str, ...]:
    """`decoderlab train` flags of a language model small enough to train a few steps in seconds."""
    return ("--n-layer", "1", "--d-model", "16", "--n-head", "2", "--max-len", "16", "--batch-size", "4",
            "--warmup", "1", "--val-batches", "1")
