"""Shared pieces of the glass-box tests: small models of every preset family and of every variant the glass
box must handle, and parsers for the printed matrices of ``explain``."""

import math
import re

import numpy as np
import torch

import decoderlab as dl

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LESSON_OUT = [[1.0100, 1.0641], [0.2040, 0.7057], [3.4989, 2.2427]]


def vec(s):
    return [float(x) for x in s.strip("[]").split(",")]


def hand_checks(text):
    found = [float(x) for x in re.findall(r"check: max \|diff\| = ([0-9.e+-]+)", text)]
    assert found, "no hand-check line printed"
    return found


def matrix_after(text, title, n_rows):
    """Parse the numbers of the n_rows rows printed under the line starting with ``title``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows = lines[start + 2 : start + 2 + n_rows]
    cells = [re.findall(r"(?<=\s)(-?\d+\.\d+|-)(?=\s|$)", r) for r in rows]
    return np.array([[math.nan if x == "-" else float(x) for x in row] for row in cells])  # '-' = masked


SMALL = {
    "statquest": dict(),
    "baby-shakespeare": dict(n_layer=2, max_len=16),
    "shakespeare-char": dict(n_layer=2, max_len=16, d_model=48, n_head=6),
    "gpt2": dict(n_layer=2, num_tokens=97, max_len=24, d_model=64, n_head=4),
}
VARIANTS = {
    "preset": dict(),
    "rope-rmsnorm-nobias": dict(position="rope", norm="rmsnorm", bias=False),
    "sinusoidal-bias": dict(position="sinusoidal", bias=True),
}


def small_model(name, variant="preset", **more):
    torch.manual_seed(0)
    return dl.DecoderOnlyTransformer(dl.preset(name, **SMALL[name], **VARIANTS[variant], **more)).eval()


