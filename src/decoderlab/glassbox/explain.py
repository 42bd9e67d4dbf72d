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


class _Story:
    """What every section of :func:`explain_trace` reads: the trace, its row, labels and sizes."""

    def __init__(self, tr: Trace, model, tokenizer, batch: int):
        self.tr, self.model, self.tokenizer, self.batch = tr, model, tokenizer, batch
        self.cfg = tr.config
        self.labels = tr.labels(batch)
        self.t = len(self.labels)
        self.pos_labels = [f"{label(s)}@{i}" for i, s in enumerate(self.labels)]
        self.small = self.cfg.d_model <= SMALL_D_MODEL
        self.dims = [f"dim {j}" for j in range(self.cfg.d_model)]

    def np_(self, x) -> np.ndarray:
        return x[self.batch].detach().cpu().double().numpy()  # (to the CPU first: no float64 on MPS)

    def matrix(self, title: str, x, cols=None, rows=None, **kw) -> str:
        """A matrix of this row's values, one row per position unless ``rows`` says otherwise."""
        return matrix(title, x, self.pos_labels if rows is None else rows, self.dims if cols is None else cols, **kw)


def _header(st: _Story) -> list[str]:
    cfg, tr = st.cfg, st.tr
    return [
        f"Input: {' '.join(label(s) for s in st.labels)}   ({st.t} tokens, ids {tr.token_ids[st.batch].tolist()})",
        f"Model: d_model {cfg.d_model}, {cfg.n_layer} layer(s), {cfg.n_head} head(s) of d_head {cfg.d_head}, "
        + (f"{cfg.kv_heads} key/value head(s), " if cfg.kv_heads != cfg.n_head else "") +
        f"norm {cfg.norm}, positions {cfg.position}, mlp {cfg.mlp}, vocabulary {cfg.num_tokens}",
        "Rows are queries (the token looking), columns are keys (the tokens looked at); '-' marks a masked "
        "similarity (a later token: it cannot be seen).",
    ]


def _embeddings(st: _Story) -> list[str]:
    tr, position = st.tr, st.cfg.position
    out = ["", st.matrix("word embeddings (we):", st.np_(tr.word_embeddings))]
    if position in ("sinusoidal", "learned"):
        out += ["", st.matrix("position encodings:", st.np_(tr.encoded) - st.np_(tr.word_embeddings)),
                "", st.matrix("encoded = word embeddings + positions:", st.np_(tr.encoded))]
    elif position == "rope":
        out += ["", "positions: rotary (applied to queries and keys inside attention)"]
    return out


def _head_matrices(st: _Story, lt, slot: int, hd: int, mask) -> list[str]:
    """A small model's head, every number: its weights (with the model), Q, K, V and the similarities."""
    cfg, out = st.cfg, []
    hdims = [f"d{j}" for j in range(cfg.d_head)]
    if st.model is not None:
        attn = st.model.blocks[lt.index].attention
        w = attn.qkv.weight.detach().cpu().double().numpy()  # rows [query heads | key heads | value heads]
        kv = hd // attn.group  # the key/value head this head reads (itself without grouped-query attention)
        for nm, first in (("Wqᵀ", hd * cfg.d_head), ("Wkᵀ", attn.q_size + kv * cfg.d_head),
                          ("Wvᵀ", attn.q_size + attn.kv_size + kv * cfg.d_head)):
            out += [st.matrix(f"{nm} (d_model x d_head):", w[first:first + cfg.d_head].T, hdims, st.dims), ""]
    for nm, ten in (("Q (queries)", lt.q), ("K (keys)", lt.k), ("V (values)", lt.v)):
        out += [st.matrix(f"{nm}:", st.np_(ten)[slot], hdims), ""]
    out += [st.matrix("similarities Q Kᵀ:", st.np_(lt.sims)[slot], st.pos_labels), ""]
    out += [st.matrix(f"scaled similarities / sqrt({cfg.d_head}):", st.np_(lt.scaled_sims)[slot], st.pos_labels,
                      mask=mask), ""]
    return out


def _head(st: _Story, lt, slot: int, hd: int, mask) -> list[str]:
    out = [f"--- layer {lt.index}, head {hd} ---"]
    if st.small:
        out += _head_matrices(st, lt, slot, hd, mask)
    pct = st.np_(lt.percents)[slot]
    if st.small or st.t <= TABLE_MAX_T:
        out += [st.matrix("attention percents (softmax of each row; masked keys get 0):", pct, st.pos_labels,
                          mask=mask)]
    rows = range(st.t) if st.t <= TABLE_MAX_T and not st.small else [st.t - 1]
    out += [_attends_line(st.labels, pct[i], i) for i in rows]
    if st.small:
        out += ["", st.matrix("head output = percents V:", st.np_(lt.head_out)[slot],
                              [f"d{j}" for j in range(st.cfg.d_head)])]
    return out + [""]


def _layer(st: _Story, lt) -> list[str]:
    cfg = st.cfg
    out = ["", f"=== layer {lt.index} ==="]
    mask = lt.mask.cpu().numpy() if lt.mask is not None else np.zeros((st.t, st.t), dtype=bool)
    if st.small and cfg.norm != "none":
        out += [st.matrix(f"normalised input ({cfg.norm}):", st.np_(lt.normed)), ""]
    for slot, hd in enumerate(lt.heads):
        out += _head(st, lt, slot, hd, mask)
    if st.small:
        proj = " after the output projection" if cfg.attn_out_proj else " (heads concatenated, no projection)"
        out += [st.matrix(f"attention output{proj}:", st.np_(lt.attn_out)), "",
                st.matrix("residual: input + attention output:", st.np_(lt.resid_1))]
        if lt.mlp_out is not None:
            out += ["", st.matrix("MLP output:", st.np_(lt.mlp_out)), "",
                    st.matrix("residual: + MLP output:", st.np_(lt.resid_2))]
    return out


def _predictions(st: _Story) -> list[str]:
    """The logits of a tiny vocabulary, the top next-token probabilities and the top next token."""
    tr, t, batch, out = st.tr, st.t, st.batch, []
    if st.small and st.cfg.num_tokens <= 16:
        vocab = range(st.cfg.num_tokens)
        cols = [label(c) for c in st.tokenizer.tokens(vocab)] if st.tokenizer is not None else [str(j) for j in vocab]
        out += ["", st.matrix("logits (fc_layer output; one column per vocabulary token):", st.np_(tr.logits), cols)]
    out += ["", "top next-token probabilities at each position:"]
    if t > TABLE_MAX_T:
        out.append(f"(last 5 of {t} positions)")
    for i in range(t) if t <= TABLE_MAX_T else range(t - 5, t):
        ids = tr.top_k_ids[batch, i].tolist()
        probs = tr.top_k_probs[batch, i].tolist()
        toks = tr.top_k_tokens[batch][i] if tr.top_k_tokens is not None else [str(j) for j in ids]
        out.append(f"  after {st.pos_labels[i]}: " + ", ".join(f"{label(s)} {p:.4f}" for s, p in zip(toks, probs)))
    best = tr.top_k_tokens[batch][t - 1][0] if tr.top_k_tokens is not None else str(int(tr.top_k_ids[batch, t - 1, 0]))
    # each token quoted as it reads (lens and heads name tokens so too): after ' is' is ' Paris', where bare
    # labels ran the token's leading space into the sentence ("after  is is  Paris")
    return out + ["", f"=> the top next token after {st.labels[-1]!r} is {best!r} "
                      f"(p = {float(tr.top_k_probs[batch, t - 1, 0]):.4f})"]


def explain_trace(tr: Trace, model=None, tokenizer=None, *, batch: int = 0) -> str:
    """The text of :func:`explain` for an existing :class:`Trace` (row ``batch`` of the batch).

    For small models (d_model <= 8) every matrix (embeddings, positions, weights, Q, K, V, similarities,
    scaled similarities, mask, percents, outputs, residuals, logits); for larger ones the attention percents
    per head (full tables for T <= 24, else what each query attends to most) and the top next-token
    probabilities. ``model`` (optional) adds the weight matrices and the float64 NumPy check for small models;
    ``tokenizer`` (optional) labels the logits' columns.
    """
    st = _Story(tr, model, tokenizer, batch)
    out = _header(st) + (_embeddings(st) if st.small else [])
    for lt in tr.layers:
        out += _layer(st, lt)
    out += _predictions(st)
    if model is not None and st.small:
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
