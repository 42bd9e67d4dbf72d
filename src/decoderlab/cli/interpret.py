"""``decoderlab lens``, ``decoderlab heads`` and ``decoderlab patch``: the glass box's questions on the command
line -- what each layer predicts and which parts wrote a logit, what each head does and what breaks without it,
which activations carry the answer -- each printed as a table and, with ``--png`` / ``--html``, drawn
(``decoderlab.glassbox``: logit_lens, decompose, all_head_scores, composition_scores, zero_ablation,
activation_patching; ``decoderlab.glassbox.figures`` draws them)."""

from __future__ import annotations

from ..config.defaults import EXPLAIN_TOP_K
from ..config.names import HEAD_DETECTORS, PATCH_AXES, PATCH_POINTS
from .argtypes import head_ref, number
from .options import THREADS_OPTIONS, add_checkpoint_option, add_options, load_model, say_wrote, set_threads


def _add_outputs(p, what: str) -> None:
    p.add_argument("--png", default=None, metavar="FILE", help=f"also draw {what} to this PNG file (default: none)")
    p.add_argument("--html", default=None, metavar="FILE",
                   help=f"also write a self-contained HTML page of {what} and the table (default: none)")


def _check_outputs(args) -> None:
    """The --png / --html paths, checked before the model is loaded (an unwritable one costs no work)."""
    if args.png or args.html:
        from ..glassbox.figures import check_out_path

        for path, what in ((args.png, "PNG"), (args.html, "HTML")):
            if path:
                check_out_path(path, what)


def _draw(args, title: str, text: str, figure) -> None:
    """The ``--png`` / ``--html`` files of ``figure()`` (drawn only when one is asked for)."""
    if not (args.png or args.html):
        return
    from ..glassbox.figures import save_html, save_png

    fig = figure()
    if args.png:
        save_png(fig, args.png)
        say_wrote(args.png, "png")
    if args.html:
        save_html(title, text, fig, args.html)
        say_wrote(args.html, "html")


def _not_empty(text: str | None, what: str) -> None:
    """An empty text refused before the model is read (seconds, for a real model's file)."""
    if text is not None and not text:
        raise ValueError(f"{what} is empty: give at least one token of text")


def _ids(model, tok, text: str, what: str) -> list[int]:
    """``text``'s ids, checked against the model (empty, too long, unknown words: an error naming ``what``)."""
    from ..glassbox.cache import as_ids

    _not_empty(text, what)
    try:
        return as_ids(model, text, tok)[0].tolist()
    except (ValueError, KeyError) as e:
        raise ValueError(f"{what}: {e.args[0] if isinstance(e, KeyError) else e}") from None


def _one_token(tok, text: str, flag: str) -> int:
    ids = tok.encode(text)
    if len(ids) != 1:
        raise ValueError(f"{flag} {text!r} is {len(ids)} tokens for this tokenizer; give the text of one token")
    return ids[0]


# ---- lens ------------------------------------------------------------------------------------------------

def add_lens(p) -> None:
    p.description = ("The logit lens at a position: the next token read from every layer's residual stream "
                     "through the final norm and the output layer; then that token's logit split into what wrote "
                     "it (embeddings, positions, each head, each MLP, the biases), the parts adding up to it.")
    add_checkpoint_option(p)
    p.add_argument("text", help="the input text")
    p.add_argument("--pos", type=number(int), default=-1, metavar="P",
                   help="the token position read (negative counts from the end; default -1, the last)")
    p.add_argument("--top-k", type=number(int, 1), default=EXPLAIN_TOP_K, metavar="K",
                   help="tokens listed per layer (default %(default)s)")
    p.add_argument("--token", default=None, metavar="TEXT",
                   help="the token whose logit is split (its text; default: the model's most probable one)")
    _add_outputs(p, "the lens at every position")
    add_options(p, THREADS_OPTIONS)
    p.set_defaults(func=cmd_lens)


def cmd_lens(args) -> int:
    from ..glassbox import decompose, logit_lens, run_with_cache

    _check_outputs(args)
    _not_empty(args.text, "the text")
    set_threads(args)
    model, tok, _, _ = load_model(args)
    ids = _ids(model, tok, args.text, "the text")
    _, cache = run_with_cache(model, ids)
    try:
        at = logit_lens(cache, args.pos).positions[0]  # checks the position, naming the valid ones
    except ValueError as e:
        raise ValueError(f"--pos{str(e).removeprefix('position')}") from None
    lens = logit_lens(cache)
    token = int(cache.logits[0, at].argmax()) if args.token is None else _one_token(tok, args.token, "--token")
    text = lens.table(position=at, k=args.top_k, tokenizer=tok) + "\n\n" + decompose(cache, at, token).table(tok)
    print(text)
    tokens = [tok.decode([i]) for i in ids]
    _draw(args, "decoderlab: logit lens", text, lambda: _figures().lens_figure(lens, tokens, tok))
    return 0


def _figures():
    from ..glassbox import figures

    return figures


# ---- heads -----------------------------------------------------------------------------------------------

def add_heads(p) -> None:
    p.description = ("Every head's previous-token, duplicate-token and induction scores (TransformerLens's "
                     "head_detector definitions), on TEXT or on random tokens repeated twice; with --composition "
                     "the Q/K/V composition between heads of different layers; with --ablate, the next-token "
                     "distribution after TEXT with those heads' outputs set to zero, beside the clean one.")
    add_checkpoint_option(p)
    p.add_argument("text", nargs="?", default=None,
                   help="score the heads on this text (default: the probe, random tokens repeated twice, as "
                        "train --watch-heads records)")
    p.add_argument("--composition", action="store_true",
                   help="also list the strongest composition scores (needs 2 layers or more; default: off)")
    p.add_argument("--ablate", type=head_ref, action="append", default=None, metavar="LxHy",
                   help="zero-ablate this head (e.g. L1H0; repeat for more) and show the next token's change "
                        "after TEXT (default: none)")
    p.add_argument("--top-k", type=number(int, 1), default=EXPLAIN_TOP_K, metavar="K",
                   help="tokens listed with --ablate (default %(default)s)")
    _add_outputs(p, "the scores as one heatmap per detector")
    add_options(p, THREADS_OPTIONS)
    p.set_defaults(func=cmd_heads)


def _check_heads(model, heads) -> None:
    n_layer, n_head = model.config.n_layer, model.config.n_head
    for layer, head in heads:
        if layer >= n_layer or head >= n_head:
            raise ValueError(f"--ablate L{layer}H{head}: this model has no such head; layers are 0 .. {n_layer - 1}, "
                             f"heads 0 .. {n_head - 1}")


def cmd_heads(args) -> int:
    from ..glassbox import all_head_scores, scores_table
    from ..glassbox.watching import probe_tokens

    _check_outputs(args)
    _not_empty(args.text, "the text")
    set_threads(args)
    model, tok, _, _ = load_model(args)
    if args.ablate and args.text is None:
        raise ValueError("--ablate needs a TEXT: the next token after it is computed with and without the heads")
    _check_heads(model, args.ablate or [])
    ids = None if args.text is None else _ids(model, tok, args.text, "the text")
    if ids is not None and len(ids) < 2:
        raise ValueError("the text is one token: the detectors compare a token with earlier ones; give two or more")
    scores = all_head_scores(model, ids if ids is not None else probe_tokens(model), HEAD_DETECTORS)
    on = "this text" if ids is not None else "random tokens repeated twice"
    parts = [f"head detector scores on {on}:", scores_table(scores)]
    if args.composition:
        parts += ["", _composition_text(model)]
    if args.ablate:
        parts += ["", _ablation_text(model, tok, ids, args.ablate, args.top_k)]
    text = "\n".join(parts)
    print(text)
    _draw(args, "decoderlab: head scores", text,
          lambda: _figures().head_grid_figure(scores, title=f"head detector scores on {on}"))
    return 0


def _composition_text(model, top: int = 10) -> str:
    """The ``top`` strongest Q-, K- and V-composition scores, one line each."""
    from ..glassbox import composition_scores

    lines = [f"strongest composition (head of an earlier layer -> head that reads it), top {top}:"]
    scores = {mode: composition_scores(model, mode) for mode in ("Q", "K", "V")}
    flat = sorted(((float(s[a, b, c, d]), mode, (a, b, c, d)) for mode, s in scores.items()
                   for a, b, c, d in (s > 0).nonzero().tolist()), reverse=True)[:top]
    lines += [f"  L{a}H{b} -> L{c}H{d}  {mode}  {v:.3f}" for v, mode, (a, b, c, d) in flat]
    return "\n".join(lines)


def _ablation_text(model, tok, ids: list[int], heads, k: int) -> str:
    """The next token after ``ids`` with ``heads`` zero-ablated (their ``hook_z`` slices), beside the clean run."""
    import torch

    from ..glassbox import run_with_hooks, zero_ablation

    hooks = [zero_ablation(model, f"blocks.{layer}.attn.hook_z", head=head) for layer, head in heads]
    logp = torch.log_softmax(run_with_hooks(model, ids, [])[0, -1].double(), -1)
    logq = torch.log_softmax(run_with_hooks(model, ids, hooks)[0, -1].double(), -1)
    p, q = logp.exp(), logq.exp()
    shown = list(dict.fromkeys(p.topk(min(k, p.numel())).indices.tolist() + q.topk(min(k, q.numel())).indices.tolist()))
    shown.sort(key=lambda i: -abs(float(q[i] - p[i])))
    names = ", ".join(f"L{layer}H{head}" for layer, head in heads)
    lines = [f"next token with {names} ablated (KL(clean || ablated) = {float((p * (logp - logq)).sum()):.6f} nats):",
             f"  {'token':<12}{'before':>10}{'after':>10}{'change':>10}"]
    lines += [f"  {tok.decode([i])!r:<12}{float(p[i]):10.4f}{float(q[i]):10.4f}{float(q[i] - p[i]):+10.4f}"
              for i in shown]
    return "\n".join(lines)


# ---- patch -----------------------------------------------------------------------------------------------

def add_patch(p) -> None:
    p.description = ("Activation patching (TransformerLens's get_act_patch_*): run the corrupt text again and "
                     "again, each time with one activation of the clean run patched in, and print the metric -- "
                     "the logit of --answer minus that of --wrong at the last position -- for every patch.")
    add_checkpoint_option(p)
    p.add_argument("--clean", required=True, metavar="TEXT", help="the clean input")
    p.add_argument("--corrupt", required=True, metavar="TEXT", help="the corrupt input (as many tokens as --clean)")
    p.add_argument("--over", default="resid_pre", choices=PATCH_POINTS,
                   help="what is patched in every layer (default %(default)s; attn_head: each head's hook_z)")
    p.add_argument("--by", default=None, choices=PATCH_AXES,
                   help="the table's axes (default layer,pos; layer,head for attn_head)")
    p.add_argument("--answer", default=None, metavar="TEXT",
                   help="the token the clean run should predict (default: its most probable next token)")
    p.add_argument("--wrong", default=None, metavar="TEXT",
                   help="the token subtracted (default: the corrupt run's most probable one, if another)")
    _add_outputs(p, "the table as a heatmap")
    add_options(p, THREADS_OPTIONS)
    p.set_defaults(func=cmd_patch)


def cmd_patch(args) -> int:
    from ..glassbox import activation_patching, logit_difference, patching_table, run_with_hooks

    _check_outputs(args)
    _not_empty(args.clean, "--clean")
    _not_empty(args.corrupt, "--corrupt")
    set_threads(args)
    model, tok, _, _ = load_model(args)
    clean, corrupt = _ids(model, tok, args.clean, "--clean"), _ids(model, tok, args.corrupt, "--corrupt")
    if len(clean) != len(corrupt):
        raise ValueError(f"--clean is {len(clean)} tokens and --corrupt {len(corrupt)}: patching puts each clean "
                         f"activation at its own position, so both must have the same number of tokens")
    by = args.by or ("layer,head" if args.over == "attn_head" else "layer,pos")
    clean_logits, corrupt_logits = run_with_hooks(model, clean, []), run_with_hooks(model, corrupt, [])
    answer = int(clean_logits[0, -1].argmax()) if args.answer is None else _one_token(tok, args.answer, "--answer")
    wrong = int(corrupt_logits[0, -1].argmax()) if args.wrong is None else _one_token(tok, args.wrong, "--wrong")
    wrong = None if wrong == answer else wrong
    metric = logit_difference(answer, wrong)
    try:
        table = activation_patching(model, clean, corrupt, metric, over=args.over, by=by)
    except ValueError as e:  # the library's "by='x' is not allowed for over='y'" in the flags' words
        raise ValueError(str(e).replace("by=", "--by ").replace("over=", "--over ")) from None
    what = f"logit of {tok.decode([answer])!r}" + ("" if wrong is None else f" minus logit of {tok.decode([wrong])!r}")
    text = (f"metric: {what} at the last position; clean run {float(metric(clean_logits)):+.4f}, corrupt run "
            f"{float(metric(corrupt_logits)):+.4f}\n" + patching_table(table, args.over, by))
    print(text)
    tokens = [tok.decode([i]) for i in clean]
    _draw(args, "decoderlab: activation patching", text,
          lambda: _figures().patching_figure(table, args.over, by, tokens))
    return 0
