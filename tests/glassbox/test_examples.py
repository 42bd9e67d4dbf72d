"""The worked examples of ``decoderlab explain --example``: the articles' and the lesson's numbers, every step
checked by hand."""

import math
import re

import numpy as np
import pytest
import torch

import decoderlab as dl
from decoderlab import glassbox as gb
from decoderlab.cli import main as cli_main

from .models import LESSON_OUT, hand_checks, matrix_after, vec


def test_self_attention_101_prints_the_articles_numbers_and_the_scaled_ones(capsys):
    assert cli_main(["explain", "--example", "self-attention-101"]) == 0
    text = capsys.readouterr().out
    rows = {}
    for m in re.finditer(r"^([ABC]): scores (\[[^\]]*\])  weights (\[[^\]]*\])  output (\[[^\]]*\])"
                         r"  \| scaled: weights (\[[^\]]*\])  output (\[[^\]]*\])", text, re.M):
        rows[m.group(1)] = [vec(g) for g in m.groups()[1:]]
    assert set(rows) == {"A", "B", "C"}
    # the article: scores A [1, 0, 1], B [0, 1, 1], C [1, 1, 2]; A's weights [0.42, 0.16, 0.42] -> [0.84, 0.58]
    assert [rows[n][0] for n in "ABC"] == [[1, 0, 1], [0, 1, 1], [1, 1, 2]]
    assert [round(x, 2) for x in rows["A"][1]] == [0.42, 0.16, 0.42]
    assert [round(x, 2) for x in rows["A"][2]] == [0.84, 0.58]
    # B's and C's rows, and the scaled ones, from the definition with math.exp
    X = [[1, 0], [0, 1], [1, 1]]
    for i, n in enumerate("ABC"):
        for scale, w_idx, o_idx in ((1.0, 1, 2), (math.sqrt(2), 3, 4)):
            e = [math.exp(s / scale) for s in rows[n][0]]
            w = [x / sum(e) for x in e]
            out = [sum(w[j] * X[j][c] for j in range(3)) for c in range(2)]
            assert rows[n][w_idx] == pytest.approx(w, abs=6e-5)
            assert rows[n][o_idx] == pytest.approx(out, abs=6e-5)
    assert max(hand_checks(text)) < 1e-6


def test_statquest_self_attention_example_has_the_lessons_output_and_every_step_checked(capsys):
    assert cli_main(["explain", "--example", "statquest-self-attention"]) == 0
    text = capsys.readouterr().out
    enc = matrix_after(text, "encodings matrix", 3)
    assert enc.tolist() == [[1.16, 0.23], [0.57, 1.36], [4.41, -2.16]]
    out = matrix_after(text, "output = attention percents V", 3)
    assert np.abs(out - np.array(LESSON_OUT)).max() <= 5e-5
    # the printed weights are the lesson's (seed 42) and the printed Q is encodings @ Wqᵀ
    torch.manual_seed(42)
    sa = dl.SelfAttention(d_model=2, row_dim=0, col_dim=1)
    wq = matrix_after(text, "Wqᵀ", 2)
    assert np.abs(wq - sa.W_q.weight.detach().numpy().T).max() <= 5e-5
    q = matrix_after(text, "Q = encodings", 3)
    assert np.abs(q - enc @ wq).max() <= 5e-4  # from the printed (rounded) weights
    pct = matrix_after(text, "attention percents", 3)
    assert np.allclose(pct.sum(axis=1), 1, atol=2e-4)
    checks = hand_checks(text)
    assert len(checks) == 10 and max(checks) < 1e-6  # Wq, Wk, Wv, Q, K, V, sims, scaled, percents, output


def test_position_encoding_example(capsys):
    assert cli_main(["explain", "--example", "position-encoding"]) == 0
    text = capsys.readouterr().out
    d4 = matrix_after(text, "decoderlab.PositionEncoding(d_model=4", 2)
    assert d4[0].tolist() == [0, 1, 0, 1]
    assert d4[1] == pytest.approx([math.sin(1), math.cos(1), math.sin(0.01), math.cos(0.01)], abs=6e-5)
    d2 = matrix_after(text, "decoderlab.PositionEncoding(d_model=2", 3)
    assert d2 == pytest.approx(np.array([[math.sin(p), math.cos(p)] for p in range(3)]), abs=6e-5)
    assert max(hand_checks(text)) < 1e-6


def test_unknown_example_lists_the_known_ones(capsys):
    with pytest.raises(ValueError, match="known examples: self-attention-101, statquest-self-attention"):
        gb.explain_example("flash-attention")
    assert cli_main(["explain", "--example", "flash-attention"]) == 2
    assert "position-encoding" in capsys.readouterr().err


def test_position_encoding_example_rounds_text_and_table_alike(capsys):
    """cos(1/100) = 0.99995: the text said 1.0000 while the table said 0.9999."""
    assert cli_main(["explain", "--example", "position-encoding"]) == 0
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("pos 1: i = 0"))
    said = re.findall(r"= (-?\d+\.\d+)", line)
    row = next(ln for ln in text.splitlines() if ln.startswith("pos 1") and "i =" not in ln)
    assert said == row.split()[2:] == ["0.84147", "0.54030", "0.01000", "0.99995"]

