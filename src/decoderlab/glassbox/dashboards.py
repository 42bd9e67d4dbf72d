"""A feature's dashboard drawn: as text, as a figure (PNG) and as one self-contained HTML page with its top
activating contexts shaded token by token (``decoderlab features``). The numbers come from
:func:`decoderlab.glassbox.features.feature_dashboard`."""

from __future__ import annotations

import base64
import html as _html
import os
from pathlib import Path

from ..files import atomic_write_text
from .features import FeatureDashboard
from .plotting import _check_parent, _label, figure_png_bytes


def _tok(tokenizer, i: int) -> str:
    return _label(tokenizer.decode([int(i)])) if tokenizer is not None else f"<{i}>"


def context_text(ctx, tokenizer) -> str:
    """One context on one line, its activating token in ``[[ ]]``."""
    parts = [_tok(tokenizer, i) for i in ctx.ids]
    parts[ctx.position] = f"[[{parts[ctx.position]}]]"
    return "".join(parts)


def dashboard_text(d: FeatureDashboard, tokenizer=None, *, n_logits: int = 8) -> str:
    """The dashboard as text: density, the top contexts with their activations, the logits it promotes and
    suppresses."""
    lines = [f"feature {d.feature} at {d.hook}: fires on {100 * d.density:.3f}% of {d.tokens} tokens",
             "", "top activating contexts (the token in [[ ]]):"]
    lines += [f"  {c.activation:8.3f}  {context_text(c, tokenizer)}" for c in d.contexts] or ["  (never fires)"]
    for title, largest in (("promotes", True), ("suppresses", False)):
        tops = d.top_logits(n_logits, largest)
        lines.append(f"logit effects, {title}: " + "  ".join(f"{_tok(tokenizer, i)} {v:+.3f}" for i, v in tops))
    return "\n".join(lines)


def dashboard_figure(d: FeatureDashboard, tokenizer=None, *, n_logits: int = 10):
    """A figure: the activation histogram (log counts) and the top promoted / suppressed logits."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    counts, edges = d.histogram
    ax1.bar(edges[:-1], counts, width=edges[1] - edges[0], align="edge", color="#4a7fb5")
    ax1.set_yscale("log" if counts.max() > 0 else "linear")
    ax1.set_xlabel("activation (when non-zero)")
    ax1.set_ylabel("tokens")
    ax1.set_title(f"feature {d.feature}: density {100 * d.density:.3f}%", fontsize=10)
    pos, neg = d.top_logits(n_logits // 2, True), d.top_logits(n_logits // 2, False)[::-1]
    rows = pos + neg
    ax2.barh(range(len(rows)), [v for _, v in rows], color=["#3a9a5b" if v > 0 else "#c0504d" for _, v in rows])
    ax2.set_yticks(range(len(rows)), [repr(_tok(tokenizer, i)) for i, _ in rows], fontsize=8)
    ax2.invert_yaxis()
    ax2.set_xlabel("direct effect on the next-token logit")
    ax2.set_title("logit effects (decoder direction through the final norm and W_U)", fontsize=10)
    return fig


def _context_html(ctx, tokenizer, top: float) -> str:
    spans = []
    for j, (i, a) in enumerate(zip(ctx.ids, ctx.activations)):
        alpha = 0.0 if top <= 0 else min(1.0, max(0.0, a / top))
        style = f"background:rgba(230,120,30,{alpha:.2f})" + (";outline:2px solid #333" if j == ctx.position else "")
        spans.append(f'<span style="{style}" title="{a:.3f}">{_html.escape(_tok(tokenizer, i))}</span>')
    return f'<div class="ctx"><b>{ctx.activation:.3f}</b> {"".join(spans)}</div>'


def dashboard_html(d: FeatureDashboard, tokenizer=None) -> str:
    """One self-contained page: the figure inline, the contexts with each token shaded by the feature's
    activation (the activating one outlined), and the text dashboard."""
    e = _html.escape
    png = base64.b64encode(figure_png_bytes(dashboard_figure(d, tokenizer))).decode("ascii")
    top = max((c.activation for c in d.contexts), default=0.0)
    title = f"decoderlab: feature {d.feature} at {d.hook}"
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{e(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:80em}.ctx{font-family:monospace;"
        "white-space:pre;margin:.2em 0}pre{background:#f6f6f6;padding:1em;font-size:12px}img{max-width:100%}"
        "</style></head><body>", f"<h1>{e(title)}</h1>", f'<img alt="{e(title)}" src="data:image/png;base64,{png}">',
        "<h2>Top activating contexts</h2>", *[_context_html(c, tokenizer, top) for c in d.contexts],
        f"<pre>{e(dashboard_text(d, tokenizer))}</pre>", "</body></html>"])


def save_dashboard(d: FeatureDashboard, tokenizer=None, *, png: str | os.PathLike | None = None,
                   html: str | os.PathLike | None = None) -> list[Path]:
    """Write the PNG and/or the HTML page; returns the paths written. ``FileNotFoundError`` naming a missing
    directory."""
    from .figures import save_png

    written = []
    if png is not None:
        written.append(save_png(dashboard_figure(d, tokenizer), png))
    if html is not None:
        path = _check_parent(html, "HTML")
        atomic_write_text(path, dashboard_html(d, tokenizer))
        written.append(path)
    return written
