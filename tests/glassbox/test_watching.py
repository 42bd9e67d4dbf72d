"""Head-score records of a watched run: written, read back, when each head formed, and drawn."""

import json

import pytest
import torch

from decoderlab.glassbox import plotting
from decoderlab.glassbox.watching import (WATCH_FILE, append_record, formation_steps, probe_tokens, read_records,
                                          score_record, watch_table)

from .models import PNG_MAGIC, variant_model


def _records(tmp_path):
    """Three records of a 2-layer, 2-head run in which L1H0 crosses 0.3 at step 20."""
    for step, loss, score in ((0, None, 0.05), (10, 3.4, 0.2), (20, 2.1, 0.45)):
        scores = {kind: [[0.1, 0.1], [score, 0.02]] for kind in ("previous_token", "duplicate_token", "induction")}
        append_record(tmp_path, {"step": step, "loss": loss, "scores": scores})
    return read_records(tmp_path)


def test_records_round_trip_and_say_when_a_head_formed(tmp_path):
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [0, 10, 20] and records[0]["loss"] is None
    assert len((tmp_path / WATCH_FILE).read_text().splitlines()) == 3
    assert formation_steps(records) == {(0, 0): None, (0, 1): None, (1, 0): 20, (1, 1): None}
    assert formation_steps(records, threshold=0.15)[(1, 0)] == 10
    table = watch_table(records)
    assert table.splitlines()[1:3] == ["  head      first    last  formed", "  L0H0      0.100   0.100  -"]
    assert "  L1H0      0.050   0.450  20" in table.splitlines() and table.splitlines()[-1] == (
        "loss 3.4000 at step 10 -> 2.1000 at step 20")
    assert read_records(tmp_path / WATCH_FILE) == records


def test_the_head_scores_plot_is_a_png(tmp_path):
    records = _records(tmp_path)
    path = plotting.save_head_scores_png(records, tmp_path / "heads.png")
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000
    with pytest.raises(FileNotFoundError, match="does not exist"):
        plotting.save_head_scores_png(records, tmp_path / "no" / "heads.png")


def test_a_record_of_a_real_model(tmp_path):
    m = variant_model("attention-only", dtype=torch.float32)
    probe = probe_tokens(m, batch=2)
    assert probe.shape == (2, 12) and torch.equal(probe[:, :6], probe[:, 6:])
    rec = score_record(m, probe, 5, 2.5)
    assert rec["step"] == 5 and rec["loss"] == 2.5
    assert {k: (len(v), len(v[0])) for k, v in rec["scores"].items()} == {
        "previous_token": (2, 4), "duplicate_token": (2, 4), "induction": (2, 4)}
    json.dumps(rec, allow_nan=False)


def test_bad_record_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"head_scores.jsonl does not exist: a run records head scores when "
                                                r"trained with decoderlab.headwatch.HeadWatch"):
        read_records(tmp_path)
    (tmp_path / WATCH_FILE).write_text('{"step": 0, "scores": {}}\nnot json\n')
    with pytest.raises(ValueError, match=r"head_scores.jsonl line 2 is not a head-score record: 'not json'"):
        read_records(tmp_path)
    with pytest.raises(ValueError, match="unknown head detector 'copy'"):
        formation_steps([{"step": 0, "scores": {}}], kind="copy")
