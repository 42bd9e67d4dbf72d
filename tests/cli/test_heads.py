"""``decoderlab heads`` (decoderlab.cli.interpret): the detectors' scores, the composition scores and a head's
ablation as the library computes them, printed and drawn; bad input (an unknown head, a head out of range, one
layer for composition) as one error line."""

from __future__ import annotations

import pytest
import torch
from tiny_models import one_thread  # noqa: F401 -- one_thread: autouse

import decoderlab as dl
from decoderlab.config import HEAD_DETECTORS
from decoderlab.glassbox.watching import probe_tokens

from .glass_runs import check_html, check_png, one_error_line, run, save_tiny

TEXT = "abcabcab"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    directory = tmp_path_factory.mktemp("heads") / "ckpt"
    return directory, *save_tiny(directory)


def test_the_detector_names_are_the_glassbox_kinds():
    assert HEAD_DETECTORS == dl.glassbox.KINDS


def test_heads_prints_the_detectors_scores_on_the_text_and_on_the_probe(ckpt, capsys, tmp_path):
    directory, model, tok = ckpt
    for extra, on, ids in (((TEXT,), "this text", tok.encode(TEXT)), ((), "random tokens repeated twice",
                                                                      probe_tokens(model))):
        status, out, err = run(capsys, "heads", "--checkpoint", directory, *extra)
        assert (status, err) == (0, "")
        want = dl.glassbox.all_head_scores(model, ids)
        assert out == f"head detector scores on {on}:\n" + dl.glassbox.scores_table(want) + "\n"
    png, page = tmp_path / "heads.png", tmp_path / "heads.html"
    status, out, _ = run(capsys, "heads", "--checkpoint", directory, TEXT, "--png", png, "--html", page)
    assert status == 0 and out.endswith(f"wrote the PNG to {png}\nwrote the HTML page to {page}\n")
    check_png(png)
    check_html(page, out.split("\nwrote the PNG")[0])


def test_composition_lists_the_strongest_scores(ckpt, capsys):
    directory, model, _ = ckpt
    status, out, _ = run(capsys, "heads", "--checkpoint", directory, "--composition")
    assert status == 0
    lines = out.split("top 10:\n")[1].splitlines()
    assert len(lines) == 10
    scores = {mode: dl.glassbox.composition_scores(model, mode) for mode in "QKV"}
    values = []
    for line in lines:  # "  L0H1 -> L1H0  K  0.272"
        a, _, b, mode, value = line.split()
        la, ha = map(int, a[1:].split("H"))
        lb, hb = map(int, b[1:].split("H"))
        assert la < lb and abs(float(value) - float(scores[mode][la, ha, lb, hb])) < 5e-4
        values.append(float(value))
    assert values == sorted(values, reverse=True)
    everything = sorted((float(v) for s in scores.values() for v in s[s > 0]), reverse=True)
    assert abs(values[0] - everything[0]) < 5e-4  # the strongest of all is listed first


def test_ablating_heads_shows_the_librarys_next_token_change(ckpt, capsys):
    directory, model, tok = ckpt
    ids = tok.encode(TEXT)
    heads = [(1, 0), (0, 1)]
    status, out, _ = run(capsys, "heads", "--checkpoint", directory, TEXT, "--ablate", "L1H0", "--ablate", "l0h1",
                         "--top-k", "3")
    assert status == 0
    hooks = [dl.glassbox.zero_ablation(model, f"blocks.{layer}.attn.hook_z", head=h) for layer, h in heads]
    after = torch.softmax(dl.glassbox.run_with_hooks(model, ids, hooks)[0, -1], -1)
    with torch.no_grad():
        before = torch.softmax(model(torch.tensor(ids))[-1], -1)
    block = out.split("next token with L1H0, L0H1 ablated")[1].splitlines()
    kl = float((before * (before.log() - after.log())).sum())
    assert f"KL(clean || ablated) = {kl:.6f} nats" in block[0]
    rows = block[2:]
    shown = set(before.topk(3).indices.tolist()) | set(after.topk(3).indices.tolist())
    assert {tok.encode(eval(r.rsplit(maxsplit=3)[0]))[0] for r in rows} == shown  # noqa: S307 -- the repr printed
    for r in rows:
        token, b, a, change = r.rsplit(maxsplit=3)
        i = tok.encode(eval(token))[0]  # noqa: S307
        assert abs(float(b) - float(before[i])) < 1e-4 and abs(float(a) - float(after[i])) < 1e-4
        assert abs(float(change) - float(after[i] - before[i])) < 1e-4
    assert max(abs(float(r.split()[-1])) for r in rows) > 1e-3  # the ablation moved the distribution


def test_heads_bad_input_is_one_error_line(ckpt, capsys, tmp_path):
    directory, _, _ = ckpt
    base = ("heads", "--checkpoint", directory)
    assert one_error_line(capsys, *base, TEXT, "--ablate", "L2H0") == (
        "--ablate L2H0: this model has no such head; layers are 0 .. 1, heads 0 .. 1")
    assert one_error_line(capsys, *base, TEXT, "--ablate", "L0H5") == (
        "--ablate L0H5: this model has no such head; layers are 0 .. 1, heads 0 .. 1")
    assert one_error_line(capsys, *base, TEXT, "--ablate", "head3") == (
        "--ablate must be a head written L<layer>H<head>, such as L0H1; got 'head3' (see decoderlab heads --help)")
    assert one_error_line(capsys, *base, "--ablate", "L0H0").startswith("--ablate needs a TEXT")
    assert one_error_line(capsys, *base, "a").startswith("the text is one token")
    one_layer = tmp_path / "one"
    save_tiny(one_layer, n_layer=1)
    assert one_error_line(capsys, "heads", "--checkpoint", one_layer, "--composition") == (
        "composition scores need a model with at least 2 layers (heads of an earlier layer read by a later one); "
        "this model has n_layer=1")
    assert "does not exist" in one_error_line(capsys, "heads", "--checkpoint", tmp_path / "nothing")
