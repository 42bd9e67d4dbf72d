"""``decoderlab verify`` (decoderlab.cli.glassbox): the tolerance's default, and a closed output."""

from __future__ import annotations

from decoderlab.config import VERIFY_TOL

from .helps import actions


def test_verify_tolerance_is_the_configs():
    tol = actions("verify")["tol"]
    assert tol.default == VERIFY_TOL and "(default %(default)g)" in tol.help


def test_a_closed_output_ends_verify_quietly(closed_stdout_cli, statquest_checkpoint):
    assert closed_stdout_cli("verify", "--checkpoint", statquest_checkpoint, "what is statquest") == (141, "")
