"""Reading a skill: how a chat model fine-tuned on "What is 347 + 285?" adds, in three glass-box tables.

    PYTHONPATH=src python bench/glassbox_skill.py --checkpoint runs/recipe/sft --questions 50 --out glassbox.md
    PYTHONPATH=src python bench/glassbox_skill.py --checkpoint DIR --difficulty 2 --only-correct

On held-out addition questions (``decoderlab.tasks``, the split no training file holds), each answered with the
correct answer teacher-forced after the chat template's assistant opener:

1. the logit lens (``LogitLens.token_probs`` / ``first_on_top``): at the position that predicts each answer
   token, the probability of the correct one read from every layer's residual stream, the share of questions
   where it is on top, the first entry that puts it there and the first from which it stays there --
   averaged, and for one worked example;
2. the direct logit attribution of the correct first token (``decompose``): embeddings, every head, every
   MLP, the biases, summing to the model's logit (the largest |sum - logit| over every question and answer
   position is printed);
3. activation patching (``activation_patching(normalize=True)``): each question against a copy with one digit
   of one operand changed (default: the first operand's leading digit), chosen so that the answer's first
   token changes; the clean run's head outputs (``hook_z``) and residual streams patched one at a time into
   the corrupted run; each cell the fraction of the logit difference (correct first token minus the corrupted
   answer's) it recovers. Patching layer 0's input at the changed position recovers exactly 1; the positions
   before it, 0.

Prints markdown; ``--out FILE`` writes it too. Runs in seconds on a 4-layer model (CPU, one thread).
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

import decoderlab as dl  # noqa: E402
from decoderlab import glassbox as gb  # noqa: E402
from decoderlab.tasks import conversation, generate  # noqa: E402

OPERANDS = re.compile(r"(\d+) \+ (\d+)")
#: the recipe's fine-tuned model (``make recipe``)
DEFAULT_CHECKPOINT = "runs/recipe/sft"


@dataclass
class Question:
    """One held-out question with its answer teacher-forced: ``ids`` (T,) the rendered conversation up to the
    last answer token; ``positions[k]`` predicts ``answer[k]`` (the k-th answer token)."""

    text: str
    answer: str
    ids: torch.Tensor
    positions: list[int]
    answer_ids: list[int]


def prepare(model: dl.Model, item) -> Question:
    """The question rendered with the model's template, its answer tokens and the positions predicting them."""
    ids, mask = model.template.render(conversation(item), model.tokenizer)
    where = [i for i, m in enumerate(mask) if m][:-1]  # the assistant's content, without the end of turn
    return Question(item.question, item.answer, torch.tensor(ids[:where[-1] + 1]), [i - 1 for i in where],
                    [ids[i] for i in where])


def held_out(model: dl.Model, n: int, difficulty: int, seed: int) -> list[Question]:
    return [prepare(model, item) for item in generate("addition", "held-out", n, seed=seed, difficulty=difficulty)]


def cell(token: str) -> str:
    """A token as a markdown table cell: its repr, with ``|`` (as in ``<|end|>``) escaped."""
    return repr(token).replace("|", "\\|")


def entry_labels(n_layer: int) -> list[str]:
    """The logit lens's entries in words: layer L's input is the residual after layer L - 1."""
    return ["embeddings"] + [f"after L{i}" for i in range(n_layer - 1)] + [f"after L{n_layer - 1} (output)"]


@torch.no_grad()
def read(model: dl.Model, questions: list[Question]) -> dict:
    """Lens and decomposition of every question at every answer position: per question a dict with
    ``probs`` (n_layer + 1, K), ``first`` and ``stays`` (K,), ``ranks`` (n_layer + 1, K), ``parts`` (n_parts,
    K) for its K answer tokens; ``labels`` of the parts; ``max_error``: the largest |sum of parts - logit|."""
    m = model.model
    names = gb.lens_names(m) + gb.decompose_names(m)
    rows, labels, worst = [], None, 0.0
    for q in questions:
        _, cache = gb.run_with_cache(m, q.ids, names_filter=names)
        lens = gb.logit_lens(cache, positions=q.positions)
        want = torch.tensor([q.answer_ids])
        parts = []
        for p, tok in zip(q.positions, q.answer_ids):
            d = gb.decompose(cache, p, tok)
            worst = max(worst, abs(float(d.total()) - float(d.logit)))
            labels = d.labels
            parts.append(d.values.double())
        rows.append(dict(probs=lens.token_probs(want)[:, 0].double(), first=lens.first_on_top(want)[0],
                         stays=lens.first_on_top(want, stay=True)[0], ranks=lens.ranks(want)[:, 0],
                         parts=torch.stack(parts, 1)))
    return dict(rows=rows, labels=labels, max_error=worst)


def _digit_rows(rows: list[dict], k: int) -> list[dict]:
    return [r for r in rows if r["probs"].size(1) > k]


def lens_markdown(model: dl.Model, questions: list[Question], got: dict) -> str:
    """Table 1: per entry and answer token k, the mean probability of the correct token and the share of
    questions where it is on top; then the first entry on top (median), and the worked example."""
    n = model.config.n_layer
    labels = entry_labels(n)
    k_max = max(len(q.positions) for q in questions)
    head = "| residual read | " + " | ".join(f"token {k + 1}: p(correct) / on top" for k in range(k_max)) + " |"
    lines = [head, "|---|" + "---:|" * k_max]
    for e, label in enumerate(labels):
        cells = []
        for k in range(k_max):
            rs = _digit_rows(got["rows"], k)
            p = sum(float(r["probs"][e, k]) for r in rs) / len(rs)
            top = sum(int(r["ranks"][e, k] == 0) for r in rs) / len(rs)
            cells.append(f"{p:.3f} / {top:.0%}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for key, title in (("first", "first on top (median)"), ("stays", "on top from here to the output (median)")):
        cells = []
        for k in range(k_max):
            fs = [int(r[key][k]) for r in _digit_rows(got["rows"], k)]
            med = sorted(f if f >= 0 else n + 1 for f in fs)[len(fs) // 2]
            cells.append(f"{labels[med] if med <= n else 'never'} (never: {sum(f < 0 for f in fs)}/{len(fs)})")
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    counts = [len(_digit_rows(got["rows"], k)) for k in range(k_max)]
    lines.append("| questions with this token | " + " | ".join(str(c) for c in counts) + " |")
    return "\n".join(lines) + "\n\n" + example_markdown(model, questions[0], got["rows"][0])


def example_markdown(model: dl.Model, q: Question, row: dict) -> str:
    """The worked example: for each entry and answer token, the top token with its probability and
    p(correct)."""
    m, tok = model.model, model.tokenizer
    _, cache = gb.run_with_cache(m, q.ids, names_filter=gb.lens_names(m))
    top = gb.logit_lens(cache, positions=q.positions).probs()[:, 0]  # (L + 1, K, V)
    vals, ids = top.max(-1)
    answer = [tok.decode([t]) for t in q.answer_ids]
    lines = [f"Worked example: `{q.text}` -> `{q.answer}` (each cell: the entry's top token, its probability; "
             "p(correct))", "",
             "| residual read | " + " | ".join(f"predicting {cell(a)}" for a in answer) + " |",
             "|---|" + "---:|" * len(answer)]
    for e, label in enumerate(entry_labels(m.config.n_layer)):
        cells = [f"{cell(tok.decode([int(ids[e, k])]))} {float(vals[e, k]):.3f}; {float(row['probs'][e, k]):.3f}"
                 for k in range(len(answer))]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def dla_markdown(questions: list[Question], got: dict) -> str:
    """Table 2: each part's direct contribution to the correct token's logit: the worked example's first token,
    then the mean over questions for each answer token; the sum and the model's logit under them."""
    rows, labels = got["rows"], got["labels"]
    k_max = max(len(q.positions) for q in questions)
    means = [torch.stack([r["parts"][:, k] for r in _digit_rows(rows, k)]).mean(0) for k in range(k_max)]
    ex = rows[0]["parts"][:, 0]
    lines = [f"| part | example {questions[0].answer[0]!r} (token 1) | "
             + " | ".join(f"mean, token {k + 1}" for k in range(k_max)) + " |", "|---|---:|" + "---:|" * k_max]
    for i, label in enumerate(labels):
        lines.append(f"| {label} | {float(ex[i]):+.3f} | " + " | ".join(f"{float(mu[i]):+.3f}" for mu in means)
                     + " |")
    lines.append(f"| **sum** | {float(ex.sum()):+.3f} | " + " | ".join(f"{float(mu.sum()):+.3f}" for mu in means)
                 + " |")
    order = sorted(range(len(labels)), key=lambda i: -abs(float(means[0][i])))[:5]
    lines += ["", "Largest parts of the first token's logit (mean): "
              + ", ".join(f"{labels[i]} {float(means[0][i]):+.2f}" for i in order) + ".",
              f"Max |sum of parts - model's logit| over {sum(len(q.positions) for q in questions)} answer tokens of "
              f"{len(questions)} questions: {got['max_error']:.1e}."]
    return "\n".join(lines)


@dataclass
class Pairs:
    """Clean and corrupted prompts, (B, T) each, ending with the assistant opener: ``clean_first`` /
    ``corrupt_first`` (B,) the first answer token of each; ``changed`` (B,) the position of the changed digit."""

    clean: torch.Tensor
    corrupt: torch.Tensor
    clean_first: torch.Tensor
    corrupt_first: torch.Tensor
    changed: torch.Tensor
    texts: list[tuple[str, str]]


def corrupted(question: str, operand: int, digit: int, rng: random.Random, first_token) -> str | None:
    """``question`` with digit ``digit`` (1 = the leading one) of operand ``operand`` (1 or 2) changed to another
    digit -- not a leading zero -- such that the sum's first token (``first_token(sum)``) changes; None when
    no digit does."""
    a, b = OPERANDS.search(question).groups()
    s = (a, b)[operand - 1]
    if digit > len(s):
        return None
    j = digit - 1
    options = []
    for c in "0123456789":
        if c == s[j] or (j == 0 and c == "0" and len(s) > 1):
            continue
        new = s[:j] + c + s[j + 1:]
        total = int(new) + int(b) if operand == 1 else int(a) + int(new)
        if first_token(str(total)) != first_token(str(int(a) + int(b))):
            options.append(f"What is {new} + {b}?" if operand == 1 else f"What is {a} + {new}?")
    return rng.choice(options) if options else None


def make_pairs(model: dl.Model, questions: list[Question], operand: int, digit: int, seed: int) -> Pairs:
    """Each question against its corrupted copy (:func:`corrupted`); questions with no such copy, or whose copy
    tokenizes to another length, are left out. Raises ``ValueError`` when none is left."""
    tok, template, rng = model.tokenizer, model.template, random.Random(seed)

    def prompt(text):
        return template.render([{"role": "user", "content": text}], tok, add_generation_prompt=True)[0]

    def first(text):
        return tok.encode(text, allow_special=False)[0]

    rows = []
    for q in questions:
        bad = corrupted(q.text, operand, digit, rng, first)
        if bad is None:
            continue
        c, x = prompt(q.text), prompt(bad)
        if len(c) == len(x):
            a, b = OPERANDS.search(bad).groups()
            rows.append((c, x, first(q.answer), first(str(int(a) + int(b))), (q.text, bad)))
    if not rows:
        raise ValueError(f"no question has a corrupted copy (operand {operand}, digit {digit}) of the same length "
                         "whose answer starts otherwise")
    clean, corrupt = torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])
    changed = (clean != corrupt).to(torch.int64).argmax(1)
    return Pairs(clean, corrupt, torch.tensor([r[2] for r in rows]), torch.tensor([r[3] for r in rows]), changed,
                 [r[4] for r in rows])


@torch.no_grad()
def patch(model: dl.Model, pairs: Pairs) -> dict:
    """The recovered fractions: ``heads`` (n_layer, n_head), ``resid`` (n_layer, T) of each layer's input at each
    position, ``head_pos`` (n_layer, T, n_head) of each head at one position, ``attn`` and ``mlp`` (n_layer,) of
    each layer's whole output; ``clean`` and ``corrupt`` the metric (mean logit difference, correct first
    token minus the corrupted answer's) of the unpatched runs; ``attention`` (n_layer, n_head, T, T) each
    head's attention pattern, the mean over the clean runs (the pairs share one layout)."""
    m = model.model
    metric = gb.logit_difference(pairs.clean_first, pairs.corrupt_first, position=-1)
    run = lambda over, by: gb.activation_patching(m, pairs.clean, pairs.corrupt, metric, over=over, by=by,  # noqa
                                                  normalize=True)
    out = dict(heads=run("attn_head", "layer,head"), head_pos=run("attn_head", "layer,pos,head"),
               resid=run("resid_pre", "layer,pos"),
               attn=run("attn_out", "layer"), mlp=run("mlp_out", "layer") if m.blocks[0].has_mlp else None)
    names = [f"blocks.{i}.attn.hook_pattern" for i in range(m.config.n_layer)]
    logits, cache = gb.run_with_cache(m, pairs.clean, names_filter=names)
    out["attention"] = torch.stack([cache[n].mean(0) for n in names]).double()
    out["clean"] = float(metric(logits))
    out["corrupt"] = float(metric(gb.run_with_hooks(m, pairs.corrupt, [])))
    return out


def patch_markdown(model: dl.Model, pairs: Pairs, got: dict, threshold: float) -> str:
    """Table 3: the recovered fractions per head, per layer and position, per layer's attention and MLP; the
    heads over ``threshold`` named with their attention to the changed digit."""
    tok, n_layer, n_head = model.tokenizer, model.config.n_layer, model.config.n_head
    heads, resid, att = got["heads"], got["resid"], got["attention"]
    lines = [f"{len(pairs.texts)} pairs, e.g. `{pairs.texts[0][0]}` vs `{pairs.texts[0][1]}`; logit difference "
             f"(correct first token - the corrupted answer's) clean {got['clean']:+.3f}, corrupted "
             f"{got['corrupt']:+.3f}. Each cell: the fraction of that difference the patch recovers.", "",
             "| head output (hook_z) | " + " | ".join(f"H{h}" for h in range(n_head)) + " |",
             "|---|" + "---:|" * n_head]
    lines += [f"| L{i} | " + " | ".join(f"{float(v):.3f}" for v in heads[i]) + " |" for i in range(n_layer)]
    named = sorted(((float(heads[i, h]), i, h) for i in range(n_layer) for h in range(n_head)
                    if float(heads[i, h]) >= threshold), reverse=True)
    pos = [tok.decode([int(t)]) for t in pairs.clean[0]]
    changed = int(pairs.changed[0])
    lines += ["", f"Heads recovering at least {threshold:.0%} (patched at every position), each with the one "
              "position where patching it alone recovers most, and its attention from there (clean runs, mean): "
              "to the changed digit, and where it looks most:", ""]
    for v, i, h in named:
        best = int(got["head_pos"][i, :, h].argmax())
        row = att[i, h, best]
        most = int(row.argmax())
        lines.append(f"- L{i}H{h}: {v:.0%}; at {pos[best]!r} (position {best}) "
                     f"{float(got['head_pos'][i, best, h]):.0%}, attending {float(row[changed]):.2f} to "
                     f"{pos[changed]!r} (position {changed}), most to {pos[most]!r} (position {most}, "
                     f"{float(row[most]):.2f})")
    if not named:
        lines.append("- none")
    cols = [cell(p) + ("*" if j == changed else "") for j, p in enumerate(pos)]
    lines += ["", "| residual (layer input), by position | " + " | ".join(cols) + " |",
              "|---|" + "---:|" * len(cols)]
    lines += [f"| L{i} | " + " | ".join(f"{float(v):.2f}" for v in resid[i]) + " |" for i in range(n_layer)]
    lines += ["", "(* the changed digit; layer 0's input there is the whole difference: 1 by construction.)", "",
              "| layer | attention output | MLP output |", "|---|---:|---:|"]
    mlp = got["mlp"]
    lines += [f"| L{i} | {float(got['attn'][i]):.3f} | {'-' if mlp is None else f'{float(mlp[i]):.3f}'} |"
              for i in range(n_layer)]
    return "\n".join(lines)


def report(model: dl.Model, args) -> tuple[str, dict]:
    """The whole page (markdown) and the numbers behind it: ``read`` (lens and parts), ``patch``, ``pairs``."""
    t0 = time.perf_counter()
    questions = held_out(model, args.questions, args.difficulty, args.seed)
    got = read(model, questions)
    right = [bool((r["ranks"][-1] == 0).all()) for r in got["rows"]]
    tf = f"Teacher-forced, every answer token on top at the output: {sum(right)}/{len(questions)} questions."
    if args.only_correct:
        if not any(right):
            raise ValueError("--only-correct: the model answers none of the questions right")
        questions = [q for q, ok in zip(questions, right) if ok]
        got["rows"] = [r for r, ok in zip(got["rows"], right) if ok]
        tf += f" The tables read those {len(questions)} only."
    pairs = make_pairs(model, questions, args.operand, args.digit, args.seed)
    patched = patch(model, pairs)
    c = model.config
    head = (f"Model: {args.checkpoint} ({c.n_layer} layers, {c.n_head} heads, d_model {c.d_model}; "
            f"{model.model.num_parameters():,} parameters; {str(model.dtype).removeprefix('torch.')}). "
            f"{len(questions)} held-out questions of {args.difficulty}-digit addition (seed {args.seed}).")
    text = "\n\n".join([
        head, tf,
        "### 1. Logit lens: the correct answer token read from each layer's residual stream",
        lens_markdown(model, questions, got),
        "### 2. Direct logit attribution of the correct answer token", dla_markdown(questions, got),
        f"### 3. Activation patching: operand {args.operand}'s digit {args.digit} changed",
        patch_markdown(model, pairs, patched, args.threshold),
        f"({time.perf_counter() - t0:.1f} s, {torch.get_num_threads()} thread(s).)"])
    return text + "\n", dict(read=got, patch=patched, pairs=pairs, questions=questions)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=None,
                    help=f"a chat checkpoint directory (default {DEFAULT_CHECKPOINT}, what `make recipe` writes; "
                         "skipped when it is absent)")
    ap.add_argument("--questions", type=int, default=50, help="held-out questions (default 50)")
    ap.add_argument("--difficulty", type=int, default=3, help="digits of each operand (default 3: 347 + 285)")
    ap.add_argument("--operand", type=int, choices=(1, 2), default=1, help="the operand corrupted (default 1)")
    ap.add_argument("--digit", type=int, default=1, help="its digit corrupted, 1 = the leading one (default 1)")
    ap.add_argument("--threshold", type=float, default=0.1, help="name the heads recovering at least this")
    ap.add_argument("--only-correct", action="store_true",
                    help="read only the questions the model answers right (teacher-forced)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--float64", action="store_true", help="run the model in float64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="also write the markdown here")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.checkpoint is None:
        if not Path(DEFAULT_CHECKPOINT).is_dir():
            print(f"glassbox_skill: skipped: no {DEFAULT_CHECKPOINT} (`make recipe` writes it; or pass --checkpoint)")
            return 0
        args.checkpoint = DEFAULT_CHECKPOINT
    torch.set_num_threads(args.threads)
    try:
        model = dl.load(args.checkpoint)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"glassbox_skill: error: {e}") from None
    if model.template is None:
        raise SystemExit(f"glassbox_skill: error: {args.checkpoint} has no chat template (a fine-tuned chat "
                         "checkpoint is needed)")
    if args.float64:
        model.model.double()
    try:
        text, _ = report(model, args)
    except ValueError as e:  # a difficulty the tasks do not have, no pair to patch ...
        raise SystemExit(f"glassbox_skill: error: {e}") from None
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
