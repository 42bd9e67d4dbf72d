"""``explain``: the story of one forward pass as text, PNG and HTML, from the library and the command line."""

import re

import numpy as np
import pytest

import decoderlab as dl
from decoderlab.cli import main as cli_main

from .models import PNG_MAGIC, matrix_after, small_model


def test_explain_a_larger_model_shows_percents_per_head_and_top_tokens():
    m = small_model("baby-shakespeare")
    text = dl.explain(m, list(range(6)), layer=1)
    assert text.count("attention percents") == 4 and text.count("--- layer 1, head") == 4
    assert "Wqᵀ" not in text  # the full matrices are for small models only
    assert "top next-token probabilities" in text and "after 5@5" in text
    with pytest.raises(ValueError, match=r"valid heads are 0 \.\. 3"):
        dl.explain(m, [1, 2], head=7)


# ---------------------------------------------------------------------------------------------------------
# the trained StatQuest model, explained and drawn
# ---------------------------------------------------------------------------------------------------------


def test_explain_the_trained_statquest_model(statquest_checkpoint, tmp_path, capsys):
    png, html = tmp_path / "att.png", tmp_path / "report.html"
    assert cli_main(["explain", "--checkpoint", str(statquest_checkpoint), "what is statquest <EOS>",
                     "--png", str(png), "--html", str(html)]) == 0
    text = capsys.readouterr().out
    # every matrix, with token labels, for the d_model=2 model
    for title in ("word embeddings", "position encodings", "Wqᵀ", "Q (queries)", "similarities Q Kᵀ",
                  "scaled similarities", "attention percents", "head output", "logits"):
        assert title in text, title
    pct = matrix_after(text, "attention percents", 4)
    assert np.isnan(pct[0, 1:]).all() and not np.isnan(pct[3]).any()  # the causal mask, printed as '-'
    eos_row = pct[3]
    assert len(eos_row) == 4 and abs(eos_row.sum() - 1) < 2e-4
    attends = re.search(r"^<EOS>@3 attends to: (.*)$", text, re.M).group(1)
    assert attends.startswith(("what@0", "is@1", "statquest@2", "<EOS>@3"))
    assert "=> the top next token after '<EOS>' is 'awesome'" in text
    assert re.search(r"after <EOS>@3: awesome 0\.9", text)
    assert "(ok;" in text  # the float64 check of the whole pass
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    page = html.read_text(encoding="utf-8")
    assert not re.search(r"https?://", page)
    assert "<table" in page and "data:image/png;base64," in page and "awesome" in page and "&lt;EOS&gt;@3" in page


def test_explain_bad_inputs(statquest_checkpoint, tmp_path, capsys):
    ckpt = str(statquest_checkpoint)
    # a word the tokenizer does not know
    model, tok = dl.load_checkpoint(ckpt)
    with pytest.raises(KeyError, match="bam"):
        dl.trace(model, "what is bam", tokenizer=tok)
    assert cli_main(["explain", "--checkpoint", ckpt, "what is bam"]) == 2
    assert "'bam'" in capsys.readouterr().err
    # layer / head out of range
    assert cli_main(["explain", "--checkpoint", ckpt, "what is", "--layer", "1"]) == 2
    assert "valid layers are 0 .. 0" in capsys.readouterr().err
    assert cli_main(["explain", "--checkpoint", ckpt, "what is", "--head", "1"]) == 2
    assert "valid heads are 0 .. 0" in capsys.readouterr().err
    # --png into a directory that does not exist: named, exit 2, nothing written (not even the HTML)
    missing = tmp_path / "no" / "such"
    html = tmp_path / "r.html"
    assert cli_main(["explain", "--checkpoint", ckpt, "what is", "--png", str(missing / "a.png"),
                     "--html", str(html)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "does not exist" in err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError, match="does not exist"):
        dl.explain(model, "what is", tokenizer=tok, html=missing / "r.html")
    # text without a tokenizer
    with pytest.raises(ValueError, match="needs a tokenizer"):
        dl.trace(model, "what is")


def test_cli_explain_says_which_files_it_wrote(statquest_checkpoint, tmp_path, decoderlab_cli):
    r = decoderlab_cli("explain", "--checkpoint", statquest_checkpoint, "what is statquest <EOS>", "--png", "a.png",
                       "--html", "report.html", cwd=tmp_path)
    assert (r.returncode, r.stderr) == (0, "")
    assert r.stdout.splitlines()[-2:] == ["wrote the PNG to a.png", "wrote the HTML page to report.html"]
    assert (tmp_path / "a.png").stat().st_size > 0 and (tmp_path / "report.html").stat().st_size > 0



def test_explain_labels_a_token_with_a_leading_space_as_it_reads(tmp_path, capsys):
    """SmolLM2's "The capital of France is" ended "=> the top next token after  is is  Paris": the tokens' leading
    spaces ran into the sentence, which read as a doubled token. Now every space of a label is ␣ and the sentence
    quotes each token."""
    from tiny_models import bigram_model

    from decoderlab.tokenizers import BPETokenizer

    tok = BPETokenizer.train(["the cat sat on the mat " * 200], 270)
    (the, cat), (sat,) = tok.encode("the cat"), tok.encode(" sat")
    assert tok.tokens([cat, sat]) == [" cat", " sat"]
    dl.save_checkpoint(tmp_path / "c", bigram_model(tok.vocab_size, {cat: sat}), tok, meta={"task": "lm"})
    assert cli_main(["explain", "--checkpoint", str(tmp_path / "c"), "the cat"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"Input: the ␣cat   (2 tokens, ids [{the}, {cat}])")
    assert re.search(r"^  after ␣cat@1: ␣sat 0\.\d+", text, re.M)
    assert re.search(r"^=> the top next token after ' cat' is ' sat' \(p = 0\.\d+\)$", text, re.M)
