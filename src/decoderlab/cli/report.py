"""``decoderlab report RUN_DIR``: the report card of a recipe run (report.md, report.png, card.json)."""

from __future__ import annotations

from .argtypes import number
from .options import THREADS_OPTIONS, add_options, set_threads

DESCRIPTION = ("Score every stage of a recipe run (base/, sft/, control/, rl/: those present) greedily on the same "
               "held-out questions per task, with the calculator off and on, and write report.md, report.png and "
               "card.json in the run directory (bench/recipe.py builds such a run).")


def add_report(p) -> None:
    p.description = DESCRIPTION
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (bench/recipe.py --out)")
    p.add_argument("--questions", type=number(int, 1), default=50,
                   help="held-out questions per task row (default 50)")
    add_options(p, THREADS_OPTIONS)
    p.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    from ..reportcard import report, run_stages

    run_stages(args.run_dir)  # not a run: one line before torch loads anything heavy
    set_threads(args)
    card = report(args.run_dir, questions=args.questions)
    print(card["markdown"])
    print(f"wrote {card['path']}, report.png and card.json")
    return 0
