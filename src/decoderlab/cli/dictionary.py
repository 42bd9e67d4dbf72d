"""``decoderlab sae`` (train a sparse autoencoder on a checkpoint's activations, saved in SAELens's format) and
``decoderlab features`` (one feature's dashboard: top contexts, histogram, logit effects, density)."""

from __future__ import annotations

import re

from .argtypes import number
from .options import (RUN_OPTIONS, THREADS_OPTIONS, add_checkpoint_option, add_options, check_checkpoint, dest,
                      progress_mode, run_out, say_wrote, set_threads)

#: the library's field names at the start of its messages -> the flags
_FLAGS = {"hook": "--hook", "width": "--width", "k": "--k", "tokens": "--tokens", "batch_tokens": "--batch-tokens",
          "context": "--context", "lr": "--lr", "feature": "--feature", "data": "--data"}


def _in_flags(e: ValueError) -> ValueError:
    m = re.match(r"(\w+) ", str(e))
    if m and m.group(1) in _FLAGS:
        return ValueError(_FLAGS[m.group(1)] + str(e)[len(m.group(1)):])
    return e


def add_sae(p) -> None:
    p.description = ("Train a sparse autoencoder (TopK, or ReLU + L1 with --l1) on one hook point of a checkpoint, "
                     "on activations streamed from the model over its own training corpus (or --data); decoder "
                     "rows kept at unit norm, dead features resampled; saved in SAELens's format (cfg.json + "
                     "sae_weights.safetensors) with its held-out evaluation (L0, explained variance, MSE, dead "
                     "share, CE loss recovered).")
    add_checkpoint_option(p)
    p.add_argument("--hook", default=None, metavar="NAME",
                   help="the hook point read (default: blocks.<n_layer // 2>.hook_resid_post, a middle layer)")
    # the bounds are checked as the line is parsed: a bad value is named before a model loads
    p.add_argument("--width", type=number(int, 1), default=8, metavar="W", help="features per d_model (default 8)")
    p.add_argument("--k", type=number(int, 1), default=32, metavar="K",
                   help="active features per token of the TopK SAE (default 32)")
    p.add_argument("--l1", action="store_true", help="the ReLU + L1 variant instead of TopK (default: TopK)")
    p.add_argument("--l1-coefficient", type=number(float, 0), default=5.0, metavar="X",
                   help="the L1 penalty of --l1 (default 5.0)")
    p.add_argument("--tokens", type=number(int, 1), default=2_000_000, metavar="N",
                   help="training tokens (default 2,000,000)")
    p.add_argument("--batch-tokens", type=number(int, 1), default=4096, metavar="N",
                   help="tokens per step (default 4096)")
    p.add_argument("--lr", type=number(float, 0, above=True), default=None, metavar="X",
                   help="Adam's learning rate (default 1e-3)")
    p.add_argument("--seed", type=number(int), default=42, metavar="N", help="random seed (default 42)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="the text to read (a file or a folder of .txt files; default: the checkpoint's training corpus)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="the SAE's directory to write (default: none; give it, or --resume DIR)")
    add_options(p, [o for o in RUN_OPTIONS if dest(o) in ("resume", "no_progress_bar")])
    add_options(p, THREADS_OPTIONS)
    p.set_defaults(func=cmd_sae)


def cmd_sae(args) -> int:
    check_checkpoint(args.checkpoint)
    from ..dictionary import SAETrainConfig, train_sae
    from ..dictionary.run import DEFAULT_LR

    out = run_out(args)
    set_threads(args)
    # no --hook: the library's default, read from the model however it is stored (a directory, a GGUF file)
    cfg = SAETrainConfig(hook=args.hook, width=args.width, k=None if args.l1 else args.k,
                         l1_coefficient=args.l1_coefficient, tokens=args.tokens, batch_tokens=args.batch_tokens,
                         lr=DEFAULT_LR if args.lr is None else args.lr, seed=args.seed)
    try:
        run = train_sae(args.checkpoint, cfg, out=out, data=args.data, resume=args.resume is not None,
                        progress_bar=progress_mode(args))
    except ValueError as e:
        raise _in_flags(e) from None
    print(run.evaluation.table())
    print(f"trained in {run.seconds:.1f} s; {run.resampled} features resampled; wrote {run.out} (SAELens's format)")
    return 0


def add_features(p) -> None:
    p.description = ("One feature's dashboard: its top activating contexts on the held-out text (the token in "
                     "[[ ]]), its activation histogram, its logit effects (the decoder direction through the final "
                     "norm and the output layer) and its density.")
    p.add_argument("--sae", required=True, metavar="DIR", help="an SAE directory written by `decoderlab sae`")
    p.add_argument("--feature", type=number(int), required=True, metavar="F", help="the feature's index, 0 .. d_sae - 1")
    p.add_argument("--contexts", type=number(int, 1), default=12, metavar="N",
                   help="top contexts shown (default 12)")
    p.add_argument("--tokens", type=number(int, 1), default=65_536, metavar="N",
                   help="held-out tokens read (default 65,536)")
    p.add_argument("--png", default=None, metavar="FILE", help="also draw the dashboard to this PNG file (default: none)")
    p.add_argument("--html", default=None, metavar="FILE", help="also write it as a self-contained HTML page (default: none)")
    add_options(p, THREADS_OPTIONS)
    p.set_defaults(func=cmd_features)


def cmd_features(args) -> int:
    from ..dictionary.features import open_sae_run
    from ..glassbox.dashboards import dashboard_text, save_dashboard
    from ..glassbox.features import check_feature, feature_dashboard
    from ..glassbox.figures import check_out_path

    for path, what in ((args.png, "PNG"), (args.html, "HTML")):
        if path:
            check_out_path(path, what)
    set_threads(args)
    opened = open_sae_run(args.sae)
    try:
        check_feature(opened.sae, args.feature)
    except ValueError as e:
        raise _in_flags(e) from None
    windows = opened.held_out(args.tokens)
    d = feature_dashboard(opened.model, opened.sae, opened.hook, args.feature, windows[:, :-1],
                          n_contexts=args.contexts)
    print(dashboard_text(d, opened.tokenizer))
    save_dashboard(d, opened.tokenizer, png=args.png, html=args.html)
    for path, kind in ((args.png, "png"), (args.html, "html")):
        if path:
            say_wrote(path, kind)
    return 0
