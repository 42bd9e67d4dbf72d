"""bench/glassbox_skill.py, the reading of a trained skill, on a small random chat model built here: its
logit lens, decomposition and patching tables against the model run here, in float64."""

import re
import sys
from pathlib import Path

import pytest
import torch

import decoderlab as dl
from decoderlab.chat import TEMPLATES
from decoderlab.hooks import use_hooks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import glassbox_skill as skill  # noqa: E402
from tiny_runs import one_thread  # noqa: E402,F401  (one_thread: an autouse fixture)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random 2-layer chat model on the characters of the questions, saved as a chat checkpoint."""
    tok = dl.CharTokenizer.from_text("What is 0123456789+?").add_special_tokens(TEMPLATES["decoderlab"].special_tokens)
    torch.manual_seed(0)
    cfg = dl.preset("baby-shakespeare", n_layer=2, n_head=2, d_model=32, max_len=32, num_tokens=tok.vocab_size)
    model = dl.DecoderOnlyTransformer(cfg)
    with torch.no_grad():  # sharpen it, so that the corrupted digit moves the logits clearly
        model.fc_layer.weight.mul_(4.0)
    out = tmp_path_factory.mktemp("skill") / "sft"
    dl.Model(model, tok, template="decoderlab").save(out)
    return out


def reading(checkpoint, *more):
    args = skill.parse(["--checkpoint", str(checkpoint), "--difficulty", "2", "--questions", "8", *more])
    model = dl.load(checkpoint)
    model.model.double()
    return model, skill.report(model, args)


def test_the_lens_and_the_parts_are_the_models_own_logits(checkpoint):
    model, (text, got) = reading(checkpoint)
    m = model.model
    assert got["read"]["max_error"] < 1e-9
    for q, row in zip(got["questions"], got["read"]["rows"]):
        assert len(q.positions) == len(q.answer) and model.tokenizer.decode(q.answer_ids) == q.answer
        with torch.no_grad():
            logits = m(q.ids.unsqueeze(0))[0].double()
        for k, (p, t) in enumerate(zip(q.positions, q.answer_ids)):
            assert abs(float(row["parts"][:, k].sum()) - float(logits[p, t])) < 1e-9  # DLA adds up to the logit
            assert abs(float(row["probs"][-1, k]) - float(torch.softmax(logits[p], -1)[t])) < 1e-12
            assert int(row["ranks"][-1, k]) == int((logits[p] > logits[p, t]).sum())
    assert "### 1. Logit lens" in text and "### 3. Activation patching" in text
    assert "Max |sum of parts - model's logit| over" in text


def test_patching_recovers_all_at_the_changed_digit_nothing_before_it_and_each_head_as_patched_here(checkpoint):
    model, (_, got) = reading(checkpoint)
    m, pairs, p = model.model, got["pairs"], got["patch"]
    assert len(pairs.texts) > 0
    for (clean, bad), a, b in zip(pairs.texts, pairs.clean_first, pairs.corrupt_first):
        (x, y), (x2, y2) = skill.OPERANDS.search(clean).groups(), skill.OPERANDS.search(bad).groups()
        assert y == y2 and x[1:] == x2[1:] and x[0] != x2[0] and int(a) != int(b)  # operand 1's leading digit
    changed = int(pairs.changed[0])
    assert (pairs.changed == changed).all()
    assert abs(float(p["resid"][0, changed]) - 1) < 1e-12 and p["resid"][:, :changed].abs().max() < 1e-12
    rows = torch.arange(pairs.clean.size(0))

    def metric(logits):
        return float((logits[rows, -1, pairs.clean_first] - logits[rows, -1, pairs.corrupt_first]).mean())

    with torch.no_grad():
        clean, corrupt = metric(m(pairs.clean)), metric(m(pairs.corrupt))
        assert abs(p["clean"] - clean) < 1e-12 and abs(p["corrupt"] - corrupt) < 1e-12 and clean != corrupt
        z = {}
        with use_hooks(m, [("blocks.1.attn.hook_z", lambda x, name: z.setdefault("z", x.clone()))]):
            m(pairs.clean)

        def put(x, name):
            x = x.clone()
            x[:, :, 1] = z["z"][:, :, 1]
            return x
        with use_hooks(m, [("blocks.1.attn.hook_z", put)]):
            patched = metric(m(pairs.corrupt))
    assert abs(float(p["heads"][1, 1]) - (patched - corrupt) / (clean - corrupt)) < 1e-9


def test_the_command_prints_and_writes_the_page(checkpoint, tmp_path, capsys):
    out = tmp_path / "page.md"
    assert skill.main(["--checkpoint", str(checkpoint), "--difficulty", "2", "--questions", "6", "--out",
                       str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.strip() == out.read_text().strip() and "| head output (hook_z) | H0 | H1 |" in printed
    err = float(re.search(r"Max \|sum of parts - model's logit\| over 1?\d answer tokens of 6 questions: "
                          r"(\d\.\de[+-]\d+)\.", printed).group(1))
    assert err < 1e-4  # float32, as the checkpoint runs
    tables = [block for block in printed.split("\n\n") if block.startswith("|")]
    assert len(tables) == 6 and any("<\\|user\\|>" in t for t in tables)
    for table in tables:  # every row as many cells as the header: a token's "|" (<|end|>) is escaped
        widths = {len(re.split(r"(?<!\\)\|", row)) for row in table.splitlines()}
        assert len(widths) == 1, table


def test_a_checkpoint_without_a_chat_template_is_one_error(tmp_path):
    tok = dl.CharTokenizer.from_text("What is 0123456789+?")
    torch.manual_seed(0)
    base = tmp_path / "base"
    dl.Model(dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", n_layer=1, num_tokens=tok.vocab_size)),
             tok).save(base)
    with pytest.raises(SystemExit, match="has no chat template"):
        skill.main(["--checkpoint", str(base)])


def test_bad_settings_are_one_error_line(checkpoint, tmp_path):
    with pytest.raises(SystemExit, match=r"glassbox_skill: error: .*difficult"):
        skill.main(["--checkpoint", str(checkpoint), "--difficulty", "7"])
    with pytest.raises(SystemExit, match=r"glassbox_skill: error: .*no question has a corrupted copy \(operand 2, "
                                         r"digit 3\)"):
        skill.main(["--checkpoint", str(checkpoint), "--difficulty", "2", "--operand", "2", "--digit", "3"])
    with pytest.raises(SystemExit, match=r"glassbox_skill: error: .*"):
        skill.main(["--checkpoint", str(tmp_path / "nothing")])


def test_only_correct_on_a_model_that_answers_nothing_right_says_so(checkpoint):
    model, (text, got) = reading(checkpoint)
    assert sum(bool((r["ranks"][-1] == 0).all()) for r in got["read"]["rows"]) == 0  # random weights
    assert "every answer token on top at the output: 0/8 questions." in text
    with pytest.raises(ValueError, match="answers none of the questions right"):
        reading(checkpoint, "--only-correct")
