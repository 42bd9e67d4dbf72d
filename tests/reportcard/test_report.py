"""The report card: a tiny recipe run (every stage, seconds of training) writes report.md with a column per stage
and a row per task, and card.json with each question's outcome; those outcomes equal an independent scoring of
the same checkpoints -- replies generated here one question at a time (greedy, and each sample with its seed),
scored by this file's own rules -- and the markdown's numbers equal those recomputed from the outcomes (scipy's
Wilson interval where it is installed). Bad input is one error line naming the value and what is allowed."""

import json
import re
import sys
import time
from decimal import Decimal
from pathlib import Path

import pytest
import torch

import decoderlab as dl
from decoderlab.chat import get_template, load_model
from decoderlab.reportcard import STAGES, STORY, held_out, report, row_label
from decoderlab.reportcard.scoring import max_new_tokens, sample_seed
from decoderlab.reportcard.stats import wilson

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "bench"))
    import recipe

    out = tmp_path_factory.mktemp("recipe") / "run"
    torch.set_num_threads(1)
    assert recipe.main(["--tiny", "--out", str(out), "--threads", "1", "--rl-rows", "addition:4,countdown:1"]) == 0
    return out


def last_number(text):
    found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return Decimal(found[-1].replace(",", "")) if found else None


def countdown_solved(question, reply):
    """This file's own countdown check: each line 'a op b = c', true in Python's integers, on numbers the reply
    has; the last number left is the target."""
    target, numbers = re.fullmatch(r"Make (\d+) from ([\d, ]+)\.", question).groups()
    pool, lines = [int(x) for x in numbers.split(", ")], [x.strip() for x in reply.strip().split("\n") if x.strip()]
    for line in lines:
        m = re.fullmatch(r"(\d+) ([-+*/]) (\d+) = (\d+)", line)
        if not m:
            return False
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None}[op]
        if value != c or c <= 0 or a not in pool:
            return False
        pool.remove(a)
        if b not in pool:
            return False
        pool.remove(b)
        pool.append(c)
    return bool(lines) and pool == [int(target)]


def right(item, reply):
    if item.reward == "number":
        return int(last_number(reply) == last_number(item.answer))  # a scratchpad: its final number
    if item.reward == "exact":
        return int(reply.strip() == item.answer)
    return int(countdown_solved(item.question, reply))


def my_reply(model, tok, template, question, n, **sampling):
    if template is None:
        ids = dl.generate(model, tok.encode(question + "\n"), n, temperature=0, tokenizer=tok)
        return tok.decode(ids).strip().split("\n")[0]
    ids, _ = template.render([{"role": "user", "content": question}], tok, add_generation_prompt=True)
    eot, tc = template.end_of_turn_id(tok), template.tool_call_id(tok)
    out = dl.generate(model, ids, min(n, model.config.max_len - len(ids)), tokenizer=tok, logit_bias={tc: -100.0},
                      stop=[eot], **({"temperature": 0} | sampling))
    return tok.decode([i for i in out if i != eot])


def cell(md, label, column):
    line = re.search(rf"^\| {re.escape(label)} \|(.*)$", md, re.M)[1]
    return line.split("|")[column].strip()


@pytest.mark.slow
def test_the_card_equals_an_independent_scoring_of_its_checkpoints(tiny_run):
    md = (tiny_run / "report.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| task | n |"))
    assert [c.strip() for c in header.strip("|").split("|")][2:] == list(STAGES)
    card = json.loads((tiny_run / "card.json").read_text())
    k = card["samples"]
    assert (tiny_run / "report.png").stat().st_size > 1000 and k == 2
    rows = list(held_out(card["questions"]).items())
    for s, stage in enumerate(STAGES):
        model, tok, template, _ = load_model(tiny_run / stage)
        # every row in every other stage (each row and stage at least once; all of them took ~30 s of the suite)
        for (skill, d), items in rows[s % 2::2]:
            label, cap = row_label(skill, d), max_new_tokens(skill)
            got = card["scores"][stage][label]["off"]
            mine = [my_reply(model, tok, template, i.question, cap) for i in items]
            assert mine == got["replies"], (stage, label)
            outcomes = [right(i, r) for i, r in zip(items, mine)]
            assert outcomes == got["right"], (stage, label)
            lo, hi = wilson(sum(outcomes), len(outcomes))
            try:
                from scipy.stats import binomtest

                ci = binomtest(sum(outcomes), len(outcomes)).proportion_ci(method="wilson")
                lo, hi = ci.low, ci.high
            except ImportError:
                pass
            shown = cell(md, label, 1 + STAGES.index(stage))
            assert shown == f"{100 * sum(outcomes) / len(outcomes):.0f}% [{100 * lo:.0f}, {100 * hi:.0f}]"
            if template is None:
                assert "sample_right" not in got
                continue
            if skill not in ("addition", "countdown", "multiplication_work"):  # (time: a sample at a time)
                continue
            samples = [sum(right(i, my_reply(model, tok, template, i.question, cap, temperature=1.0,
                                             seed=sample_seed(i.question, j))) for j in range(k)) for i in items]
            assert samples == got["sample_right"], (stage, label)
    assert STORY and "story prompt" in md


@pytest.mark.slow
def test_the_report_command_rescores_a_run_and_names_bad_input(tiny_run, decoderlab_cli):
    r = decoderlab_cli("report", tiny_run, "--questions", "2", "--samples", "1", "--rows", "addition:3",
                       "--stages", "sft,rl", "--threads", "1")
    assert r.returncode == 0, r.stderr
    card = json.loads((tiny_run / "card.json").read_text())
    assert card["stages"] == ["sft", "rl"] and [row["label"] for row in card["rows"]] == ["addition 3-digit"]
    assert card["questions"] == 2 and card["samples"] == 1


@pytest.mark.parametrize("args,message", [
    (["--questions", "0"], "--questions must be >= 1, got 0"),
    (["--samples", "0"], "--samples must be >= 1, got 0"),
    (["--rows", "addition:3,algebra:1"], "--rows: a row is skill:difficulty (such as addition:4), got 'algebra:1'; "
                                         "skills (difficulties): addition (1/2/3/4)"),
    (["--stages", "sft,rl"], "holds no rl stage (rl/config.json); it holds: sft"),
    (["--stages", "final"], "unknown stage 'final'; stages: base, sft, control, rl"),
])
def test_bad_input_is_one_error_line(tmp_path, decoderlab_cli, args, message):
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "config.json").write_text("{}")
    r = decoderlab_cli("report", tmp_path, *args)
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.splitlines()
    assert line.startswith("decoderlab: error: ") and message in line, line


def test_a_directory_that_is_not_a_run_is_one_error_line(tmp_path, decoderlab_cli):
    (tmp_path / "notes.txt").write_text("hi")
    r = decoderlab_cli("report", tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.splitlines()
    assert line == (f"decoderlab: error: {tmp_path} is not a recipe run: it holds none of the stage checkpoints "
                    f"base/, sft/, control/, rl/ (bench/recipe.py writes them)")
    with pytest.raises(ValueError, match="not a recipe run"):
        report(tmp_path)
    with pytest.raises(ValueError, match="questions must be an integer >= 1"):
        report(tmp_path, questions=0)
    with pytest.raises(ValueError, match="samples must be an integer >= 0"):
        report(tmp_path, samples=-1)
    assert get_template("tools").has_tools


def test_a_checkpoint_with_a_jinja_template_scores_as_with_the_built_in_one(tmp_path):
    """The card reads a checkpoint's template whatever its kind: decoderlab's template stored as Jinja (as a
    Hugging Face directory carries it) scores the same replies as the built-in one."""
    import string

    from decoderlab.chat import TEMPLATES, JinjaChatTemplate, add_chat_tokens, chat_template_jinja
    from decoderlab.checkpoint import save_checkpoint
    from decoderlab.reportcard import ROWS, score_stage

    builtin = TEMPLATES["decoderlab"]
    torch.manual_seed(0)
    _, tok, _ = add_chat_tokens(None, dl.CharTokenizer(set(string.printable)), builtin)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=16,
                                                n_layer=1, n_head=2, max_len=96))
    for name, template in (("b", builtin), ("j", JinjaChatTemplate(chat_template_jinja(builtin)))):
        save_checkpoint(tmp_path / name, model, tok, meta={"task": "chat", "chat_template": template.to_dict()})
    scores = [score_stage(tmp_path / name, questions_per_row=1, rows=ROWS[:2], samples=1) for name in ("b", "j")]
    assert scores[0] == scores[1] and scores[0]["story"]["reply"]


def test_unasked_work_asks_the_plain_question_of_the_same_split_and_answers_with_the_work():
    """The recipe's last SFT phase: a work form's item asked without " Show your work." -- the plain question,
    in the item's own split (the problem is the same), answered with the whole work."""
    sys.path.insert(0, str(ROOT / "bench"))
    import recipe

    from decoderlab.tasks import generate
    from decoderlab.tasks.make import split_of

    for skill, d in (("multiplication_work", 2), ("letter_count_work", 3)):
        for item in generate(skill, "train", 20, seed=3, difficulty=d):
            user, reply = recipe.unasked(item)
            assert user["content"] + " Show your work." == item.question and not user["content"].endswith("work.")
            assert split_of(user["content"]) == "train" and reply == {"role": "assistant", "content": item.answer}
            assert "\n" in reply["content"] and reply["content"].startswith(item.answer.split("\n")[0])
    convs = recipe.phase_conversations((("letter_count_work", 3, .5, "unasked"),), .5, 8, seed=0)
    plain = [c for c in convs if "\nAnswer: " in c[-1]["content"] and not c[0]["content"].endswith("work.")]
    assert len(convs) == 8 and len(plain) == 4  # half the phase, the rest the (here story-only) replayed mix


def test_the_phases_run_in_turn_each_from_the_one_before_up_to_stop_after(tmp_path, monkeypatch):
    """SFT's phases run once each, in order, each from the checkpoint the one before wrote (the first from the
    base), each on its own data order; ``--stop-after sft-phaseK`` ends after phase K."""
    sys.path.insert(0, str(ROOT / "bench"))
    import recipe

    import decoderlab.finetuning

    runs = []

    def fake_finetune(convs, *, checkpoint, out, **kwargs):
        Path(out).mkdir(parents=True)
        runs.append((Path(out).name, Path(checkpoint).name, convs))

    monkeypatch.setattr(decoderlab.finetuning, "finetune", fake_finetune)
    phases = ((2, (("addition_work", 3, .9),), .1), (2, (("subtraction_work", 3, .9),), .1),
              (2, (("addition", 3, .5),), .5))
    monkeypatch.setattr(recipe, "phases_of", lambda args: phases)
    recipe.sft(recipe.parse(["--out", str(tmp_path / "a"), "--sft-batch", "4"]), tmp_path / "a")
    assert [r[:2] for r in runs] == [("sft-phase0", "base"), ("sft-phase1", "sft-phase0"), ("sft", "sft-phase1")]
    assert runs[0][2] != recipe.phase_conversations(*phases[0][1:], 8, seed=1)  # phase k: data order k
    assert runs[0][2] == recipe.phase_conversations(*phases[0][1:], 8, seed=0)
    runs.clear()
    recipe.sft(recipe.parse(["--out", str(tmp_path / "b"), "--sft-batch", "4", "--stop-after", "sft-phase0"]),
               tmp_path / "b")
    assert [r[:2] for r in runs] == [("sft-phase0", "base")]


@pytest.mark.slow
def test_the_phase_rows_are_scored_on_the_cards_held_out_questions(tiny_run):
    """``--stop-after``'s count is the phase model's greedy right answers on the card's held-out questions of its
    row -- scored here one question at a time by this file's own rules --, with its Wilson interval."""
    sys.path.insert(0, str(ROOT / "bench"))
    import recipe

    skill, difficulty = recipe.CHECKS[0]
    items = held_out(3, [(skill, difficulty)])[(skill, difficulty)]
    model, tok, template, _ = load_model(tiny_run / "sft-phase0")
    count = sum(right(i, my_reply(model, tok, template, i.question, max_new_tokens(skill))) for i in items)
    args = recipe.parse(["--tiny", "--out", str(tiny_run), "--stop-after", "sft-phase0"])
    rows = recipe.phase_rows(args, tiny_run)
    low, high = wilson(count, 3)
    assert rows == {row_label(skill, difficulty): {"right": count, "n": 3, "low": round(low, 4),
                                                   "high": round(high, 4)}}


def test_stop_after_ends_the_run_early_and_scores_the_phase_rows(tmp_path):
    """``--stop-after sft-phase0`` runs the base and the first phase only, then scores its ``CHECKS`` row on the
    card's held-out questions (the phases' 5-seed measurement); a stage the run has not is refused, naming them,
    before anything runs."""
    sys.path.insert(0, str(ROOT / "bench"))
    import recipe

    out = tmp_path / "run"
    assert recipe.main(["--tiny", "--out", str(out), "--threads", "1", "--stop-after", "sft-phase0"]) == 0
    record = json.loads((out / "recipe.json").read_text())
    assert (out / "sft-phase0").is_dir() and not (out / "sft").exists()
    assert set(record["stages"]) == {"base", "sft", "score"}
    label = row_label(*recipe.CHECKS[0])
    assert list(record["rows"]) == [label] and record["rows"][label]["n"] == recipe.TINY["questions"]
    assert 0 <= record["rows"][label]["low"] <= record["rows"][label]["right"] / 3 <= record["rows"][label]["high"]
    with pytest.raises(ValueError, match="--stop-after must be one of base, sft-phase0, sft; got 'sft-phase7'"):
        recipe.main(["--tiny", "--out", str(tmp_path / "no"), "--stop-after", "sft-phase7"])
    assert not (tmp_path / "no").exists()


def test_a_stage_clocked_again_under_its_name_adds_to_its_total():
    """bench/recipe_real.py scores a card a row at a time under one name: the stage's cost is every row's, not
    the last one's (a card's 13.6 CPU-minutes read as 7.5 before)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import recipe

    clock = recipe.Clock()
    clock.run("card", time.sleep, 0.2)
    clock.run("card", time.sleep, 0.3)
    clock.run("other", time.sleep, 0.2)
    assert set(clock.stages) == {"card", "other"}
    assert 0.5 <= clock.stages["card"]["wall_s"] < 2.0 and clock.stages["other"]["wall_s"] < 0.5
