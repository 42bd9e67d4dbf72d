"""``decoderlab explain`` (decoderlab.cli.glassbox): the worked examples and defaults in the help, a closed
output, and a --png that cannot be written named as the user typed it."""

from __future__ import annotations

import os

import pytest

from decoderlab.config import EXAMPLES, EXPLAIN_TOP_K

from .helps import actions, helps


def test_cli_example_names_are_the_glassbox_examples():
    from decoderlab.glassbox import EXAMPLES as GLASSBOX_EXAMPLES

    assert tuple(GLASSBOX_EXAMPLES) == EXAMPLES
    assert helps("explain")["--example"] == f"a worked example: {', '.join(EXAMPLES)} (default: none)"
    assert actions("explain")["top_k"].default == EXPLAIN_TOP_K


def test_a_closed_output_ends_explain_quietly(closed_stdout_cli):
    """A closed pipe said "decoderlab: error: [Errno 32] Broken pipe" (exit 2)."""
    assert closed_stdout_cli("explain", "--example", EXAMPLES[0]) == (141, "")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no file can be made")
def test_a_png_that_cannot_be_written_is_named_as_typed(decoderlab_cli, statquest_checkpoint):
    """`explain --png /proc/x.png` named the temporary file (/proc/.x.png.zc_2ge_d.tmp)."""
    r = decoderlab_cli("explain", "--checkpoint", statquest_checkpoint, "--png", "/proc/x.png", "what is")
    assert r.returncode == 2
    assert r.stderr == "decoderlab: error: /proc/x.png: No such file or directory\n"
