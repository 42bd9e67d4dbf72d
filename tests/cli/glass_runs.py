"""What the tests of ``decoderlab lens``, ``heads`` and ``patch`` share: a tiny saved character model (float64,
so the tables compare exactly with the library's) and the command run in this process."""

from __future__ import annotations

import torch

import decoderlab as dl
from decoderlab.cli import main as cli_main

CHARS = "abcdefghijklmnopqrstuvwxyz ,.:"


def save_tiny(directory, n_layer: int = 2):
    """A random model of ``n_layer`` layers of 2 heads saved to ``directory``; returns (model, tokenizer) loaded
    back from it, as the command loads them."""
    torch.manual_seed(0)
    tok = dl.CharTokenizer.from_text(CHARS)
    cfg = dl.preset("baby-shakespeare", n_layer=n_layer, n_head=2, d_model=16, max_len=16, num_tokens=tok.vocab_size)
    model = dl.DecoderOnlyTransformer(cfg)
    with torch.no_grad():
        for block in model.blocks:  # heads that write a lot: ablating one changes the next token visibly
            block.attention.proj.weight.mul_(20.0)
        model.fc_layer.weight.mul_(8.0)
    dl.save_checkpoint(directory, model.eval(), tok, meta={"task": "lm"})
    model, tok = dl.load_checkpoint(directory)
    return model.eval(), tok


def run(capsys, *argv) -> tuple[int, str, str]:
    """``decoderlab ARGV`` in this process: (exit status, stdout, stderr); a parser error exits 2 as usual."""
    try:
        status = cli_main([str(a) for a in argv])
    except SystemExit as e:
        status = e.code
    out = capsys.readouterr()
    return status, out.out, out.err


def one_error_line(capsys, *argv) -> str:
    """The command fails with exit status 2 and one ``decoderlab: error:`` line (no traceback): its text."""
    status, out, err = run(capsys, *argv)
    assert status == 2 and out == "", (status, out, err)
    assert err.startswith("decoderlab: error: ") and err.endswith("\n") and err.count("\n") == 1, err
    return err[len("decoderlab: error: "):-1]


def check_png(path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def check_html(path, text: str) -> None:
    import html

    page = path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "data:image/png;base64," in page
    assert html.escape(text) in page  # the table printed, in the page
    assert "http://" not in page and "https://" not in page  # self-contained
