"""``decoderlab tasks make``: checkable questions written as chat JSONL (``finetune``) or prompts (``rl``)."""

from __future__ import annotations

import argparse

from .argtypes import number

DESCRIPTION = ("Write checkable questions: seeded, split into train and held-out by a hash of the question (no "
               "held-out question is ever in a train file, whatever the seeds). --format chat writes conversations "
               "for `decoderlab finetune`; --format prompts writes prompts with a reference for `decoderlab rl "
               "--reward number` (or exact, as each row's \"reward\" says).")


def add_tasks(p) -> None:
    p.description = DESCRIPTION
    sub = p.add_subparsers(dest="action", required=True, help="make: write questions to a file")
    m = sub.add_parser("make", help="write N questions of a task to a JSONL file")
    m.description = DESCRIPTION
    m.error = p.error  # one-line errors naming `decoderlab tasks`
    m.add_argument("--task", required=True,
                   help="a family (arithmetic, spelling, comparison, tool) or one skill (addition, subtraction, "
                        "multiplication, letter_count, backwards, first_letter, last_letter, larger, smallest, "
                        "big_multiplication)")
    m.add_argument("--split", default="train", help="train or held-out (default: train)")
    m.add_argument("--n", type=number(int), required=True, help="how many questions (>= 1)")
    m.add_argument("--out", required=True, help="the JSONL file to write")
    m.add_argument("--format", default="chat", choices=("chat", "prompts", "pairs"),
                   help="chat: conversations for finetune; prompts: questions with a reference for rl; pairs: "
                        "chosen / rejected answers for finetune --method dpo (default chat)")
    m.add_argument("--difficulty", type=number(int), default=None,
                   help="one difficulty for every question (default: each drawn from the skill's range)")
    m.add_argument("--seed", type=number(int, 0), default=0, help="the seed of the draws (default 0)")
    p.set_defaults(func=cmd_tasks)


def cmd_tasks(args: argparse.Namespace) -> int:
    from ..tasks import generate, write_rows

    try:
        items = generate(args.task, args.split, args.n, seed=args.seed, difficulty=args.difficulty)
    except ValueError as e:  # the library's names in the flags' words
        raise ValueError(str(e).replace("n must", "--n must", 1).replace("difficulty ", "--difficulty ", 1)
                         .replace("unknown split", "unknown --split", 1).replace("unknown task", "unknown --task", 1)
                         ) from None
    n = write_rows(items, args.out, args.format)
    short = f" (the {args.split} split of {args.task} holds no more distinct questions)" if n < args.n else ""
    print(f"wrote {n} {args.format} rows of {args.task} ({args.split}) to {args.out}{short}")
    return 0
