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
    p = sub.add_parser("train", help="train a model (default: the baby-shakespeare-speedrun recipe on the embedded "
                                     "tinyshakespeare)")
    p.add_argument("--preset", default=None,
                   help="recipe or model preset (default baby-shakespeare-speedrun; baby-shakespeare-nanogpt is "
                        "nanoGPT's CPU baby run; statquest trains the lesson's pairs)")
    p.add_argument("--out", default=None, help="run/checkpoint directory to write (default runs/<timestamp>)")
    p.add_argument("--epochs", type=int, default=30, help="epochs for pair training (statquest)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default 42)")
    g = p.add_argument_group("language-model training (defaults: decoderlab.training.TrainConfig)")
    g.add_argument("--data", default=None, help="a text file or a folder of .txt files (default: the embedded "
                                                "tinyshakespeare)")
    g.add_argument("--tokenizer", default=None, choices=("char", "word", "bpe"), help="default char")
    g.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size")
    g.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default 2000)")
    g.add_argument("--batch-size", type=int, default=None, help="sequences per batch per process (default 12)")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3)")
    g.add_argument("--min-lr", type=float, default=None, help="final learning rate of the cosine (default 1e-4)")
    g.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 100)")
    g.add_argument("--precision", default=None, choices=("32", "bf16-mixed"))
    g.add_argument("--compile", action="store_true", default=None, help="torch.compile the model")
    g.add_argument("--eval-every", type=int, default=None, help="steps between validations (default 250)")
    g.add_argument("--val-batches", type=int, default=None, help="cap on validation batches (default: all)")
    g.add_argument("--grad-clip", type=float, default=None, help="gradient norm clip, 0 = off (default 1.0)")
    g.add_argument("--accumulate", type=int, default=None, help="batches per optimizer step (default 1)")
    g.add_argument("--resume", nargs="?", const=True, default=None, metavar="RUN_DIR",
                   help="continue a run (its directory or a .ckpt; without a value: --out)")
    g.add_argument("--devices", default="1", help="processes/devices per node (Lightning)")
    g.add_argument("--strategy", default="auto", help="Lightning strategy: auto, ddp, fsdp, ...")
    g.add_argument("--num-nodes", type=int, default=1)
    g.add_argument("--no-progress-bar", action="store_true", help="hide Lightning's progress bar")
    g.add_argument("--optimizer", default=None, choices=("adamw", "muon"),
                   help="muon: Muon for the blocks' weight matrices, AdamW (--lr) for the rest")
    g.add_argument("--muon-lr", type=float, default=None, help="Muon's peak learning rate")
    g.add_argument("--schedule", default=None, choices=("cosine", "wsd"), help="learning-rate schedule")
    g.add_argument("--full-val-below", type=float, default=None,
                   help="with --val-batches: evaluate all validation windows when the subset's loss is <= this")
    _add_threads_option(p)
    p.set_defaults(func=cmd_train)


def _add_threads_option(p) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads (default: the cores the 1-minute load average leaves idle, 1 or 2)")


def _set_threads(args) -> None:
    from .threads import set_threads

    set_threads(getattr(args, "threads", None))


_TRAIN_OPTIONS = ("max_steps", "batch_size", "lr", "min_lr", "warmup", "precision", "compile", "seed",
                  "eval_every", "val_batches", "grad_clip", "accumulate", "optimizer", "muon_lr", "schedule",
                  "full_val_below")


def cmd_train(args) -> int:
    from .recipes import DEFAULT_RECIPE

    _set_threads(args)
    name = args.preset or DEFAULT_RECIPE
    if name == "statquest":
        from .training import train_pairs

        lm_only = [opt for opt in ("data", "tokenizer", "vocab_size", "max_steps", "min_lr", "warmup", "precision",
                                   "compile", "eval_every", "val_batches", "grad_clip", "accumulate", "resume",
                                   "optimizer", "muon_lr", "schedule", "full_val_below")
                   if getattr(args, opt) is not None]
        lm_only += [opt for opt, default in (("devices", "1"), ("strategy", "auto"), ("num_nodes", 1))
                    if getattr(args, opt) != default]
        if lm_only:
            raise ValueError(
                f"--preset statquest trains the lesson's two pairs; {', '.join('--' + o.replace('_', '-') for o in lm_only)} "
                f"{'applies' if len(lm_only) == 1 else 'apply'} to language-model presets only (statquest takes --out, --epochs, --seed, --lr, --batch-size)"
            )
        out = args.out or "runs/statquest"
        model, tok = train_pairs(out=out, max_epochs=args.epochs, seed=42 if args.seed is None else args.seed,
                                 lr=0.1 if args.lr is None else args.lr,
                                 batch_size=1 if args.batch_size is None else args.batch_size)
        print(f"trained the lesson's model ({model.num_parameters()} parameters) on its two pairs; "
              f"checkpoint written to {out}")
        return 0
    from .training import NonFiniteLossError, train_lm

    overrides = {k: getattr(args, k) for k in _TRAIN_OPTIONS if getattr(args, k) is not None}
    devices = int(args.devices) if str(args.devices).isdigit() else args.devices
    try:
        model, tok, s = train_lm(args.data, preset=name, tokenizer=args.tokenizer or "char", vocab_size=args.vocab_size,
                                 out=args.out, config_overrides=overrides, resume=args.resume, devices=devices,
                                 strategy=args.strategy, num_nodes=args.num_nodes,
                                 progress_bar=not args.no_progress_bar)
    except NonFiniteLossError as e:
        print(f"decoderlab: error: {e}", file=sys.stderr)
        return 1
    if s.is_global_zero:
        print(f"trained {name} ({s.num_parameters:,} parameters) for {s.steps} steps: "
              f"train loss {s.train_loss:.4f}, val loss {s.val_loss:.4f} nats/token "
              f"(perplexity {s.val_ppl:.2f}, {s.val_bpb:.3f} bits per byte), "
              f"{s.tokens_per_second:,.0f} tokens per second; checkpoint written to {s.run_dir}")
    return 0


# ---------------------------------------------------------------------------------------------------------
# sample
# ---------------------------------------------------------------------------------------------------------


def add_sample(sub) -> None:
    p = sub.add_parser("sample", help="print a sample from a language model checkpoint")
    p.add_argument("--checkpoint", required=True, help="checkpoint (or training run) directory")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--max-new-tokens", type=int, default=300)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    _add_threads_option(p)
    p.set_defaults(func=cmd_sample)


def cmd_sample(args) -> int:
    from .checkpoint import load_checkpoint
    from .generation import generate

    _set_threads(args)
    model, tok = load_checkpoint(args.checkpoint)
    prompt_ids = tok.encode(args.prompt)
    ids = generate(model, prompt_ids, args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, seed=args.seed, tokenizer=tok)
    print(tok.decode(prompt_ids + ids))  # decoded together, so word tokens keep their separators
    return 0


# ---------------------------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------------------------


def _add_sampling_options(p, temperature_help: str) -> None:
    p.add_argument("--max-new-tokens", type=int, default=None, help="longest continuation in tokens (default 200)")
    p.add_argument("--temperature", type=float, default=None, help=temperature_help)
    p.add_argument("--top-k", type=int, default=None, help="sample among the K most probable tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: P in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a trained model (streamed as it is produced)",
                       description="Continue a prompt. A model trained on prompt/response pairs (the lesson's "
                                   "statquest) answers greedily with <EOS> appended to the prompt, as in the "
                                   "lesson; the sampling options apply to language models.")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory")
    _add_sampling_options(p, "sampling temperature, 0 = greedy (default 1.0)")
    p.add_argument("--stop", action="append", default=None, metavar="STR",
                   help="stop before this text (repeatable)")
    p.add_argument("--no-stream", action="store_true", help="print the continuation at the end")
    p.add_argument("prompt", help="the prompt text")
    _add_threads_option(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    from .checkpoint import load_checkpoint, read_meta
    from .generation import greedy_response

    _set_threads(args)
    model, tok = load_checkpoint(args.checkpoint)
    if read_meta(args.checkpoint).get("task") == "pairs":
        sampling = [o for o in ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop")
                    if getattr(args, o) is not None]
        if sampling:
            raise ValueError(f"{', '.join('--' + o.replace('_', '-') for o in sampling)} {'does' if len(sampling) == 1 else 'do'} not apply: a model trained "
                             "on prompt/response pairs answers greedily until <EOS>, as in the lesson")
        ids = tok.encode(args.prompt)
        if not ids or ids[-1] != tok.eos_id:
            ids.append(tok.eos_id)  # the CLI appends <EOS>; the library function does not
        print(tok.decode(greedy_response(model, ids, tok.eos_id)))  # the lesson: greedy, as it always was
        return 0
    from .generation import generate, stream_text

    kwargs = dict(temperature=1.0 if args.temperature is None else args.temperature, top_k=args.top_k,
                  top_p=args.top_p, stop=args.stop, seed=args.seed, tokenizer=tok)
    n = 200 if args.max_new_tokens is None else args.max_new_tokens
    if args.no_stream:
        print(tok.decode(generate(model, tok.encode(args.prompt), n, **kwargs)))
        return 0
    kwargs.pop("tokenizer")
    for piece in stream_text(model, tok, args.prompt, n, **kwargs):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


# ---------------------------------------------------------------------------------------------------------
# chat
# ---------------------------------------------------------------------------------------------------------


def add_chat(sub) -> None:
    p = sub.add_parser("chat", help="talk with a model; each turn continues the conversation (/help, Ctrl-D)")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory")
    _add_sampling_options(p, "sampling temperature (default: 0 = greedy for pair-trained models, else 1.0)")
    _add_threads_option(p)
    p.set_defaults(func=cmd_chat)


def cmd_chat(args) -> int:
    from .checkpoint import load_checkpoint, read_meta
    from .generation import ChatSession

    _set_threads(args)
    model, tok = load_checkpoint(args.checkpoint)
    session = ChatSession(model, tok, pairs=read_meta(args.checkpoint).get("task") == "pairs",
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          max_new_tokens=args.max_new_tokens, seed=args.seed)
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # pragma: no cover - not on every platform
        pass
    interactive = sys.stdin.isatty()
    if interactive:
        print("decoderlab chat -- /help for commands, Ctrl-D to exit")
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            if interactive:
                print()
            return 0
        except KeyboardInterrupt:
            print("\n(Ctrl-D to exit)")
            continue
        if not line.strip():
            continue
        message = session.command(line)
        if message is not None:
            print(message, flush=True)
            continue
        try:
            for piece in session.reply(line):
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            pass
        except (KeyError, ValueError) as e:
            msg = e.args[0] if isinstance(e, KeyError) and e.args else e
            print(f"error: {msg}", flush=True)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()


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
    if not report.ok:
        print(f"decoderlab: error: verify failed: some steps differ from the float64 reference by more than "
              f"--tol {args.tol}", file=sys.stderr)
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

COMMANDS = [add_train, add_sample, add_generate, add_chat, add_verify, add_explain]


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
    except (OSError, ValueError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"decoderlab: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
