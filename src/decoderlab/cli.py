"""The ``decoderlab`` command line: thin commands over the library API.

Each subcommand parses its options and calls one library function; the commands hold no logic the Python
API lacks. Errors a user can cause (bad paths, bad values) print ``decoderlab: error: ...`` and exit 2.
"""

from __future__ import annotations

import argparse
import sys

from .tokenizers import EOS

# ---------------------------------------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------------------------------------


def add_train(sub) -> None:
    p = sub.add_parser("train", help="train a model (default: baby-shakespeare on the embedded tinyshakespeare)")
    p.add_argument("--preset", default=None, help="model preset (statquest trains the lesson's pairs)")
    p.add_argument("--out", default=None, help="checkpoint directory to write")
    p.add_argument("--epochs", type=int, default=30, help="epochs for pair training (statquest)")
    p.add_argument("--seed", type=int, default=42)
    p.set_defaults(func=cmd_train)


def cmd_train(args) -> int:
    name = args.preset or "statquest"
    if name == "statquest":
        from .training import train_pairs

        out = args.out or "runs/statquest"
        model, tok = train_pairs(out=out, max_epochs=args.epochs, seed=args.seed)
        print(f"trained the lesson's model ({model.num_parameters()} parameters) on its two pairs; "
              f"checkpoint written to {out}")
        return 0
    raise SystemExit(f"decoderlab: error: preset {name!r} is not trainable from the CLI yet")


# ---------------------------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------------------------


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a trained model")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory")
    p.add_argument("prompt", help="the prompt text")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    from .checkpoint import load_checkpoint, read_meta
    from .generation import greedy_response

    model, tok = load_checkpoint(args.checkpoint)
    if read_meta(args.checkpoint).get("task") == "pairs":
        ids = tok.encode(args.prompt)
        if not ids or ids[-1] != tok.eos_id:
            ids.append(tok.eos_id)  # the CLI appends <EOS>; the library function does not
        print(tok.decode(greedy_response(model, ids, tok.eos_id)))
        return 0
    raise SystemExit("decoderlab: error: this checkpoint was not trained on prompt/response pairs")


# ---------------------------------------------------------------------------------------------------------
# verify, explain (the glass box)
# ---------------------------------------------------------------------------------------------------------


def add_verify(sub) -> None:
    p = sub.add_parser("verify", help="recompute a checkpoint's forward pass in float64 NumPy and compare every step")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory")
    p.add_argument("text", help="the input text")
    p.add_argument("--tol", type=float, default=1e-5, help="tolerance per step (x max(1, max |value|))")
    p.set_defaults(func=cmd_verify)


def cmd_verify(args) -> int:
    from .checkpoint import load_checkpoint
    from .glassbox import verify

    model, tok = load_checkpoint(args.checkpoint)
    report = verify(model, args.text, tol=args.tol, tokenizer=tok)
    print(report.table())
    return 0 if report.ok else 1


def add_explain(sub) -> None:
    from .glassbox import EXAMPLES

    p = sub.add_parser("explain", help="print every attention number step by step (a worked example or a checkpoint)")
    p.add_argument("--example", default=None,
                   help=f"a worked example: {', '.join(EXAMPLES)}")
    p.add_argument("--checkpoint", default=None, help="checkpoint directory")
    p.add_argument("text", nargs="?", default=None, help="the input text (with --checkpoint)")
    p.add_argument("--layer", type=int, default=None, help="only this layer (default: all)")
    p.add_argument("--head", type=int, default=None, help="only this head (default: all)")
    p.add_argument("--top-k", type=int, default=5, help="next-token probabilities to show per position")
    p.add_argument("--png", default=None, help="write attention heatmaps to this PNG file")
    p.add_argument("--html", default=None, help="write a self-contained HTML report to this file")
    p.set_defaults(func=cmd_explain)


def cmd_explain(args) -> int:
    from .glassbox import explain, explain_example

    if args.example is not None:
        if args.checkpoint is not None or args.png or args.html:
            raise ValueError("--example takes no --checkpoint, --png or --html")
        print(explain_example(args.example))
        return 0
    if args.checkpoint is None or args.text is None:
        raise ValueError("give --example NAME, or --checkpoint DIR and a TEXT")
    print(explain(args.checkpoint, args.text, layer=args.layer, head=args.head, top_k=args.top_k,
                  png=args.png, html=args.html))
    return 0


# ---------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------

COMMANDS = [add_train, add_generate, add_verify, add_explain]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="decoderlab",
        description="Build, verify, train, inspect and chat with decoder-only (GPT-style) transformers.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except (FileNotFoundError, ValueError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"decoderlab: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
