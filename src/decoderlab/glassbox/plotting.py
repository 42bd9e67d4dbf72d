"""Drawing a :class:`decoderlab.glassbox.Trace`: attention heatmaps (PNG) and a self-contained HTML report.

Matplotlib's object API with the Agg canvas (no pyplot, no GUI, no global backend change). The HTML report
embeds its images as base64 PNG ``data:`` URIs and references nothing outside itself, so it opens offline.
"""

from __future__ import annotations

import base64
import html as _html
import io
import os
from pathlib import Path

import numpy as np

from ..files import atomic_write_bytes, atomic_write_text
from .text import label

#: at most this many tokens get a tick label on each axis (longer inputs get evenly spaced ticks)
MAX_TICK_LABELS = 64
#: up to this many tokens, each visible cell shows its percent and masked cells are hatched
ANNOTATE_MAX_T = 10
HATCH_MAX_T = 48


def _label(tok: str) -> str:
    """A token in running text (a feature dashboard's contexts): its spaces kept, a lone space as ``␣``; the
    trace's figures and report label each token apart with :func:`~decoderlab.glassbox.text.label`."""
    out = tok.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    return "␣" if out == " " else out


def attention_figure(tr, *, batch: int = 0, title: str | None = None):
    """A matplotlib ``Figure`` of the trace's attention percents: one panel per kept (layer, head).

    Rows of panels are layers, columns heads. In each panel query tokens run down, key tokens across; the
    colour is the attention percent (0 .. 1, one shared colour bar); masked cells (keys a query cannot
    see) are light grey and hatched, and for up to 10 tokens every visible cell is annotated.
    """
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    layers = tr.layers
    if not layers:
        raise ValueError("the trace keeps no layer to draw")
    labels = [label(s) for s in tr.labels(batch)]
    t = len(labels)
    n_rows, n_cols = len(layers), max(len(lt.heads) for lt in layers)
    panel = min(8.0, max(2.8, 0.42 * t + 1.2))
    fig = Figure(figsize=(panel * n_cols + 1.2, panel * n_rows + 0.8), dpi=100, layout="constrained")
    axes = fig.subplots(n_rows, n_cols, squeeze=False)
    import matplotlib

    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#d9d9d9")
    norm = Normalize(vmin=0.0, vmax=1.0)
    image = None
    step = max(1, int(np.ceil(t / MAX_TICK_LABELS)))
    ticks = list(range(0, t, step))
    for r, lt in enumerate(layers):
        mask = lt.mask.cpu().numpy() if lt.mask is not None else np.zeros((t, t), dtype=bool)
        pct = lt.percents[batch].detach().float().cpu().numpy()
        for c in range(n_cols):
            ax = axes[r][c]
            if c >= len(lt.heads):
                ax.axis("off")
                continue
            data = np.ma.masked_array(pct[c], mask=mask)
            image = ax.imshow(data, cmap=cmap, norm=norm, interpolation="nearest", aspect="equal")
            if t <= HATCH_MAX_T:
                for i, j in zip(*np.nonzero(mask)):
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="none", edgecolor="#8c8c8c",
                                           hatch="///", linewidth=0))
            if t <= ANNOTATE_MAX_T:
                for i in range(t):
                    for j in range(t):
                        if not mask[i, j]:
                            v = pct[c][i, j]
                            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8,
                                    color="black" if v > 0.6 else "white")
            ax.set_xticks(ticks, [labels[j] for j in ticks], rotation=90 if t > 3 or
                          max(len(s) for s in labels) > 6 else 0, fontsize=8)
            ax.set_yticks(ticks, [labels[i] for i in ticks], fontsize=8)
            ax.set_xlabel("key (looked at)", fontsize=8)
            ax.set_ylabel("query (looking)", fontsize=8)
            ax.set_title(f"layer {lt.index}, head {lt.heads[c]}", fontsize=9)
    bar = fig.colorbar(image, ax=axes, shrink=0.8)
    bar.set_label("attention percent (grey hatched = masked)", fontsize=8)
    bar.ax.tick_params(labelsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def figure_png_bytes(fig) -> bytes:
    """Render a matplotlib Figure to PNG bytes with the Agg canvas (no metadata with addresses in it)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def _check_parent(path: str | os.PathLike, what: str) -> Path:
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} path {path} is a directory; give a file name")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {what} {path}: directory {path.parent} does not exist")
    return path


def save_attention_png(tr, path: str | os.PathLike, *, batch: int = 0, title: str | None = None) -> Path:
    """Draw :func:`attention_figure` and write it to ``path`` atomically; returns the path.

    Raises ``FileNotFoundError`` naming the directory when it does not exist (nothing is written)."""
    path = _check_parent(path, "PNG")
    data = figure_png_bytes(attention_figure(tr, batch=batch, title=title))
    atomic_write_bytes(path, data)
    return path


def _table(matrix: np.ndarray, rows: list[str], cols: list[str], mask: np.ndarray | None = None,
           cls: str = "pct") -> str:
    e = _html.escape
    head = "".join(f"<th>{e(c)}</th>" for c in cols)
    body = []
    for i, r in enumerate(rows):
        cells = []
        for j in range(matrix.shape[1]):
            if mask is not None and mask[i, j]:
                cells.append('<td class="masked">&ndash;</td>')
            else:
                v = float(matrix[i, j])
                shade = int(255 - 150 * max(0.0, min(1.0, v))) if cls == "pct" else 255
                cells.append(f'<td style="background:rgb({shade},{shade},255)">{v:.4f}</td>')
        body.append(f"<tr><th>{e(r)}</th>{''.join(cells)}</tr>")
    return f'<table class="{cls}"><tr><th></th>{head}</tr>{"".join(body)}</table>'


def html_report(tr, *, text: str | None = None, title: str = "decoderlab: inside the model",
                batch: int = 0) -> str:
    """One self-contained HTML page: the explanation text, the attention percent tables per kept layer and
    head, the top next-token table, and the heatmaps as an inline base64 PNG. Nothing external is referenced."""
    e = _html.escape
    labels = tr.labels(batch)
    t = len(labels)
    pos = [f"{label(s)}@{i}" for i, s in enumerate(labels)]
    png = base64.b64encode(figure_png_bytes(attention_figure(tr, batch=batch))).decode("ascii")
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{e(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:80em}"
        "table{border-collapse:collapse;margin:0.5em 0 1.5em}td,th{border:1px solid #bbb;padding:2px 6px;"
        "font-family:monospace;font-size:12px;text-align:right}td.masked{background:#d9d9d9;color:#666;"
        "text-align:center}pre{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:12px}"
        "img{max-width:100%}</style></head><body>",
        f"<h1>{e(title)}</h1>",
        f"<p>Input ({t} tokens): <code>{e(' '.join(label(s) for s in labels))}</code>. Rows are queries "
        "(the token looking), columns are keys (the tokens looked at); grey cells are masked.</p>",
        "<h2>Attention heatmaps</h2>",
        f'<img alt="attention percents, one panel per layer and head" src="data:image/png;base64,{png}">',
        "<h2>Attention percents</h2>",
    ]
    if t <= 64:
        for lt in tr.layers:
            mask = lt.mask.cpu().numpy() if lt.mask is not None else np.zeros((t, t), dtype=bool)
            pct = lt.percents[batch].detach().cpu().double().numpy()  # (to the CPU first: no float64 on MPS)
            for slot, hd in enumerate(lt.heads):
                parts.append(f"<h3>layer {lt.index}, head {hd}</h3>")
                parts.append(_table(pct[slot], pos, pos, mask))
    else:
        parts.append(f"<p>{t} tokens: too many for tables; see the heatmaps.</p>")
    parts.append("<h2>Top next-token probabilities</h2>")
    k = tr.top_k_ids.size(-1)
    rows = []
    for i in range(t):
        ids = tr.top_k_ids[batch, i].tolist()
        probs = tr.top_k_probs[batch, i].tolist()
        toks = tr.top_k_tokens[batch][i] if tr.top_k_tokens is not None else [str(j) for j in ids]
        cells = "".join(f"<td>{e(label(s))}</td><td>{p:.4f}</td>" for s, p in zip(toks, probs))
        rows.append(f"<tr><th>{e(pos[i])}</th>{cells}</tr>")
    head = "".join(f"<th>#{j + 1} token</th><th>p</th>" for j in range(k))
    parts.append(f'<table class="topk"><tr><th>after</th>{head}</tr>{"".join(rows)}</table>')
    if text:
        parts += ["<h2>Step by step</h2>", f"<pre>{e(text)}</pre>"]
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html_report(tr, path: str | os.PathLike, *, text: str | None = None,
                      title: str = "decoderlab: inside the model", batch: int = 0) -> Path:
    """Write :func:`html_report` to ``path`` atomically; ``FileNotFoundError`` naming a missing directory."""
    path = _check_parent(path, "HTML")
    atomic_write_text(path, html_report(tr, text=text, title=title, batch=batch))
    return path


def head_scores_figure(records: list[dict], *, kind: str = "induction", threshold: float | None = None,
                       title: str | None = None, label_heads: int = 4):
    """A matplotlib ``Figure`` of a watched run: the training loss (nats per token) over the steps above, every
    head's ``kind`` score below (one line per head; the ``label_heads`` highest at the end are named), a dashed
    line at the formation threshold, and a dotted line where the first head crossed it -- beside the loss.
    ``records`` as :func:`decoderlab.glassbox.watching.read_records` returns them."""
    from matplotlib.figure import Figure

    from .watching import FORMED_AT, formation_steps, score_curves

    threshold = FORMED_AT if threshold is None else threshold
    steps, scores = score_curves(records, kind)
    formed = {k: s for k, s in formation_steps(records, kind, threshold).items() if s is not None}
    fig = Figure(figsize=(8, 6))
    loss_ax, score_ax = fig.subplots(2, 1, sharex=True)
    losses = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    if losses:
        loss_ax.plot(*zip(*losses), color="black")
    loss_ax.set_ylabel("training loss (nats/token)")
    n_layer, n_head = scores.shape[1:]
    last = scores[-1].flatten()
    named = set(last.argsort(descending=True)[:label_heads].tolist())
    for i in range(n_layer * n_head):
        layer, head = divmod(i, n_head)
        style = dict(linewidth=2.0, label=f"L{layer}H{head}") if i in named else dict(linewidth=0.8, alpha=0.5)
        score_ax.plot(steps, scores[:, layer, head].numpy(), **style)
    score_ax.axhline(threshold, color="grey", linestyle="--", linewidth=0.8)
    if formed:
        first = min(formed.values())
        for ax in (loss_ax, score_ax):
            ax.axvline(first, color="tab:red", linestyle=":", linewidth=1.2)
        score_ax.annotate(f"first {kind} head at step {first}", (first, threshold), textcoords="offset points",
                          xytext=(6, 6), fontsize=8, color="tab:red")
    score_ax.set_ylabel(f"{kind.replace('_', '-')} score")
    score_ax.set_xlabel("training step")
    score_ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(title or f"{kind.replace('_', ' ')} heads while training")
    fig.tight_layout()
    return fig


def save_head_scores_png(records: list[dict], path: str | os.PathLike, **options) -> Path:
    """Draw :func:`head_scores_figure` and write it to ``path`` atomically; returns the path.

    Raises ``FileNotFoundError`` naming the directory when it does not exist (nothing is written)."""
    path = _check_parent(path, "PNG")
    atomic_write_bytes(path, figure_png_bytes(head_scores_figure(records, **options)))
    return path
