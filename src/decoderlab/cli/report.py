"""``decoderlab report RUN_DIR``: the report card of a recipe run (report.md, report.png, card.json)."""

from __future__ import annotations

from .argtypes import number
from .options import THREADS_OPTIONS, add_options, set_threads

DESCRIPTION = ("Score every stage of a recipe run (base/, sft/, control/, rl/: those present) on the same held-out "
               "questions per task -- greedily with the calculator off and on, and K sampled replies per question at "
               "temperature 1 for the chat stages (pass@1 and pass@K) -- with the 95% interval of every number and "
               "the paired interval of every stage-to-stage difference, and write report.md, report.png and "
               "card.json (each question's outcome) in the run directory (bench/recipe.py builds such a run).")


def add_report(p) -> None:
    from ..config.defaults import REPORT_QUESTIONS as QUESTIONS, REPORT_SAMPLES as SAMPLES

    p.description = DESCRIPTION
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (bench/recipe.py --out)")
    p.add_argument("--questions", type=number(int, 1), default=QUESTIONS, metavar="N",
                   help=f"held-out questions per task row (default {QUESTIONS}: a 95%% interval of at most +-5 points)")
    p.add_argument("--samples", type=number(int, 1), default=SAMPLES, metavar="K",
                   help=f"sampled replies per question for pass@1 and pass@K (default {SAMPLES})")
    p.add_argument("--rows", default=None, metavar="SKILL:D,...",
                   help="the rows to score, skill:difficulty comma-separated (default: the card's rows)")
    p.add_argument("--stages", default=None, metavar="STAGE,...",
                   help="the stages to score, comma-separated: base, sft, control, rl (default: those the run holds)")
    add_options(p, THREADS_OPTIONS)
    p.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    from ..reportcard import ROWS, parse_rows, parse_stages, report, run_stages

    run_stages(args.run_dir)  # not a run: one line before torch loads anything heavy
    stages = parse_stages(args.stages, args.run_dir) if args.stages is not None else None
    try:
        rows = parse_rows(args.rows) if args.rows is not None else ROWS
    except ValueError as e:
        raise ValueError(f"--rows: {e}") from None
    set_threads(args)
    card = report(args.run_dir, questions=args.questions, samples=args.samples, rows=rows, stages=stages)
    print(card["markdown"])
    print(f"wrote {card['path']}, report.png and card.json")
    return 0
