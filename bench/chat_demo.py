"""Chat demonstration: pretrain a small model on TinyStories paragraphs, fine-tune it on
"write a short story with these three words" conversations, and compare with the base model on held-out
prompts: share of replies with all three words / at least one / none, and the end-of-turn rate.

    PYTHONPATH=src python bench/chat_demo.py [--stories ../shared/data/tinystories_val_slice.txt] [--out runs/chat_demo]

CPU only, one thread (the machine is shared). Prints a table and one transcript; writes results.json. The
defaults are the recipe of the final run in docs/finetuning.md, "The chat demonstration" (words from the
paragraph's opening sentence in text order, 4 triples per paragraph, rope + 8 heads, 1,000 pretraining + 600
fine-tuning steps at lr 2e-3): about 6 CPU-minutes of training. The first runs there used --words-from all
--order random --position learned --n-head 4.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from decoderlab.chat import chat_reply, load_model  # noqa: E402
from decoderlab.checkpoint import load_checkpoint  # noqa: E402
from decoderlab.finetuning import finetune  # noqa: E402
from decoderlab.generation import generate  # noqa: E402
from decoderlab.tinystories import (build_story_set, content_words, lead_words, story_prompt,  # noqa: E402
                                 word_coverage, words_of_prompt)
from decoderlab.training import TrainConfig, train_lm  # noqa: E402

#: replies shorter than this many words are not stories (a reply that lists the three words is a reward hack)
SHORT_WORDS = 15


def coverage_table(counts: list[int]) -> dict:
    n = len(counts)
    return {"all_three": sum(c == 3 for c in counts) / n, "at_least_one": sum(c >= 1 for c in counts) / n,
            "none": sum(c == 0 for c in counts) / n}


def words_prefixed_text(texts: list[str], copies: int, prefix: str, words_from: str, order: str,
                        first_words: int | None, seed: int = 1) -> str:
    """Pretraining text for lever (c): every training paragraph ``copies`` times (a seeded shuffle per copy),
    each time preceded by a fresh triple of its words drawn as the prompts draw them -- the fine-tuning task
    as unsupervised text. ``prefix``: "prompt" (the user turn's own sentence) or "words" ("Words: a, b, c.")."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(copies):
        idx = list(range(len(texts)))
        rng.shuffle(idx)
        for i in idx:
            words = content_words(texts[i])
            pool = lead_words(texts[i]) if words_from == "lead" else words
            pool = pool[:first_words] if first_words else pool
            pick = rng.sample(pool, 3)
            if order == "text":
                pick.sort(key=words.index)
            head = story_prompt(pick) if prefix == "prompt" else f"Words: {', '.join(pick)}."
            out.append(f"{head}\n{texts[i]}")
    return "\n\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stories", default=str(ROOT.parent / "shared" / "data" / "tinystories_val_slice.txt"))
    ap.add_argument("--out", default="runs/chat_demo")
    ap.add_argument("--pretrain-steps", type=int, default=1000)
    ap.add_argument("--finetune-steps", type=int, default=600)
    ap.add_argument("--prompts-per-unit", type=int, default=4)
    ap.add_argument("--held-out", type=int, default=100, help="held-out prompts to score")
    ap.add_argument("--max-new-tokens", type=int, default=120)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--base", default=None, help="reuse a base checkpoint written by an earlier run (same "
                                                 "--stories and seed: the same training paragraphs)")
    ap.add_argument("--finetune-lr", type=float, default=2e-3)
    ap.add_argument("--first-words", type=int, default=None,
                    help="draw the words from the paragraph's first N content words (default: all)")
    ap.add_argument("--decodings", default="greedy", help="comma-separated: greedy, sampled")
    ap.add_argument("--order", default="text", choices=("random", "text"),
                    help="requested words in the order drawn, or in their order in the paragraph")
    ap.add_argument("--words-from", default="lead", choices=("all", "lead"),
                    help="draw the words from the whole paragraph or from its opening sentence(s)")
    ap.add_argument("--pretrain-words", type=int, default=0,
                    help="lever (c): pretrain on each paragraph N times preceded by a word triple (0: plain)")
    ap.add_argument("--pretrain-prefix", default="prompt", choices=("prompt", "words"))
    ap.add_argument("--pretrain-lr", type=float, default=2e-3)
    ap.add_argument("--position", default="rope", choices=("learned", "rope", "sinusoidal"))
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--finetune-batch", type=int, default=16)
    ap.add_argument("--rl", action="store_true",
                    help="continue the fine-tuned model with `rl --reward contains_words` on training prompts (not "
                         "the held-out ones), and a control of as many extra SFT steps on the same prompts' "
                         "reference replies; score both on the held-out prompts greedily")
    ap.add_argument("--rl-steps", type=int, default=60)
    ap.add_argument("--rl-prompts", type=int, default=512, help="training prompts the RL stage answers")
    ap.add_argument("--rl-group", type=int, default=8, help="replies per prompt (G)")
    ap.add_argument("--rl-batch", type=int, default=4, help="prompts per RL step")
    ap.add_argument("--rl-lr", type=float, default=1e-4)
    ap.add_argument("--rl-kl", type=float, default=0.0, help="KL penalty to the fine-tuned model")
    ap.add_argument("--score-only", action="store_true",
                    help="score the base/ and chat/ checkpoints already in --out again (no training); writes "
                         "results_rescored.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    if not args.score_only:
        shutil.rmtree(out, ignore_errors=True)
    t_start = time.perf_counter()

    train, held, train_texts, _ = build_story_set(args.stories, prompts_per_unit=args.prompts_per_unit, seed=0,
                                                          order=args.order, first_words=args.first_words,
                                                          words_from=args.words_from)
    print(f"{len(train)} training conversations ({len(train_texts)} paragraphs), {len(held)} held out")

    # 1. pretrain on the training paragraphs only (held-out text is never seen)
    t0, c0 = time.perf_counter(), time.process_time()
    if args.score_only:  # everything from the run's own record
        prev = json.loads((out / "results.json").read_text())
        args.base = str(out / "base")
        s = argparse.Namespace(num_parameters=prev["parameters"], steps=prev["pretrain_steps"],
                               val_loss=prev["pretrain_val_loss"])
        pre_cpu = prev.get("pretrain_cpu_seconds")
    elif args.base:  # reuse: copy the base run, report its recorded time
        shutil.copytree(args.base, out / "base")
        prev = json.loads((Path(args.base).parent / "results.json").read_text())
        s = argparse.Namespace(num_parameters=prev["parameters"], steps=prev["pretrain_steps"],
                               val_loss=prev["pretrain_val_loss"])
        pre_cpu = prev.get("pretrain_cpu_seconds")
    else:
        s = None
    base_model, tok, s = (None, None, s) if s is not None else train_lm(
        text=("\n\n".join(train_texts) if not args.pretrain_words else
              words_prefixed_text(train_texts, args.pretrain_words, args.pretrain_prefix, args.words_from,
                                  args.order, args.first_words)),
        preset="baby-shakespeare", tokenizer="bpe", vocab_size=1024,
        model_overrides=dict(max_len=128, d_model=args.d_model, n_layer=args.n_layer, n_head=args.n_head,
                             dropout=0.0, position=args.position),
        train_config=TrainConfig(max_steps=args.pretrain_steps, batch_size=16, lr=args.pretrain_lr,
                                 min_lr=args.pretrain_lr / 10, warmup=50,
                                 eval_every=args.pretrain_steps, val_batches=8, val_batch_size=32),
        out=out / "base", progress_bar=False, logger=False, accelerator="cpu")
    t_pre = time.perf_counter() - t0 if not args.base else prev["pretrain_seconds"]
    cpu_pre = time.process_time() - c0 if not args.base else pre_cpu
    print(f"pretrained {s.num_parameters:,} parameters for {s.steps} steps in {t_pre:.0f} s: val loss "
          f"{s.val_loss:.3f}", flush=True)

    # 2. fine-tune on the conversations (masked loss, decoderlab template)
    t0, c0 = time.perf_counter(), time.process_time()
    if args.score_only:
        fs = argparse.Namespace(steps=prev["finetune_steps"], evaluation=prev["finetune_evaluation"])
        t_ft, cpu_ft = prev["finetune_seconds"], prev["finetune_cpu_seconds"]
    else:
        _, _, fs = finetune(
            train, val_data=held, checkpoint=out / "base", out=out / "chat", template="decoderlab",
            train_config=TrainConfig(max_steps=args.finetune_steps, batch_size=args.finetune_batch,
                                     lr=args.finetune_lr, min_lr=args.finetune_lr / 10, warmup=20,
                                     eval_every=args.finetune_steps, val_batch_size=32),
            eval_prompts=args.held_out, eval_max_new_tokens=args.max_new_tokens, progress_bar=False,
            logger=False, accelerator="cpu")
        t_ft = time.perf_counter() - t0
        cpu_ft = time.process_time() - c0  # includes finetune's own held-out evaluation (eval_prompts replies)
    print(f"fine-tuned for {fs.steps} steps in {t_ft:.0f} s ({cpu_ft / 60:.1f} CPU-minutes); held-out "
          f"evaluation: {fs.evaluation}", flush=True)

    # 3. held-out prompts: fine-tuned (chat template, greedy) vs base (the prompt as text, greedy)
    chat_model, chat_tok, template, _ = load_model(out / "chat")
    base, btok = load_checkpoint(out / "base")
    decodings = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.7, top_k=40, seed=1)}
    decodings = {k: decodings[k] for k in args.decodings.split(",")}
    scores, transcripts = {}, []
    df: dict[str, int] = {}
    for t in train_texts:
        for w in content_words(t):
            df[w] = df.get(w, 0) + 1
    common = set(sorted(df, key=df.get, reverse=True)[:50])
    for dname, dec in decodings.items():
        ft_counts, base_counts, ended = [], [], 0
        for conv in held[: args.held_out]:
            prompt = conv[0]["content"]
            words = words_of_prompt(prompt)
            info: dict = {}
            reply = chat_reply(chat_model, [conv[0]], chat_tok, template, max_new_tokens=args.max_new_tokens,
                               info=info, **dec)
            ended += info["ended_with_end_of_turn"]
            base_reply = btok.decode(generate(base, btok.encode(prompt + "\n"), args.max_new_tokens, **dec))
            ft_counts.append(word_coverage(reply, words))
            base_counts.append(word_coverage(base_reply, words))
            transcripts.append({"decoding": dname, "prompt": prompt, "fine_tuned": reply, "base": base_reply,
                                "ended_with_end_of_turn": info["ended_with_end_of_turn"]})
        scores[dname] = {"fine_tuned": coverage_table(ft_counts), "base": coverage_table(base_counts),
                         "end_of_turn_rate": ended / len(ft_counts)}
        # harder prompts: at least one word outside the 50 content words found in most training paragraphs
        hard = [i for i, conv in enumerate(held[: args.held_out])
                if any(w not in common for w in words_of_prompt(conv[0]["content"]))]
        if hard:
            scores[dname]["harder_prompts"] = {
                "n": len(hard), "fine_tuned_all_three": sum(ft_counts[i] == 3 for i in hard) / len(hard),
                "base_all_three": sum(base_counts[i] == 3 for i in hard) / len(hard)}
    wall = time.perf_counter() - t_start
    cpu = time.process_time()  # CPU seconds of this process (all threads)
    res = {"scores": scores, "prompts": len(ft_counts), "args": vars(args), "pretrain_cpu_seconds": cpu_pre,
           "finetune_cpu_seconds": cpu_ft,
           "pretrain_seconds": t_pre, "finetune_seconds": t_ft, "wall_seconds": wall, "cpu_seconds": cpu,
           "pretrain_steps": s.steps, "finetune_steps": fs.steps, "parameters": s.num_parameters,
           "pretrain_val_loss": s.val_loss, "finetune_evaluation": fs.evaluation,
           "train_conversations": len(train), "threads": args.threads, "transcripts": transcripts}
    (out / ("results_rescored.json" if args.score_only else "results.json")).write_text(json.dumps(res, indent=2))
    print("\n| decoding | model | all three words | at least one | none | end of turn |")
    print("|---|---|---|---|---|---|")
    for dname, sc in scores.items():
        for name in ("base", "fine_tuned"):
            r = sc[name]
            eot = f"{sc['end_of_turn_rate']:.0%}" if name == "fine_tuned" else "n/a (no template)"
            print(f"| {dname} | {name.replace('_', '-')} | {r['all_three']:.0%} | {r['at_least_one']:.0%} | "
                  f"{r['none']:.0%} | {eot} |")
    for dname, sc in scores.items():
        if "harder_prompts" in sc:
            h = sc["harder_prompts"]
            print(f"{dname}: on the {h['n']} prompts with a word outside the 50 most common, all three: "
                  f"fine-tuned {h['fine_tuned_all_three']:.0%}, base {h['base_all_three']:.0%}")
    print(f"\n{len(ft_counts)} held-out prompts; pretraining {t_pre:.0f} s + fine-tuning {t_ft:.0f} s wall; "
          f"CPU-minutes: pretraining {(cpu_pre or 0) / 60:.1f} + fine-tuning {cpu_ft / 60:.1f} = "
          f"{((cpu_pre or 0) + cpu_ft) / 60:.1f}; whole script (with scoring) {wall:.0f} s wall, "
          f"{cpu / 60:.1f} CPU-minutes, {args.threads} thread(s)")
    t = transcripts[-len(ft_counts)]  # the last decoding's first prompt
    print(f"\ntranscript ({t['decoding']}):\n> {t['prompt']}\n{t['fine_tuned']}\n(base model: {t['base'][:200]!r})")
    if args.rl:
        res["rl"] = rl_stage(args, out, train, held, common)
        (out / "results.json").write_text(json.dumps(res, indent=2))
    return 0


def score_chat(model, tok, template, held, common, max_new_tokens) -> dict:
    """Greedy replies to the held-out prompts: all three words, on the harder prompts too, end of turn, mean
    length in words, share of replies under ``SHORT_WORDS`` words, and the first three replies."""
    counts, ended, lengths, hard, replies = [], 0, [], [], []
    for conv in held:
        words = words_of_prompt(conv[0]["content"])
        info: dict = {}
        reply = chat_reply(model, [conv[0]], tok, template, max_new_tokens=max_new_tokens, info=info, temperature=0.0)
        counts.append(word_coverage(reply, words))
        ended += info["ended_with_end_of_turn"]
        lengths.append(len(reply.split()))
        replies.append(reply)
        if any(w not in common for w in words):
            hard.append(counts[-1] == 3)
    return {**coverage_table(counts), "harder_all_three": sum(hard) / max(len(hard), 1), "harder_n": len(hard),
            "end_of_turn_rate": ended / len(held), "mean_words": sum(lengths) / len(lengths),
            "under_15_words": sum(n < SHORT_WORDS for n in lengths) / len(lengths), "samples": replies[:3]}


def rl_stage(args, out: Path, train, held, common) -> dict:
    """``rl --reward contains_words`` from the fine-tuned model on training prompts, the SFT control of as many
    steps on the same prompts' reference replies, both scored as the fine-tuned model on the held-out prompts."""
    from decoderlab.config import RLConfig
    from decoderlab.reinforcement import rl

    convs = train[: args.rl_prompts]
    rows = [{"messages": [c[0]], "words": words_of_prompt(c[0]["content"])} for c in convs]
    t0, c0 = time.perf_counter(), time.process_time()
    _, _, rs = rl(rows, checkpoint=out / "chat", out=out / "rl", reward="contains_words",
                  rl_config=RLConfig(group_size=args.rl_group, max_new_tokens=args.max_new_tokens, kl_coef=args.rl_kl),
                  config_overrides=dict(max_steps=args.rl_steps, batch_size=args.rl_batch, lr=args.rl_lr,
                                        min_lr=args.rl_lr, eval_every=args.rl_steps, log_every=10),
                  accelerator="cpu", progress_bar="plain", logger=False)
    rl_wall, rl_cpu = time.perf_counter() - t0, time.process_time() - c0
    finetune(convs, checkpoint=out / "chat", out=out / "control", val_fraction=0, eval_prompts=0,
             train_config=TrainConfig(max_steps=args.rl_steps, batch_size=args.rl_batch * args.rl_group,
                                      lr=args.finetune_lr / 10, min_lr=args.finetune_lr / 10, warmup=0,
                                      eval_every=args.rl_steps), progress_bar=False, logger=False, accelerator="cpu")
    held = held[: args.held_out]
    scores = {name: score_chat(*load_model(out / name)[:3], held, common, args.max_new_tokens)
              for name in ("chat", "control", "rl")}
    print("\n| model | all three words | harder prompts: all three | end of turn | mean words | under 15 words |")
    print("|---|---|---|---|---|---|")
    for name, label in (("chat", "fine-tuned"), ("control", f"+{args.rl_steps} SFT steps (control)"),
                        ("rl", f"+{args.rl_steps} RL steps")):
        sc = scores[name]
        print(f"| {label} | {sc['all_three']:.0%} | {sc['harder_all_three']:.0%} of {sc['harder_n']} | "
              f"{sc['end_of_turn_rate']:.0%} | {sc['mean_words']:.1f} | {sc['under_15_words']:.0%} |")
    print(f"RL stage: {rs.steps} steps in {rl_wall:.0f} s wall, {rl_cpu / 60:.1f} CPU-minutes; mean reward "
          f"{rs.reward_start:.3f} -> {rs.reward_end:.3f}; KL to the fine-tuned model at the end "
          f"{rs.history[-1]['kl']:.4f} nats/token")
    for name in ("chat", "rl"):
        print(f"\n{name} replies:\n" + "\n".join(f"  - {r[:300]!r}" for r in scores[name]["samples"]))
    return {"scores": scores, "rl_seconds": rl_wall, "rl_cpu_seconds": rl_cpu, "rl_history": rs.history}


if __name__ == "__main__":
    sys.exit(main())
