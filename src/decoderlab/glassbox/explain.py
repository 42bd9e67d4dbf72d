"""``explain``: the step-by-step story of a traced forward pass, as text (and heatmaps / an HTML report)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ..checkpoint import load_checkpoint
from . import plotting
from .reference import verify
from .trace import Trace, trace, unwrap
from .text import label, matrix

SMALL_D_MODEL = 8
#: longest input for which ``explain`` prints full T x T percent tables of a larger model
TABLE_MAX_T = 24


def _attends_line(labels: list[str], row: np.ndarray, q_pos: int, top: int = 8) -> str:
    order = [j for j in np.argsort(-row, kind="stable") if j <= q_pos][:top]
    parts = [f"{label(labels[j])}@{j} {100 * row[j]:.1f}%" for j in order]
    return f"{label(labels[q_pos])}@{q_pos} attends to: " + ", ".join(parts)


def explain_trace(tr: Trace, model=None, tokenizer=None, *, batch: int = 0) -> str:
    """The text of :func:`explain` for an existing :class:`Trace` (row ``batch`` of the batch).

    For small models (d_model <= 8) every matrix (embeddings, positions, weights, Q, K, V, similarities,
    scaled similarities, mask, percents, outputs, residuals, logits); for larger ones the attention percents
    per head (full tables for T <= 24, else what each query attends to most) and the top next-token
    probabilities. ``model`` (optional) adds the weight matrices and the float64 NumPy check for small models;
    ``tokenizer`` (optional) labels the logits' columns.
    """
    cfg = tr.config
    labels = tr.labels(batch)
    t = len(labels)
    pos_labels = [f"{label(s)}@{i}" for i, s in enumerate(labels)]
    small = cfg.d_model <= SMALL_D_MODEL
    dims = [f"dim {j}" for j in range(cfg.d_model)]
    out = [
        f"Input: {' '.join(label(s) for s in labels)}   ({t} tokens, ids {tr.token_ids[batch].tolist()})",
        f"Model: d_model {cfg.d_model}, {cfg.n_layer} layer(s), {cfg.n_head} head(s) of d_head {cfg.d_head}, "
        f"norm {cfg.norm}, positions {cfg.position}, mlp {cfg.mlp}, vocabulary {cfg.num_tokens}",
        "Rows are queries (the token looking), columns are keys (the tokens looked at); '-' marks a masked "
        "similarity (a later token: it cannot be seen).",
    ]

    def np_(x):
        return x[batch].detach().to("cpu", torch.float64).numpy()

    if small:
        out += ["", matrix("word embeddings (we):", np_(tr.word_embeddings), pos_labels, dims)]
        if cfg.position in ("sinusoidal", "learned"):
            out += ["", matrix("position encodings:", np_(tr.encoded) - np_(tr.word_embeddings), pos_labels, dims),
                    "", matrix("encoded = word embeddings + positions:", np_(tr.encoded), pos_labels, dims)]
        elif cfg.position == "rope":
            out += ["", "positions: rotary (applied to queries and keys inside attention)"]
    for lt in tr.layers:
        out += ["", f"=== layer {lt.index} ==="]
        mask = lt.mask.cpu().numpy() if lt.mask is not None else np.zeros((t, t), dtype=bool)
        if small:
            if cfg.norm != "none":
                out += [matrix(f"normalised input ({cfg.norm}):", np_(lt.normed), pos_labels, dims), ""]
        for slot, hd in enumerate(lt.heads):
            hdims = [f"d{j}" for j in range(cfg.d_head)]
            title = f"--- layer {lt.index}, head {hd} ---"
            out += [title]
            if small:
                if model is not None:
                    w = model.blocks[lt.index].attention.qkv.weight.detach().double().cpu().numpy()
                    sl = slice(hd * cfg.d_head, (hd + 1) * cfg.d_head)
                    for nm, off in (("Wqᵀ", 0), ("Wkᵀ", cfg.d_model), ("Wvᵀ", 2 * cfg.d_model)):
                        part = w[off:][sl].T
                        out += [matrix(f"{nm} (d_model x d_head):", part, dims, hdims), ""]
                for nm, ten in (("Q (queries)", lt.q), ("K (keys)", lt.k), ("V (values)", lt.v)):
                    out += [matrix(f"{nm}:", np_(ten)[slot], pos_labels, hdims), ""]
                out += [matrix("similarities Q Kᵀ:", np_(lt.sims)[slot], pos_labels, pos_labels), ""]
                out += [matrix(f"scaled similarities / sqrt({cfg.d_head}):", np_(lt.scaled_sims)[slot], pos_labels,
                                pos_labels, mask=mask), ""]
            if small or t <= TABLE_MAX_T:
                out += [matrix("attention percents (softmax of each row; masked keys get 0):",
                                np_(lt.percents)[slot], pos_labels, pos_labels, mask=mask)]
            pct = np_(lt.percents)[slot]
            rows = range(t) if t <= TABLE_MAX_T and not small else [t - 1]
            for i in rows:
                out.append(_attends_line(labels, pct[i], i))
            if small:
                out += ["", matrix("head output = percents V:", np_(lt.head_out)[slot], pos_labels, hdims)]
            out.append("")
        if small:
            proj = " after the output projection" if cfg.attn_out_proj else " (heads concatenated, no projection)"
            out += [matrix(f"attention output{proj}:", np_(lt.attn_out), pos_labels, dims), "",
                    matrix("residual: input + attention output:", np_(lt.resid_1), pos_labels, dims)]
            if lt.mlp_out is not None:
                out += ["", matrix("MLP output:", np_(lt.mlp_out), pos_labels, dims), "",
                        matrix("residual: + MLP output:", np_(lt.resid_2), pos_labels, dims)]
    if small and cfg.num_tokens <= 16:
        vocab = range(cfg.num_tokens)
        cols = tokenizer.tokens(vocab) if tokenizer is not None else [str(j) for j in vocab]
        out += ["", matrix("logits (fc_layer output; one column per vocabulary token):", np_(tr.logits), pos_labels,
                            cols)]
    out += ["", "top next-token probabilities at each position:"]
    positions = range(t) if t <= TABLE_MAX_T else range(t - 5, t)
    if t > TABLE_MAX_T:
        out.append(f"(last 5 of {t} positions)")
    for i in positions:
        ids = tr.top_k_ids[batch, i].tolist()
        probs = tr.top_k_probs[batch, i].tolist()
        toks = tr.top_k_tokens[batch][i] if tr.top_k_tokens is not None else [str(j) for j in ids]
        cells = ", ".join(f"{label(s)} {p:.4f}" for s, p in zip(toks, probs))
        out.append(f"  after {pos_labels[i]}: {cells}")
    best = tr.top_k_tokens[batch][t - 1][0] if tr.top_k_tokens is not None else str(int(tr.top_k_ids[batch, t - 1, 0]))
    out += ["", f"=> the top next token after {label(labels[-1])} is {label(best)} "
                f"(p = {float(tr.top_k_probs[batch, t - 1, 0]):.4f})"]
    if model is not None and small:
        rep = verify(model, tr.token_ids[batch : batch + 1])
        out.append(f"check: max |diff| = {rep.max_abs_diff:.2e} between the model and the float64 NumPy "
                   f"recomputation over {len(rep.steps)} steps ({'ok' if rep.ok else 'FAILED'}; "
                   "decoderlab verify prints the table)")
    return "\n".join(out)


def _check_out_path(path, what: str) -> Path:
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} path {path} is a directory; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise FileNotFoundError(f"cannot write {what} {path}: directory {parent} does not exist")
    return path


def explain(model, text_or_ids, tokenizer=None, *, layer=None, head=None, top_k: int = 5,
            png: str | os.PathLike | None = None, html: str | os.PathLike | None = None) -> str:
    """Trace ``model`` on a text (or ids) and return the step-by-step story (see :func:`explain_trace`).

    Args:
        model: a ``DecoderOnlyTransformer``, or a checkpoint directory (its tokenizer is used).
        text_or_ids: the input text (needs a tokenizer) or ids.
        layer, head: keep only this layer / head (int or list; None = all).
        top_k: next-token probabilities to show per position.
        png: write attention heatmaps there (one panel per kept layer and head; ``decoderlab.plotting``).
        html: write one self-contained HTML report there (the text, tables, heatmaps as inline PNG).

    Both output paths are checked before anything is computed or written.

    Raises:
        FileNotFoundError: the checkpoint, or the directory of ``png``/``html``, does not exist (named).
        ValueError: layer/head out of range (naming the valid range); ids out of range; T > max_len.
        KeyError: a word the tokenizer does not know.
    """
    png_path = _check_out_path(png, "PNG") if png is not None else None
    html_path = _check_out_path(html, "HTML") if html is not None else None
    if isinstance(model, (str, os.PathLike)):
        model, ckpt_tok = load_checkpoint(model)
        tokenizer = tokenizer or ckpt_tok
    model = unwrap(model)
    tr = trace(model, text_or_ids, tokenizer=tokenizer, layers=layer, heads=head, top_k=top_k)
    text = explain_trace(tr, model, tokenizer)
    if png_path is not None or html_path is not None:
        if png_path is not None:
            title = "attention percents: " + " ".join(label(s) for s in tr.labels())
            plotting.save_attention_png(tr, png_path, title=title)
        if html_path is not None:
            plotting.write_html_report(tr, html_path, text=text)
    return text
