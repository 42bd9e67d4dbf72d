"""examples/induction_heads.py, the induction-head demo of docs/glassbox.md, runs end to end (a short run)."""

import runpy
from pathlib import Path

import pytest

from decoderlab.glassbox.watching import read_records

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "induction_heads.py"


@pytest.mark.slow
def test_the_induction_demo_writes_its_records_and_plot(tmp_path, capsys):
    main = runpy.run_path(str(EXAMPLE))["main"]
    assert main(["--steps", "30", "--every", "10", "--out", str(tmp_path / "run"), "--png", str(tmp_path / "i.png")]) == 0
    assert [r["step"] for r in read_records(tmp_path / "run")] == [0, 10, 20, 30]
    assert (tmp_path / "i.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "induction scores over 4 records" in out and f"wrote {tmp_path / 'i.png'}" in out
