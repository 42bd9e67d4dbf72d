"""Drawing the glass box's tables: the logit lens, the head detectors' scores and an activation-patching
table as heatmaps (PNG), each also as a self-contained HTML page with its text table (``decoderlab lens``,
``heads``, ``patch``).

Matplotlib's object API with the Agg canvas, as :mod:`decoderlab.glassbox.plotting` (whose PNG writer and path
checks these share); the HTML embeds its image as a base64 ``data:`` URI and references nothing outside itself.
"""

from __future__ import annotations

import base64
import html as _html
import os
from pathlib import Path

import numpy as np
import torch

from ..files import atomic_write_bytes, atomic_write_text
from .plotting import _check_parent, _label, figure_png_bytes

#: up to this many cells a heatmap prints each cell's value (or token) in it
ANNOTATE_MAX_CELLS = 400


def _heatmap(ax, values: np.ndarray, rows: list[str], cols: list[str], *, cmap: str, text=None, vmin=None,
             vmax=None):
    """``values`` (R, C) drawn on ``ax`` with its row and column labels; ``text`` (R, C) strings in the cells."""
    im = ax.imshow(values, cmap=cmap, aspect="auto", vmin=vmin, vmax=vmax)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_xticks(range(len(cols)), cols, fontsize=8, rotation=60 if len(cols) > 8 else 0)
    if values.size <= ANNOTATE_MAX_CELLS:
        for (i, j), v in np.ndenumerate(values):
            shade = float(im.norm(v))  # 0 .. 1 along the colour map: white text on its dark end(s)
            dark = abs(shade - 0.5) > 0.3 if cmap == "RdBu" else shade > 0.6
            ax.text(j, i, text[i][j] if text is not None else f"{v:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if dark else "black")
    return im


def lens_figure(lens, tokens: list[str], tokenizer, *, batch: int = 0):
    """The logit lens as a heatmap: one row per entry (each layer's input, then the model's output), one
    column per position read; each cell is the probability of that entry's most probable next token, with
    the token written in it. ``lens`` from :func:`decoderlab.glassbox.logit_lens`, ``tokens`` the input's
    tokens (the column labels)."""
    from matplotlib.figure import Figure

    probs = lens.probs()[:, batch].float()  # (n_entries, P, V)
    top, ids = probs.max(dim=-1)
    words = [[_label(tokenizer.decode([int(i)])) if tokenizer is not None else str(int(i)) for i in row]
             for row in ids]
    cols = [f"{_label(tokens[p])}@{p}" for p in lens.positions]
    fig = Figure(figsize=(max(5.0, 0.6 * len(cols) + 2), max(2.5, 0.45 * len(lens.labels) + 1.5)),
                 layout="constrained")
    ax = fig.subplots()
    im = _heatmap(ax, top.numpy(), lens.labels, cols, cmap="Blues", text=words, vmin=0.0, vmax=1.0)
    fig.colorbar(im, ax=ax, label="probability of the top token")
    ax.set_xlabel("position (the next token after it)")
    ax.set_title("logit lens: the top next token read from each layer's input", fontsize=10)
    return fig


def head_grid_figure(scores: dict[str, torch.Tensor], *, title: str | None = None):
    """One (n_layer, n_head) heatmap per detector of :func:`decoderlab.glassbox.all_head_scores`'s result."""
    from matplotlib.figure import Figure

    kinds = list(scores)
    n_layer, n_head = next(iter(scores.values())).shape
    fig = Figure(figsize=(max(6.0, 2.2 * len(kinds) + 0.25 * n_head * len(kinds)), max(2.5, 0.4 * n_layer + 1.8)),
                 layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(kinds)))
    for ax, kind in zip(axes, kinds):
        im = _heatmap(ax, scores[kind].double().numpy(), [f"L{i}" for i in range(n_layer)],
                      [f"H{h}" for h in range(n_head)], cmap="Blues", vmin=0.0, vmax=1.0)
        ax.set_title(kind.replace("_", "-"), fontsize=10)
    fig.colorbar(im, ax=list(axes), label="score")
    fig.suptitle(title or "head detector scores")
    return fig


def patching_figure(table: torch.Tensor, over: str, by: str, tokens: list[str] | None = None):
    """An :func:`decoderlab.glassbox.activation_patching` table as a heatmap (by "layer": one column; by
    "layer,pos,head": one row per layer and position), diverging around 0."""
    from matplotlib.figure import Figure

    values = table.double()
    n_layer = values.size(0)
    if by == "layer":
        values, rows, cols = values.view(-1, 1), [f"L{i}" for i in range(n_layer)], ["all"]
    elif by == "layer,pos,head":
        t = values.size(1)
        rows = [f"L{i} pos {p}" for i in range(n_layer) for p in range(t)]
        values, cols = values.reshape(-1, values.size(-1)), [f"H{h}" for h in range(values.size(-1))]
    else:
        rows = [f"L{i}" for i in range(n_layer)]
        cols = ([f"{_label(tokens[p])}@{p}" if tokens else str(p) for p in range(values.size(1))]
                if by == "layer,pos" else [f"H{h}" for h in range(values.size(1))])
    lim = float(values.abs().max()) or 1.0
    fig = Figure(figsize=(max(4.0, 0.6 * len(cols) + 2.5), max(2.5, 0.35 * len(rows) + 1.5)), layout="constrained")
    ax = fig.subplots()
    im = _heatmap(ax, values.numpy(), rows, cols, cmap="RdBu", vmin=-lim, vmax=lim)
    fig.colorbar(im, ax=ax, label="metric, clean patched in")
    ax.set_title(f"activation patching: {over} by {by}", fontsize=10)
    return fig


def check_out_path(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a file to write ``what`` ("PNG", "HTML") to: ``ValueError`` for a directory,
    ``FileNotFoundError`` naming a missing parent directory (checked before any work is done)."""
    return _check_parent(path, what)


def save_png(fig, path: str | os.PathLike) -> Path:
    """Write ``fig`` as PNG to ``path`` atomically; ``FileNotFoundError`` naming a missing directory."""
    path = _check_parent(path, "PNG")
    atomic_write_bytes(path, figure_png_bytes(fig))
    return path


def html_page(title: str, text: str, fig) -> str:
    """A self-contained page: ``title``, the text table in a ``<pre>`` and ``fig`` as an inline PNG."""
    e = _html.escape
    png = base64.b64encode(figure_png_bytes(fig)).decode("ascii")
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{e(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:80em}pre{background:#f6f6f6;padding:1em;"
        "overflow-x:auto;font-size:12px}img{max-width:100%}</style></head><body>",
        f"<h1>{e(title)}</h1>", f'<img alt="{e(title)}" src="data:image/png;base64,{png}">',
        f"<pre>{e(text)}</pre>", "</body></html>"])


def save_html(title: str, text: str, fig, path: str | os.PathLike) -> Path:
    """Write :func:`html_page` to ``path`` atomically; ``FileNotFoundError`` naming a missing directory."""
    path = _check_parent(path, "HTML")
    atomic_write_text(path, html_page(title, text, fig))
    return path
