"""Standard output that may be a closed pipe (decoderlab.output), in a real process whose pipe's read end is
closed before it writes: the writes after the reader left are discarded, nothing is raised, Python's exit is
quiet, and a training run through the Python API goes on to its checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _closed_stdout(code: str) -> tuple[int, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.close()
    err = p.communicate(timeout=600)[1].decode()
    return p.returncode, err


def test_print_line_discards_what_has_no_reader():
    code = ("import sys\nfrom decoderlab.output import print_line\n"
            "first = print_line('one')\nsecond = print_line('two')\nprint('plain print after it', flush=True)\n"
            "print(first, second, file=sys.stderr)\n")
    assert _closed_stdout(code) == (0, "False True\n")  # the first found no reader; then /dev/null takes all


def test_keep_writing_carries_a_whole_command_on():
    code = ("import sys\nfrom decoderlab.output import KeepWriting\n"
            "with KeepWriting():\n    for i in range(3):\n        print('line', i, flush=True)\n"
            "    sys.stdout.write('unflushed at the end')\n"
            "print('done', file=sys.stderr)\n")
    assert _closed_stdout(code) == (0, "done\n")


def test_without_it_the_first_line_raises():
    """The failure the module exists for (so that the tests above can fail)."""
    status, err = _closed_stdout("print('one', flush=True)")
    assert status != 0 and "BrokenPipeError" in err


@pytest.mark.slow
def test_a_training_run_goes_on_to_its_checkpoint(tmp_path):
    """train_lm(progress_bar="plain") printed its progress lines with print(): the first one on a closed pipe
    raised BrokenPipeError out of Lightning's fit, before any checkpoint."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question of the day\n" * 60, encoding="utf-8")
    code = (f"from decoderlab.training import train_lm\n"
            f"train_lm({str(corpus)!r}, preset='baby-shakespeare', out={str(tmp_path / 'run')!r}, "
            f"progress_bar='plain', model_overrides=dict(n_layer=1, d_model=16, n_head=2, max_len=16), "
            f"config_overrides=dict(max_steps=4, eval_every=2, log_every=1, batch_size=4, warmup=1, "
            f"val_batches=1))\n")
    status, err = _closed_stdout(code)
    assert status == 0 and "Traceback" not in err, err
    assert json.loads((tmp_path / "run" / "meta.json").read_text())["step"] == 4
    assert (tmp_path / "run" / "lightning" / "last.ckpt").is_file()
