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
def test_a_png_that_cannot_be_written_is_named_as_typed(statquest_checkpoint, capsys):
    """`explain --png /proc/x.png` named the temporary file (/proc/.x.png.zc_2ge_d.tmp)."""
    from decoderlab.cli import main

    assert main(["explain", "--checkpoint", str(statquest_checkpoint), "--png", "/proc/x.png", "what is"]) == 2
    assert capsys.readouterr().err == "decoderlab: error: /proc/x.png: No such file or directory\n"


def _watched_run(directory):
    """Records as --watch-heads writes them: L1H1's induction score crosses the threshold at step 20 while the
    loss drops."""
    from decoderlab.glassbox.watching import append_record

    directory.mkdir()
    for step, loss, score in ((0, None, 0.02), (10, 3.1, 0.1), (20, 2.2, 0.41), (30, 1.9, 0.48)):
        table = [[0.01, 0.02], [0.03, score]]
        append_record(directory, {"step": step, "loss": loss, "scores": {
            "previous_token": table, "duplicate_token": table, "induction": table}})
    return directory


def test_explain_run_shows_when_each_head_formed_beside_the_loss(tmp_path, capsys):
    from decoderlab.cli import main
    from decoderlab.glassbox.watching import read_records, watch_table

    run_dir = _watched_run(tmp_path / "run")
    png, page = tmp_path / "heads.png", tmp_path / "heads.html"
    assert main(["explain", "--run", str(run_dir), "--png", str(png), "--html", str(page)]) == 0
    out = capsys.readouterr().out
    table = watch_table(read_records(run_dir), "induction")
    assert out == f"{table}\nwrote the PNG to {png}\nwrote the HTML page to {page}\n"
    assert "  L1H1      0.020   0.480  20" in table.splitlines()  # formed at step 20
    assert "loss 3.1000 at step 10 -> 1.9000 at step 30" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "data:image/png;base64," in page.read_text() and "formed" in page.read_text()
    assert main(["explain", "--run", str(run_dir), "--kind", "previous_token"]) == 0
    assert capsys.readouterr().out.startswith("previous_token scores over 4 records")


def test_explain_run_bad_input_is_one_line(tmp_path, capsys):
    from decoderlab.cli import main

    run_dir = _watched_run(tmp_path / "run")
    cases = ((["--run", str(tmp_path / "none")], f"{tmp_path / 'none'} does not exist: a run records head "
              "scores when trained with decoderlab.headwatch.HeadWatch (decoderlab train --watch-heads N)"),
             (["--run", str(run_dir), "--checkpoint", str(run_dir)],
              "--run reads a run's recorded head scores; it takes no --checkpoint"),
             (["--run", str(run_dir), "--png", str(tmp_path / "no" / "x.png")],
              f"cannot write PNG {tmp_path / 'no' / 'x.png'}: directory {tmp_path / 'no'} does not exist"))
    for argv, message in cases:
        assert main(["explain", *argv]) == 2
        assert capsys.readouterr().err == f"decoderlab: error: {message}\n"
