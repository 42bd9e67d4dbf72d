"""``decoderlab patch`` (decoderlab.cli.interpret): the library's activation-patching table with the metric it
names, printed and drawn; bad input as one error line."""

from __future__ import annotations

import pytest
from tiny_models import one_thread  # noqa: F401 -- one_thread: autouse

import decoderlab as dl
from decoderlab.config import PATCH_AXES, PATCH_POINTS
from decoderlab.glassbox.patching import PATCH_BY, PATCH_OVER

from .glass_runs import check_html, check_png, one_error_line, run, save_tiny

CLEAN, CORRUPT = "abc dabc", "abc dabq"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    directory = tmp_path_factory.mktemp("patch") / "ckpt"
    return directory, *save_tiny(directory)


def test_the_choices_are_the_librarys():
    assert PATCH_POINTS == tuple(PATCH_OVER)
    assert set(PATCH_AXES) == {by for axes in PATCH_BY.values() for by in axes} | {"layer", "layer,pos"}


def test_patch_prints_the_librarys_table(ckpt, capsys, tmp_path):
    directory, model, tok = ckpt
    clean, corrupt = tok.encode(CLEAN), tok.encode(CORRUPT)
    logits = {name: dl.glassbox.run_with_hooks(model, ids, [])[0, -1] for name, ids in (("c", clean), ("x", corrupt))}
    answer, wrong = int(logits["c"].argmax()), int(logits["x"].argmax())
    assert answer != wrong  # the corruption changes the prediction: the metric is a difference
    for extra, over, by, a, w in (((), "resid_pre", "layer,pos", answer, wrong),
                                  (("--over", "attn_head"), "attn_head", "layer,head", answer, wrong),
                                  (("--over", "mlp_out", "--by", "layer", "--answer", "a", "--wrong", "b"),
                                   "mlp_out", "layer", tok.encode("a")[0], tok.encode("b")[0])):
        status, out, err = run(capsys, "patch", "--checkpoint", directory, "--clean", CLEAN, "--corrupt", CORRUPT,
                               *extra)
        assert (status, err) == (0, "")
        metric = dl.glassbox.logit_difference(a, w)
        table = dl.glassbox.activation_patching(model, clean, corrupt, metric, over=over, by=by)
        head, rest = out.split("\n", 1)
        assert rest == dl.glassbox.patching_table(table, over, by) + "\n"
        assert head == (f"metric: logit of {tok.decode([a])!r} minus logit of {tok.decode([w])!r} at the last "
                        f"position; clean run {float(logits['c'][a] - logits['c'][w]):+.4f}, corrupt run "
                        f"{float(logits['x'][a] - logits['x'][w]):+.4f}")
    # the answer as its own "wrong": the metric is the answer's logit alone
    status, out, _ = run(capsys, "patch", "--checkpoint", directory, "--clean", CLEAN, "--corrupt", CORRUPT,
                         "--answer", "a", "--wrong", "a", "--by", "layer")
    assert out.startswith("metric: logit of 'a' at the last position;")
    png, page = tmp_path / "patch.png", tmp_path / "patch.html"
    status, out, _ = run(capsys, "patch", "--checkpoint", directory, "--clean", CLEAN, "--corrupt", CORRUPT,
                         "--png", png, "--html", page)
    assert status == 0 and out.endswith(f"wrote the PNG to {png}\nwrote the HTML page to {page}\n")
    check_png(png)
    check_html(page, out.split("\nwrote the PNG")[0])


def test_patch_bad_input_is_one_error_line(ckpt, capsys):
    directory, _, _ = ckpt
    base = ("patch", "--checkpoint", directory)
    assert one_error_line(capsys, *base, "--clean", "abc", "--corrupt", "ab") == (
        "--clean is 3 tokens and --corrupt 2: patching puts each clean activation at its own position, so both "
        "must have the same number of tokens")
    assert one_error_line(capsys, *base, "--clean", "abc", "--corrupt", "abd", "--over", "attn_head", "--by",
                          "layer,pos") == ("--by 'layer,pos' is not allowed for --over 'attn_head'; allowed: "
                                           "layer,head, layer,pos,head")
    assert one_error_line(capsys, *base, "--clean", "abc", "--corrupt", "abd", "--over", "head").startswith(
        "--over: invalid choice: 'head'")
    assert one_error_line(capsys, *base, "--clean", "abc", "--corrupt", "abd", "--answer", "ab") == (
        "--answer 'ab' is 2 tokens for this tokenizer; give the text of one token")
    assert one_error_line(capsys, *base, "--clean", "ABC", "--corrupt", "abd").startswith("--clean: character 'A'")
    assert one_error_line(capsys, *base, "--clean", "abc").startswith("the following arguments are required")
