"""The report card: a tiny recipe run (every stage, seconds of training) writes report.md with a column per stage
and a row per task, and its numbers equal an independent scoring of the same checkpoints (replies generated
here through the engine, scored by this file's own last-number and exact-match rules); a directory that is not
a run is one error line."""

import json
import re
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
import torch

import decoderlab as dl
from decoderlab.chat import get_template, load_model
from decoderlab.reportcard import ROWS, STAGES, STORY, held_out, report, row_label

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "bench"))
    import recipe

    out = tmp_path_factory.mktemp("recipe") / "run"
    torch.set_num_threads(1)
    assert recipe.main(["--tiny", "--out", str(out), "--threads", "1", "--weak", "addition:4,letter_count:3"]) == 0
    return out


def last_number(text):
    found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return Decimal(found[-1].replace(",", "")) if found else None


def my_reply(model, tok, template, question, n=48):
    if template is None:
        ids = dl.generate(model, tok.encode(question + "\n"), n, temperature=0, tokenizer=tok)
        return tok.decode(ids).strip().split("\n")[0]
    ids, _ = template.render([{"role": "user", "content": question}], tok, add_generation_prompt=True)
    eot, tc = template.end_of_turn_id(tok), template.tool_call_id(tok)
    out = dl.generate(model, ids, min(n, model.config.max_len - len(ids)), temperature=0, tokenizer=tok,
                      logit_bias={tc: -100.0}, stop=[eot])
    return tok.decode([i for i in out if i != eot])


@pytest.mark.slow
def test_the_card_has_a_column_per_stage_a_row_per_task_and_independent_numbers(tiny_run):
    md = (tiny_run / "report.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| task |"))
    assert [c.strip() for c in header.strip("|").split("|")][1:] == list(STAGES)
    card = json.loads((tiny_run / "card.json").read_text())
    questions = card["questions"]
    assert (tiny_run / "report.png").stat().st_size > 1000
    for stage in STAGES:
        model, tok, template, _ = load_model(tiny_run / stage)
        for (skill, d), items in held_out(questions).items():
            label = row_label(skill, d)
            assert re.search(rf"^\| {re.escape(label)} \|", md, re.M), label
            mine = [my_reply(model, tok, template, i.question) for i in items]
            assert mine == card["scores"][stage][label]["replies"], (stage, label)
            right = sum((last_number(r) == Decimal(i.answer)) if i.reward == "number" else r.strip() == i.answer
                        for r, i in zip(mine, items))
            shown = re.search(rf"^\| {re.escape(label)} \|(.*)$", md, re.M)[1].split("|")[STAGES.index(stage)]
            assert shown.strip() == f"{100 * right / len(items):.0f}%"
    assert len([r for r in md.splitlines() if r.startswith("| ") and "%" in r]) >= 2 * len(ROWS)
    assert STORY and "story prompt" in md


def test_a_directory_that_is_not_a_run_is_one_error_line(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    r = subprocess.run([sys.executable, "-m", "decoderlab.cli", "report", str(tmp_path)], capture_output=True,
                       text=True)
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.splitlines()
    assert line == (f"decoderlab: error: {tmp_path} is not a recipe run: it holds none of the stage checkpoints "
                    f"base/, sft/, control/, rl/ (bench/recipe.py writes them)")
    with pytest.raises(ValueError, match="not a recipe run"):
        report(tmp_path)
    with pytest.raises(ValueError, match="questions must be an integer >= 1"):
        report(tmp_path, questions=0)
    assert get_template("tools").has_tools


def test_a_checkpoint_with_a_jinja_template_scores_as_with_the_built_in_one(tmp_path):
    """The card reads a checkpoint's template whatever its kind: decoderlab's template stored as Jinja (as a
    Hugging Face directory carries it) scores the same replies as the built-in one."""
    import string

    from decoderlab.chat import TEMPLATES, JinjaChatTemplate, add_chat_tokens, chat_template_jinja
    from decoderlab.checkpoint import save_checkpoint
    from decoderlab.reportcard import score_stage

    builtin = TEMPLATES["decoderlab"]
    torch.manual_seed(0)
    _, tok, _ = add_chat_tokens(None, dl.CharTokenizer(set(string.printable)), builtin)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=16,
                                                n_layer=1, n_head=2, max_len=96))
    for name, template in (("b", builtin), ("j", JinjaChatTemplate(chat_template_jinja(builtin)))):
        save_checkpoint(tmp_path / name, model, tok, meta={"task": "chat", "chat_template": template.to_dict()})
    scores = [score_stage(tmp_path / name, questions_per_row=1, rows=ROWS[:2]) for name in ("b", "j")]
    assert scores[0] == scores[1] and scores[0]["story"]["reply"]


def test_a_base_model_s_question_starts_with_the_start_token_its_tokenizer_puts_first(llama_directory):
    """A Llama 2 / TinyLlama-style base model (add_bos_token) reads a report-card question as transformers'
    ``tokenizer(question + "\\n")``, <s> first: its greedy reply is the transformers model's after those ids."""
    from hf.families import greedy_tokens

    from decoderlab import reportcard

    path, hf, auto = llama_directory
    m = dl.load(path)
    question = "What is 12 + 7?"
    ids = auto(question + "\n")["input_ids"]
    assert ids[0] == auto.bos_token_id
    new = greedy_tokens(hf, ids, reportcard.MAX_NEW_TOKENS)
    ended = next((i for i, t in enumerate(new) if t == auto.eos_token_id), len(new))  # generate stops at </s>
    want = auto.decode(new[:ended], skip_special_tokens=True).strip().split("\n")[0]
    assert want and reportcard._base_reply(m.model, m.tokenizer, question) == want
