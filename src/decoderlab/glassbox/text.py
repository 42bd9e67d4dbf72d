"""Formatting numbers for a person: rows, labelled matrices (masked cells marked), check lines."""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np



def fmt_row(values: Iterable[float], width: int = 9, prec: int = 4) -> str:
    return "".join(f"{v:{width}.{prec}f}" for v in values)


def label(tok: str) -> str:
    """A printable label for a token string, whitespace made visible: every space as ``␣`` (``" Paris"`` reads
    ``␣Paris``, never a second space beside the word before it), newlines and tabs escaped."""
    return _escaped(tok).replace(" ", "␣")


def _escaped(name: str) -> str:
    """A row or column name of :func:`matrix` (a label already, or ``pos 1``): newlines and tabs escaped, a lone
    space as ``␣``."""
    out = name.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    return "␣" if out == " " else out


def matrix(title: str, m, rows: Sequence[str] | None = None, cols: Sequence[str] | None = None,
            mask=None, prec: int = 4) -> str:
    """A titled matrix with row and column labels; masked cells print as ``-``."""
    m = np.asarray(m, dtype=np.float64)
    if m.ndim == 1:
        m = m[None, :]
    rows = [_escaped(r) for r in rows] if rows is not None else [str(i) for i in range(m.shape[0])]
    cols = [_escaped(c) for c in cols] if cols is not None else [f"[{j}]" for j in range(m.shape[1])]
    rw = max(len(r) for r in rows)
    cw = max(prec + 6, max(len(c) for c in cols) + 1)
    lines = [title, " " * rw + "".join(f"{c:>{cw}}" for c in cols)]
    for i, r in enumerate(rows):
        cells = []
        for j in range(m.shape[1]):
            if mask is not None and bool(mask[i][j]):
                cells.append(f"{'-':>{cw}}")
            else:
                cells.append(f"{m[i, j]:{cw}.{prec}f}")
        lines.append(f"{r:<{rw}}" + "".join(cells))
    return "\n".join(lines)


def check_line(ours, ref) -> str:
    diff = float(np.abs(np.asarray(ours, dtype=np.float64) - np.asarray(ref, dtype=np.float64)).max())
    return f"check: max |diff| = {diff:.2e} (float64 NumPy by hand)"


def np_softmax_rows(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


