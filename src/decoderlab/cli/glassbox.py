"""``decoderlab verify`` and ``decoderlab explain``: the glass box (``decoderlab.glassbox``) on the command line."""

from __future__ import annotations

import sys

from ..config.defaults import EXPLAIN_TOP_K, VERIFY_TOL
from ..config.names import EXAMPLES, HEAD_DETECTORS
from .argtypes import number
from .errors import FAILED
from .options import (DEVICE_OPTIONS, DTYPE_OPTIONS, THREADS_OPTIONS, add_checkpoint_option, add_options, load_model,
                      no_chat_template, say_wrote, set_threads)


def add_verify(p) -> None:
    p.description = ("Recompute the checkpoint's forward pass in float64 NumPy and compare every step. It runs on "
                     "the CPU by design (no --device): the float64 reference is the point, and Apple MPS has no "
                     "float64.")
    add_checkpoint_option(p)
    add_options(p, DTYPE_OPTIONS)
    p.add_argument("text", help="the input text")
    p.add_argument("--tol", type=number(float, 0, above=True), default=VERIFY_TOL, metavar="TOL",
                   help="tolerance per step, times max(1, max |value|), > 0 (default %(default)g)")
    add_options(p, THREADS_OPTIONS)
    p.set_defaults(func=cmd_verify)


def cmd_verify(args) -> int:
    from ..glassbox import verify

    set_threads(args)
    model, tok, _, _ = load_model(args)
    report = verify(model, args.text, tol=args.tol, tokenizer=tok)
    print(report.table())
    if report.overflow:
        print(f"decoderlab: error: verify failed: the {report.dtype} pass overflows at {report.overflow}; use "
              f"--dtype bfloat16 or float32", file=sys.stderr)
    elif not report.ok:
        print(f"decoderlab: error: verify failed: some steps differ from the float64 reference by more than "
              f"--tol {args.tol}", file=sys.stderr)
    return 0 if report.ok else FAILED


def add_explain(p) -> None:
    p.add_argument("--example", default=None, metavar="NAME",
                   help=f"a worked example: {', '.join(EXAMPLES)} (default: none)")
    add_checkpoint_option(p, required=False)
    add_options(p, DEVICE_OPTIONS)
    p.add_argument("text", nargs="?", default=None, help="the input text (with --checkpoint)")
    p.add_argument("--chat", action="store_true",
                   help="TEXT is a user message: explain the tokens a chat checkpoint sees before its reply, "
                        "rendered with its stored template (default: TEXT as it is)")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="a system message before TEXT, with --chat (default: none)")
    p.add_argument("--layer", type=number(int), default=None, metavar="N", help="only this layer (default: all)")
    p.add_argument("--head", type=number(int), default=None, metavar="N", help="only this head (default: all)")
    p.add_argument("--top-k", type=number(int, 1), default=EXPLAIN_TOP_K, metavar="K",
                   help="next-token probabilities to show per position (default %(default)s)")
    p.add_argument("--run", default=None, metavar="DIR",
                   help="a run trained with --watch-heads: each head's scores over the steps, beside the loss "
                        "(with --png / --html: drawn; default: none)")
    p.add_argument("--kind", default="induction", choices=HEAD_DETECTORS,
                   help="the head detector --run shows (default %(default)s)")
    p.add_argument("--png", default=None, metavar="FILE",
                   help="write attention heatmaps (with --run: the scores and the loss) to this PNG file "
                        "(default: none)")
    p.add_argument("--html", default=None, metavar="FILE",
                   help="write a self-contained HTML report to this file (default: none)")
    add_options(p, THREADS_OPTIONS)
    p.set_defaults(func=cmd_explain)


def _chat_tokens(args, tok, template):
    """The tokens a chat checkpoint sees before it answers ``args.text`` (the renderer of fine-tuning and chat)."""
    if template is None:
        raise no_chat_template(args.checkpoint)
    messages = ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
        {"role": "user", "content": args.text}]
    ids, _ = template.render(messages, tok, add_generation_prompt=True)
    return ids


def cmd_explain(args) -> int:
    from ..glassbox import explain, explain_example

    set_threads(args)
    if args.run is not None:
        return _explain_run(args)
    if args.example is not None:
        if args.checkpoint is not None or args.png or args.html or args.chat:
            raise ValueError("--example takes no --checkpoint, --png, --html or --chat")
        print(explain_example(args.example))
        return 0
    if args.checkpoint is None or args.text is None:
        raise ValueError("give --example NAME, or --checkpoint PATH and a TEXT")
    if args.system is not None and not args.chat:
        raise ValueError("--system applies with --chat")
    model, tok, template, _ = load_model(args)
    text_or_ids = _chat_tokens(args, tok, template) if args.chat else args.text
    print(explain(model, text_or_ids, tok, layer=args.layer, head=args.head, top_k=args.top_k,
                  png=args.png, html=args.html))
    for path, kind in ((args.png, "png"), (args.html, "html")):
        if path:
            say_wrote(path, kind)
    return 0


def _explain_run(args) -> int:
    """``explain --run DIR``: the head scores a ``--watch-heads`` run recorded -- when each head formed -- and the
    loss, as a table, and drawn one above the other with ``--png`` / ``--html``."""
    given = [f for f, v in (("--example", args.example), ("--checkpoint", args.checkpoint), ("TEXT", args.text),
                            ("--chat", args.chat), ("--system", args.system)) if v]
    if given:
        raise ValueError(f"--run reads a run's recorded head scores; it takes no {', '.join(given)}")
    from ..glassbox.figures import check_out_path
    from ..glassbox.watching import read_records, watch_table

    for path, what in ((args.png, "PNG"), (args.html, "HTML")):
        if path:
            check_out_path(path, what)
    records = read_records(args.run)
    text = watch_table(records, args.kind)
    print(text)
    if args.png or args.html:
        from ..glassbox.figures import save_html, save_png
        from ..glassbox.plotting import head_scores_figure

        fig = head_scores_figure(records, kind=args.kind)
        if args.png:
            save_png(fig, args.png)
            say_wrote(args.png, "png")
        if args.html:
            save_html(f"decoderlab: {args.kind} heads while training", text, fig, args.html)
            say_wrote(args.html, "html")
    return 0
