"""The recipe, measured: pretrain a small BPE chat base -> SFT in phases on the tasks' conversations mixed with
ordinary chat -> RL on fresh prompts of countdown, the search skill, and of long-word letter counts asked plainly
(``--rl-rows auto``: the rows where the SFT model has the most room, sampled pass@k above its pass@1 and above a
guess) -> the report card (``decoderlab report``): every stage scored on the same held-out
questions, greedy with the calculator off and on and sampled, each number with its 95% interval, beside the RL
control (SFT continued on the reference answers for as many steps and samples as RL used).

    PYTHONPATH=src python bench/recipe.py --out runs/recipe            # make recipe
    PYTHONPATH=src python bench/recipe.py --out runs/t --tiny          # seconds: the shape, not the numbers

CPU only. Prints each stage's wall and CPU time; writes RUN_DIR/recipe.json (times, settings) and the card
(RUN_DIR/report.md, report.png, card.json). ``--base DIR`` / ``--sft DIR`` reuse a stage an earlier run wrote
(copied in; the CPU time its run's recipe.json records counted, none where it has none). The card, its costs
and its targets: docs/benchmarks.md, "bench/recipe.py".
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from decoderlab.config.defaults import REPORT_QUESTIONS, REPORT_SAMPLES  # noqa: E402
from decoderlab.tasks import conversation, generate  # noqa: E402
from decoderlab.tasks.chatter import story_conversations  # noqa: E402
from decoderlab.tasks.work import WORK_SUFFIX  # noqa: E402

#: the fine-tuning mix: (task or skill, difficulty or None for its whole range, share of the conversations) -- the
#: card's rows get most of it, each skill's other difficulties a little
SFT_MIX = (("addition_work", 3, .11), ("subtraction_work", 3, .11), ("addition", 4, .05), ("subtraction", 4, .05),
           ("addition", None, .02), ("subtraction", None, .02),
           ("multiplication", 2, .03), ("multiplication", 3, .01), ("multiplication", 1, .01),
           ("multiplication_work", 2, .08), ("multiplication_work", 3, .03), ("multiplication_work", 1, .01),
           ("first_letter", 2, .02), ("last_letter", 2, .04), ("first_letter", None, .01), ("last_letter", None, .01),
           ("letter_count", 1, .03), ("letter_count", None, .02), ("letter_count_work", 3, .05),
           ("letter_count_work", None, .02), ("backwards", 1, .02), ("backwards", None, .01),
           ("larger", 3, .02), ("larger", None, .01), ("smallest", 2, .02), ("smallest", None, .01),
           ("countdown", 1, .04), ("countdown", 2, .03), ("tool", None, .05))
#: the share of ordinary chat (story prompts answered by a corpus passage)
CHAT_SHARE = 0.05
#: SFT as phases from the base, each ``(steps, [(skill, difficulty, share[, "unasked"])], share of SFT_MIX replayed[,
#: learning rate as a share of --sft-lr])``: one arithmetic operation at a time first, then spelling, then the whole
#: mix, then a short phase where one plain question in five of 2x1-digit products and long-word letter counts is
#: answered with its work unasked ("unasked": the work form's reply to the question without " Show your work."), as
#: chat models sometimes show their working -- a behaviour RL can find pays and the plain answers do not teach.
#: Measured: the mix alone leaves multi-digit arithmetic at 0-3% however long it runs (to 7,000 steps of 32), and so
#: do add, subtract and multiply taught together; one operation alone answered at once found the carry on some
#: bases and data orders and not others (1% to 93% after 2,000 steps of 16). Written column by column, units first
#: with the carry or borrow (``addition_work``, ``subtraction_work``), 800 steps of sums and 1,200 of differences
#: give 3-digit sums 99.8-100% and differences 95.5-98.5% on each of 5 pretraining seeds (800 of differences: 94-98%
#: on 4), the two that failed the plain form included
#: (docs/finetuning.md, "The first phases, column by column"), so no phase is retried (the recipe's gates did,
#: up to three times); the spelling phase lifts first/last letter from 80%/72% to 88%/90%
PHASES = ((800, (("addition_work", 3, .7), ("addition_work", None, .2)), .1),
          (1200, (("subtraction_work", 3, .45), ("subtraction_work", None, .15), ("addition_work", 3, .3)), .1),
          (2000, (("multiplication_work", 2, .6), ("multiplication_work", 1, .1), ("addition_work", 3, .05),
                  ("subtraction_work", 3, .05)), .2),
          (1500, (("letter_count_work", 3, .3), ("letter_count_work", None, .15), ("first_letter", 2, .1),
                  ("last_letter", 2, .1)), .35),
          (4000, (), 1.0),
          (400, (("multiplication", 2, .08), ("multiplication_work", 2, .02, "unasked"), ("letter_count", 3, .08),
                 ("letter_count_work", 3, .02, "unasked")), .8, .25))
#: a seconds-long run of the same shape (tests)
TINY_PHASES = ((4, (("addition", 3, .9),), .1), (4, (("letter_count_work", 3, .5, "unasked"),), .5, .25))
#: the row each arithmetic phase teaches, scored after ``--stop-after sft-phaseK`` (the phases' measurement)
CHECKS = {0: ("addition_work", 3), 1: ("subtraction_work", 3)}


class Clock:
    """Wall and CPU seconds of each stage (``time.process_time``: this process, all threads); a stage run again
    under the same name (a card scored a row at a time) adds to its total."""

    def __init__(self):
        self.stages: dict[str, dict] = {}

    def run(self, name: str, fn, *args, **kwargs):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(*args, **kwargs)
        wall, cpu = round(time.perf_counter() - t0, 1), round(time.process_time() - c0, 1)
        total = self.stages.setdefault(name, {"wall_s": 0.0, "cpu_s": 0.0})
        total["wall_s"], total["cpu_s"] = round(total["wall_s"] + wall, 1), round(total["cpu_s"] + cpu, 1)
        print(f"[{name}] {wall:.0f} s wall, {cpu / 60:.1f} CPU-min", flush=True)
        return out


def sft_conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """``n`` training conversations: the tasks of ``SFT_MIX`` (train split) and ``CHAT_SHARE`` of chat, shuffled."""
    convs = []
    for task, difficulty, share in SFT_MIX:
        if int(n * share):  # (a tiny run's smallest shares round to none)
            convs += [conversation(i) for i in generate(task, "train", int(n * share), seed=seed,
                                                        difficulty=difficulty)]
    convs += story_conversations(n - len(convs), seed=seed)
    random.Random(seed).shuffle(convs)
    return convs


def pretrain(args, out: Path):
    """The chat base: ``decoderlab train --preset baby-shakespeare-speedrun --tokenizer bpe --vocab-size 1024
    --max-len 256 --max-steps 400 --eval-every 200`` (BPE trained on the corpus alone: its digits stay one
    token each, so the numbers of the tasks are written digit by digit)."""
    from decoderlab.training import train_lm

    shape = dict(max_len=args.context)
    if args.tiny:
        shape.update(d_model=args.d_model, n_layer=args.n_layer, n_head=args.n_head)
    return train_lm(preset="baby-shakespeare-speedrun", tokenizer="bpe", vocab_size=args.vocab,
                    model_overrides=shape, out=out / "base", progress_bar=False, logger=False, accelerator="cpu",
                    config_overrides=dict(max_steps=args.pretrain_steps, batch_size=args.pretrain_batch,
                                          **({} if args.pretrain_seed is None else {"seed": args.pretrain_seed}),
                                          eval_every=max(1, args.pretrain_steps // 2),
                                          warmup=min(50, args.pretrain_steps // 4)))


def unasked(item) -> list[dict]:
    """The conversation of a work form's item asked plainly: the question without " Show your work.", the
    reply with the work (the split is the problem's, so the plain question is in the item's split)."""
    return [{"role": "user", "content": item.question.removesuffix(WORK_SUFFIX)},
            {"role": "assistant", "content": item.answer}]


def phase_conversations(spec, replay: float, n: int, seed: int) -> list[list[dict]]:
    """``n`` conversations of one SFT phase: the shares of ``spec`` (train split, ``seed + 20``; an entry marked
    "unasked" as :func:`unasked`) and ``replay`` of the SFT mix (``sft_conversations``, ``seed + 30``),
    shuffled."""
    convs = []
    for task, difficulty, share, *form in spec:
        convs += [(unasked if form == ["unasked"] else conversation)(i)
                  for i in generate(task, "train", int(n * share), seed=seed + 20, difficulty=difficulty)]
    convs += sft_conversations(int(n * replay), seed=seed + 30)
    random.Random(seed).shuffle(convs)
    return convs


def sft(args, out: Path):
    """The ``PHASES`` in turn from the base (up to ``--stop-after``'s), each a fine-tuning of ``--sft-batch``
    conversations per step at ``--sft-lr`` (times the phase's share, if it has one; cosine to a tenth) from the
    one before, the ``tools`` template; the last is ``out/sft``, the others ``out/sft-phaseK``."""
    from decoderlab.finetuning import finetune
    from decoderlab.training import TrainConfig

    held = [conversation(i) for i in generate("arithmetic", "held-out", 64, seed=9)]
    phases = phases_of(args)
    start = out / "base"
    for k, (steps, spec, replay, *scale) in enumerate(phases[: last_phase(args, phases) + 1]):
        dst = out / ("sft" if k == len(phases) - 1 else f"sft-phase{k}")
        lr = args.sft_lr * (scale[0] if scale else 1.0)
        finetune(phase_conversations(spec, replay, steps * args.sft_batch, seed=k),
                 val_data=held, checkpoint=start, out=dst, template="tools" if k == 0 else None,
                 train_config=TrainConfig(max_steps=steps, batch_size=args.sft_batch, lr=lr, min_lr=lr / 10,
                                          warmup=min(50, steps // 4), eval_every=steps, val_batch_size=32,
                                          log_every=250),
                 eval_prompts=0, progress_bar="plain", logger=False, accelerator="cpu")
        start = dst


def phases_of(args) -> tuple:
    """``PHASES``, or a tiny run's ``TINY_PHASES``."""
    return TINY_PHASES if args.tiny else PHASES


def last_phase(args, phases) -> int:
    """The index of the last phase to run: every one, or K of ``--stop-after sft-phaseK``. Raises
    ``ValueError`` naming what ``--stop-after`` takes."""
    if args.stop_after is None or args.stop_after == "sft":
        return len(phases) - 1
    allowed = ["base"] + [f"sft-phase{k}" for k in range(len(phases) - 1)] + ["sft"]
    if args.stop_after not in allowed:
        raise ValueError(f"--stop-after must be one of {', '.join(allowed)}; got {args.stop_after!r}")
    return -1 if args.stop_after == "base" else int(args.stop_after.removeprefix("sft-phase"))


def phase_rows(args, out: Path) -> dict:
    """The ``CHECKS`` rows of the phases a ``--stop-after sft-phaseK`` run ran, its model scored greedily on the
    card's held-out questions (``--questions`` a row): ``{label: {"right", "n", "low", "high"}}`` (the Wilson
    95% interval), printed."""
    from decoderlab.reportcard import row_label, score_stage
    from decoderlab.reportcard.stats import wilson

    phases = phases_of(args)
    k = last_phase(args, phases)
    rows = [CHECKS[j] for j in sorted(CHECKS) if j <= k]
    name = "sft" if k == len(phases) - 1 else f"sft-phase{k}"
    scores = score_stage(out / name, questions_per_row=args.questions, rows=rows, samples=0)
    result = {}
    for skill, difficulty in rows:
        label = row_label(skill, difficulty)
        right = scores["rows"][label]["off"]["right"]
        low, high = wilson(sum(right), len(right))
        result[label] = {"right": sum(right), "n": len(right), "low": round(low, 4), "high": round(high, 4)}
        print(f"[{name}] {label}: {sum(right)} of {len(right)} held-out right ({sum(right) / len(right):.1%}, "
              f"95% interval {low:.1%}-{high:.1%})", flush=True)
    return result


def rl_prompts(chosen: list[tuple[str, int]], n: int, seed: int) -> list[dict]:
    """Fresh prompts (train split, a seed SFT did not use) of the chosen rows, with their references."""
    from decoderlab.tasks import row

    rows = []
    for skill, difficulty in chosen:
        rows += [row(i, "prompts") for i in generate(skill, "train", n // len(chosen), seed=seed,
                                                      difficulty=difficulty)]
    random.Random(seed).shuffle(rows)
    return rows


def choose(args, out: Path) -> list[tuple[str, int]]:
    """The RL rows: the SFT model's rows with the most room (``decoderlab.reportcard.choose_rl_rows``), measured
    on ``--choice-questions`` questions per row of the train split (seed 303) -- never on the card's held-out
    questions, so the card's numbers are not the ones the choice was made on."""
    from decoderlab.reportcard import ROWS, choose_rl_rows, score_stage
    from decoderlab.tokenizers import Tokenizer

    items = {(s, d): generate(s, "train", args.choice_questions, seed=303, difficulty=d) for s, d in ROWS}
    scores = score_stage(out / "sft", rows=ROWS, samples=args.samples, items=items)
    return choose_rl_rows(scores, items, samples=args.samples, tokenizer=Tokenizer.load(out / "sft" / "tokenizer.json"))


def reinforce(args, out: Path, chosen):
    from decoderlab.config import RLConfig
    from decoderlab.reinforcement import rl
    from decoderlab.reportcard import TaskReward

    return rl(rl_prompts(chosen, args.rl_prompts, seed=101), checkpoint=out / "sft", out=out / "rl",
              reward=TaskReward(), rl_config=RLConfig(group_size=args.rl_group, max_new_tokens=args.rl_tokens,
                                                      kl_coef=args.rl_kl, scale_rewards=args.rl_scale,
                                                      temperature=args.rl_temperature),
              config_overrides=dict(max_steps=args.rl_steps, batch_size=args.rl_batch, lr=args.rl_lr,
                                    min_lr=args.rl_lr, warmup=0, eval_every=args.rl_steps, log_every=10,
                                    accumulate=args.rl_accumulate),
              accelerator="cpu", progress_bar="plain", logger=False)


def control(args, out: Path, chosen):
    """SFT continued from the SFT model on the RL prompts' reference answers: as many steps as RL, as many
    conversations per step as RL sampled replies (prompts x G), at RL's learning rate."""
    from decoderlab.finetuning import finetune
    from decoderlab.training import TrainConfig

    prompts = rl_prompts(chosen, args.rl_prompts, seed=101)
    convs = [[p["messages"][0], {"role": "assistant", "content": p["reference"]}] for p in prompts]
    return finetune(convs, checkpoint=out / "sft", out=out / "control", val_fraction=0, eval_prompts=0,
                    train_config=TrainConfig(max_steps=args.rl_steps, lr=args.control_lr, min_lr=args.control_lr,
                                             batch_size=args.rl_batch * args.rl_group, accumulate=args.rl_accumulate,
                                             warmup=0, eval_every=args.rl_steps),
                    progress_bar=False, logger=False, accelerator="cpu")


def story(out: Path, chosen, card: dict) -> str:
    """The story of one question (docs/finetuning.md): the first held-out question of an RL row that the SFT
    model answers wrong greedily and the RL model right, with each model's 8 sampled replies (the card's own
    seeds, so their count of right replies is the card's) and each model's probability of the RL model's
    greedy reply (teacher-forced, its end of turn included). Written to ``out/story.md``; returns the text."""
    import math

    from decoderlab.generation.scoring import loglikelihood
    from decoderlab.reportcard import row_label
    from decoderlab.reportcard.scoring import Checkpoint, max_new_tokens, score

    models = {s: Checkpoint.load(out / s) for s in ("sft", "rl")}
    for skill, d in chosen:
        label = row_label(skill, d)
        row = next(r for r in card["rows"] if r["label"] == label)
        sft, rl = card["scores"]["sft"][label]["off"], card["scores"]["rl"][label]["off"]
        pick = next((i for i in range(row["n"]) if not sft["right"][i] and rl["right"][i]), None)
        if pick is not None:
            break
    else:
        return "no held-out question of the RL rows was wrong after SFT and right after RL"
    item = next(i for i in held_out_items(card, label) if i.question == row["questions"][pick])
    lines = [f"Question ({label}, held-out): {item.question!r}; reference {item.answer!r}", ""]
    greedy_rl = rl["replies"][pick]
    for name, ck in models.items():
        prompt = ck.prompt(item.question)
        replies = [ck.tok.decode(o) for o in generate_samples(ck, prompt, item.question, max_new_tokens(skill))]
        marks = [score(item, r, True, {}) for r in replies]
        target = ck.tok.encode(greedy_rl) + [ck.template.end_of_turn_id(ck.tok)]
        logp, _ = loglikelihood(ck.model, prompt, target)
        lines += [f"{name}: greedy {card['scores'][name][label]['off']['replies'][pick]!r}; P(the RL model's greedy "
                  f"reply) = {math.exp(logp):.3g}; {sum(marks)} of {len(replies)} samples right:"]
        lines += [f"  {'right' if m else 'wrong'}: {r!r}" for r, m in zip(replies, marks)]
    text = "\n".join(lines) + "\n"
    (out / "story.md").write_text(text, encoding="utf-8")
    return text


def held_out_items(card: dict, label: str):
    from decoderlab.reportcard import held_out, row_label

    row = next(r for r in card["rows"] if r["label"] == label)
    return held_out(card["questions"], [(row["skill"], row["difficulty"])])[(row["skill"], row["difficulty"])]


def generate_samples(ck, prompt: list[int], question: str, cap: int, k: int = 8) -> list[list[int]]:
    """The card's k samples of one question (temperature 1, its seeds), batched."""
    from decoderlab.generation import generate_batch
    from decoderlab.reportcard.scoring import sample_seed

    params = [ck.params(prompt, cap, ban_call=True).replace(temperature=1.0, seed=sample_seed(question, j))
              for j in range(k)]
    return generate_batch(ck.model, [prompt] * k, params, tokenizer=ck.tok)


TINY = dict(vocab=300, context=64, d_model=32, n_layer=2, n_head=2, pretrain_steps=4, pretrain_batch=4,
            sft_batch=8, rl_steps=2, rl_prompts=8, rl_batch=2, rl_group=2, rl_accumulate=1,
            rl_tokens=6, questions=3, samples=2, choice_questions=3)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/recipe")
    ap.add_argument("--base", default=None, help="reuse this base run (copied in) instead of pretraining")
    ap.add_argument("--sft", default=None, help="reuse this SFT run (copied in) instead of fine-tuning")
    ap.add_argument("--tiny", action="store_true", help="a seconds-long run of every stage (tests)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pretrain-seed", type=int, default=None,
                    help="the base's training seed (its weights and windows; default the preset's, 42)")
    ap.add_argument("--stop-after", default=None, metavar="STAGE",
                    help="end after this stage: base, or sft-phaseK (the phases 0..K, then their rows scored "
                         "greedily on the card's held-out questions: the phases' measurement)")
    for name, default in dict(vocab=1024, context=256, d_model=128, n_layer=4, n_head=4, pretrain_steps=400,
                              pretrain_batch=12, sft_batch=16,
                              rl_steps=300, rl_prompts=2400, rl_batch=8, rl_accumulate=1, rl_group=8, rl_tokens=48,
                              questions=REPORT_QUESTIONS, samples=REPORT_SAMPLES, choice_questions=100).items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    ap.add_argument("--sft-lr", type=float, default=2e-3)
    ap.add_argument("--rl-lr", type=float, default=1e-4)
    ap.add_argument("--control-lr", type=float, default=None, help="the control's learning rate (default: --rl-lr)")
    ap.add_argument("--rl-kl", type=float, default=0.05,
                    help="the KL penalty to the SFT model (2026-12-07, the same SFT run and questions: 0.05 took "
                         "plain letter counts +0.7 -> +10.5 over SFT and 2x2-digit products with work -25.7 -> "
                         "-4.0; 0 for none)")
    ap.add_argument("--rl-temperature", type=float, default=1.0)
    ap.add_argument("--rl-scale", action=argparse.BooleanOptionalAction, default=False,
                    help="divide advantages by the group's std (GRPO; default off)")
    ap.add_argument("--rl-rows", default="countdown:1,letter_count:3",
                    help="the RL rows, skill:difficulty comma-separated (default: countdown with 3 numbers, the "
                         "search skill, and long-word letter counts asked plainly, where showing the work unasked "
                         "pays), or auto (the SFT model's rows with the most room: pass@k above pass@1 and a "
                         "guess's pass@k)")
    args = ap.parse_args(argv)
    args.control_lr = args.rl_lr if args.control_lr is None else args.control_lr
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
    return args


def copied(src, dst: Path) -> float:
    shutil.copytree(src, dst)
    prev = Path(src).parent / "recipe.json"
    return json.loads(prev.read_text())["stages"].get(dst.name, {}).get("cpu_s", 0.0) if prev.exists() else 0.0


def stopped(args, out: Path, clock, reused) -> int:
    """A run ended early by ``--stop-after``: recipe.json with its stages, and after a phase its rows scored."""
    record = {"args": vars(args), "stages": clock.stages, "reused_cpu_s": reused}
    if args.stop_after != "base":
        record["rows"] = clock.run("score", phase_rows, args, out)
    record["stages"] = clock.stages
    (out / "recipe.json").write_text(json.dumps(record, indent=2))
    return 0


def main(argv=None) -> int:
    import torch

    from decoderlab.reportcard import parse_rows, report

    args = parse(argv)
    torch.set_num_threads(args.threads)
    last_phase(args, phases_of(args))  # a wrong --stop-after refused before any stage runs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clock, reused = Clock(), {}
    if args.base:
        reused["base"] = copied(args.base, out / "base")
    else:
        clock.run("base", pretrain, args, out)
    if args.stop_after == "base":
        return stopped(args, out, clock, reused)
    if args.sft:
        reused["sft"] = copied(args.sft, out / "sft")
    else:
        clock.run("sft", sft, args, out)
    if args.stop_after is not None:
        return stopped(args, out, clock, reused)
    chosen = clock.run("choose", choose, args, out) if args.rl_rows == "auto" else parse_rows(args.rl_rows)
    print(f"RL rows: {chosen}", flush=True)
    clock.run("rl", reinforce, args, out, chosen)
    clock.run("control", control, args, out, chosen)
    record = {"args": vars(args), "chosen": chosen, "stages": clock.stages, "reused_cpu_s": reused}
    (out / "recipe.json").write_text(json.dumps(record, indent=2))
    card = clock.run("report", report, out, questions=args.questions, samples=args.samples)
    print(clock.run("story", story, out, chosen, card["card"]), flush=True)
    record["stages"] = clock.stages
    train_cpu = sum(v["cpu_s"] for k, v in clock.stages.items() if k in ("base", "sft", "rl", "control"))
    record["train_cpu_s"] = train_cpu + sum(reused.values())
    record["total_cpu_s"] = sum(v["cpu_s"] for v in clock.stages.values()) + sum(reused.values())
    (out / "recipe.json").write_text(json.dumps(record, indent=2))
    print(card["markdown"])
    print(f"\ntraining {record['train_cpu_s'] / 60:.1f} CPU-min; whole card {record['total_cpu_s'] / 60:.1f} "
          f"CPU-min; {args.threads} thread(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
