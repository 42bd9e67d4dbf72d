"""``decoderlab lens`` (decoderlab.cli.interpret): the logit lens and the decomposition the library computes,
printed and drawn; bad input as one error line."""

from __future__ import annotations

import pytest
from tiny_models import one_thread  # noqa: F401 -- one_thread: autouse

import decoderlab as dl

from .glass_runs import check_html, check_png, one_error_line, run, save_tiny

TEXT = "abc dabc d"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lens") / "ckpt"
    return directory, *save_tiny(directory)


def test_lens_prints_the_librarys_lens_and_decomposition(ckpt, capsys, tmp_path):
    directory, model, tok = ckpt
    _, cache = dl.glassbox.run_with_cache(model, tok.encode(TEXT))
    lens = dl.glassbox.logit_lens(cache)
    for extra, at, token in (((), 9, None), (("--pos", "3", "--top-k", "2"), 3, None),
                             (("--pos", "-2", "--token", "z"), 8, tok.encode("z")[0])):
        k = 2 if "--top-k" in extra else dl.config.EXPLAIN_TOP_K
        status, out, err = run(capsys, "lens", "--checkpoint", directory, TEXT, *extra)
        assert (status, err) == (0, "")
        want_token = int(cache.logits[0, at].argmax()) if token is None else token
        dec = dl.glassbox.decompose(cache, at, want_token)
        assert out == lens.table(position=at, k=k, tokenizer=tok) + "\n\n" + dec.table(tok) + "\n"
        # the parts printed add up to the logit printed
        parts = out.split("by part:\n")[1].splitlines()
        values = [float(line.split()[-1]) for line in parts[:-1]]
        assert len(values) == len(dec.labels)
        assert abs(sum(values) - float(dec.logit)) < 1e-5 and f"(model's logit {float(dec.logit):+.6f})" in parts[-1]
    png, page = tmp_path / "lens.png", tmp_path / "lens.html"
    status, out, _ = run(capsys, "lens", "--checkpoint", directory, TEXT, "--png", png, "--html", page)
    assert status == 0 and out.endswith(f"wrote the PNG to {png}\nwrote the HTML page to {page}\n")
    check_png(png)
    check_html(page, out.split("\nwrote the PNG")[0])


def test_lens_bad_input_is_one_error_line(ckpt, capsys, tmp_path):
    directory, _, _ = ckpt
    base = ("lens", "--checkpoint", directory)
    assert one_error_line(capsys, *base, "abc", "--pos", "3") == (
        "--pos 3 is outside the sequence; valid positions are 0 .. 2 (or -3 .. -1 from the end)")
    assert "--pos" in one_error_line(capsys, *base, "abc", "--pos", "-4")
    assert one_error_line(capsys, *base, "abc", "--token", "xy") == (
        "--token 'xy' is 2 tokens for this tokenizer; give the text of one token")
    assert one_error_line(capsys, *base, "") == "the text is empty: give at least one token of text"
    # refused before the model is read: a checkpoint that is not there is not what the error names
    assert one_error_line(capsys, "lens", "--checkpoint", tmp_path / "absent", "") == (
        "the text is empty: give at least one token of text")
    assert one_error_line(capsys, "patch", "--checkpoint", tmp_path / "absent", "--clean", "ab", "--corrupt", "") == (
        "--corrupt is empty: give at least one token of text")
    assert one_error_line(capsys, *base, "ABC").startswith("the text: character 'A'")
    assert "16" in one_error_line(capsys, *base, "a" * 17)  # longer than max_len
    assert one_error_line(capsys, *base, "abc", "--top-k", "0").startswith("--top-k must be >= 1")
    assert "does not exist" in one_error_line(capsys, *base, "abc", "--png", tmp_path / "no" / "x.png")
    assert not (tmp_path / "no").exists()
