"""The lessons' worked examples, printed step by step and checked in float64 NumPy:
``self-attention-101`` (A=[1,0], B=[0,1], C=[1,1]), ``statquest-self-attention`` (the lesson's
``SelfAttention``, seed 42) and ``position-encoding`` (the lesson's sinusoidal values)."""

from __future__ import annotations

import math

import numpy as np
import torch

from ..lesson import SelfAttention
from ..positions import PositionEncoding
from .reference import np_sinusoidal
from .text import check_line, matrix, np_softmax_rows

def _example_self_attention_101() -> str:
    names = ["A", "B", "C"]
    X = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    Q = K = V = X
    scores = Q @ K.T
    dk = K.shape[1]
    w_plain = np_softmax_rows(scores)
    w_scaled = np_softmax_rows(scores / math.sqrt(dk))
    out_plain, out_scaled = w_plain @ V, w_scaled @ V
    # the second path: decoderlab's SelfAttention (the lesson class) with identity weights, which scales
    sa = SelfAttention(d_model=2).double()
    with torch.no_grad():
        for lin in (sa.W_q, sa.W_k, sa.W_v):
            lin.weight.copy_(torch.eye(2, dtype=torch.float64))
        torch_scaled = sa(torch.tensor(X)).numpy()
        xt = torch.tensor(X)
        torch_plain = (torch.softmax(xt @ xt.T, dim=-1) @ xt).numpy()

    def vec(v, prec=4):
        return "[" + ", ".join(f"{x:.{prec}f}" for x in v) + "]"

    lines = [
        "Self-attention 101 (\"Day 27: Self-Attention Explained From Scratch\"): three words, two numbers each.",
        "Q = K = V = X (identity weights). Left: no scaling, as the article. Right: scaled by 1/sqrt(d_k), "
        f"d_k = {dk}, as the StatQuest lessons and every transformer.",
        "",
        matrix("X = Q = K = V (one row per word):", X, names, ["x0", "x1"]),
        "",
        matrix("Step 2, attention scores Q Kᵀ (queries down, keys across):", scores, names, names),
        "",
        f"Step 3, weights = softmax of each row          | scaled: softmax(scores / sqrt({dk}) = scores / "
        f"{math.sqrt(dk):.4f})",
    ]
    left = matrix("", w_plain, names, names).splitlines()[1:]
    right = matrix("", w_scaled, names, names).splitlines()[1:]
    lines += [f"{a:<46}  | {b}" for a, b in zip(left, right)]
    lines += ["", "Step 4, output = weights V (weighted sum of the value rows)  | scaled"]
    left = matrix("", out_plain, names, ["out0", "out1"]).splitlines()[1:]
    right = matrix("", out_scaled, names, ["out0", "out1"]).splitlines()[1:]
    lines += [f"{a:<46}  | {b}" for a, b in zip(left, right)]
    lines += ["", "Word by word:"]
    for i, n in enumerate(names):
        lines.append(
            f"{n}: scores {vec(scores[i], 0)}  weights {vec(w_plain[i])}  output {vec(out_plain[i])}"
            f"  | scaled: weights {vec(w_scaled[i])}  output {vec(out_scaled[i])}"
        )
    lines += [
        "",
        f"A: exp(1) = {math.e:.3f}, exp(0) = 1, sum = {2 * math.e + 1:.3f}; weights "
        f"[{math.e / (2 * math.e + 1):.2f}, {1 / (2 * math.e + 1):.2f}, {math.e / (2 * math.e + 1):.2f}]; "
        f"output 0.42 x [1, 0] + 0.16 x [0, 1] + 0.42 x [1, 1] = [{out_plain[0, 0]:.2f}, {out_plain[0, 1]:.2f}]",
        "Scaling flattens the weights (smaller differences between scores), so every output moves towards the "
        "average of the values.",
        "",
        "unscaled, torch softmax(X Xᵀ) X vs NumPy: " + check_line(torch_plain, out_plain),
        "scaled, decoderlab.SelfAttention with identity weights vs NumPy: " + check_line(torch_scaled, out_scaled),
    ]
    return "\n".join(lines)


#: The lesson's encodings of three tokens (StatQuest, "Coding Self-Attention in PyTorch").
LESSON_ENCODINGS = [[1.16, 0.23], [0.57, 1.36], [4.41, -2.16]]


def _example_statquest_self_attention() -> str:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(42)
        sa = SelfAttention(d_model=2, row_dim=0, col_dim=1)
    x = torch.tensor(LESSON_ENCODINGS)
    with torch.no_grad():
        q, k, v = sa.W_q(x), sa.W_k(x), sa.W_v(x)
        sims = torch.matmul(q, k.transpose(0, 1))
        scaled = sims / torch.tensor(k.size(1) ** 0.5)
        percents = torch.softmax(scaled, dim=1)
        out = sa(x)
    # by hand, float64 NumPy, from the extracted weights only (nn.Linear computes x Wᵀ)
    X = np.array(LESSON_ENCODINGS, dtype=np.float64)
    Wq, Wk, Wv = (lin.weight.detach().double().numpy() for lin in (sa.W_q, sa.W_k, sa.W_v))
    Q, K, V = X @ Wq.T, X @ Wk.T, X @ Wv.T
    S = Q @ K.T
    SS = S / np.sqrt(K.shape[1])
    P = np_softmax_rows(SS)
    O = P @ V
    toks = ["token 1", "token 2", "token 3"]
    cols = ["dim 1", "dim 2"]

    def block(title, ours, ref, rows=toks, c=cols):
        return matrix(title, ours.detach().numpy() if isinstance(ours, torch.Tensor) else ours, rows, c) + \
            "\n" + check_line(ours.detach().numpy() if isinstance(ours, torch.Tensor) else ours, ref)

    parts = [
        "StatQuest, \"Coding Self-Attention in PyTorch\": torch.manual_seed(42); "
        "SelfAttention(d_model=2, row_dim=0, col_dim=1)",
        "Every step is recomputed by hand in float64 NumPy from the extracted weights (x Wᵀ, as nn.Linear does).",
        matrix("encodings matrix (word embeddings + positions, one row per token):", X, toks, cols),
        block("Wqᵀ = W_q.weight.transpose(0, 1):", sa.W_q.weight.transpose(0, 1), Wq.T, ["row 1", "row 2"],
              ["col 1", "col 2"]),
        block("Wkᵀ = W_k.weight.transpose(0, 1):", sa.W_k.weight.transpose(0, 1), Wk.T, ["row 1", "row 2"],
              ["col 1", "col 2"]),
        block("Wvᵀ = W_v.weight.transpose(0, 1):", sa.W_v.weight.transpose(0, 1), Wv.T, ["row 1", "row 2"],
              ["col 1", "col 2"]),
        block("Q = encodings Wqᵀ (queries):", q, Q),
        block("K = encodings Wkᵀ (keys):", k, K),
        block("V = encodings Wvᵀ (values):", v, V),
        block("similarities Q Kᵀ (queries down, keys across):", sims, S, toks, ["key 1", "key 2", "key 3"]),
        block("scaled similarities = similarities / sqrt(2):", scaled, SS, toks, ["key 1", "key 2", "key 3"]),
        block("attention percents = softmax of each row:", percents, P, toks, ["key 1", "key 2", "key 3"]),
        block("output = attention percents V (self-attention values):", out, O),
        "The lesson's output: [[1.0100, 1.0641], [0.2040, 0.7057], [3.4989, 2.2427]]",
    ]
    return "\n\n".join(parts)


def _example_position_encoding() -> str:
    pe4 = PositionEncoding(d_model=4, max_len=2).pe.numpy().astype(np.float64)
    prec = 5
    ref4 = np_sinusoidal(2, 4)
    pe2 = PositionEncoding(d_model=2, max_len=3).pe.numpy()
    ref2 = np_sinusoidal(3, 2)
    lines = [
        "Sinusoidal position encoding (StatQuest lesson; Vaswani et al. 2017, section 3.5):",
        "  PE(pos, 2i)   = sin(pos / 10000^(2i / d_model))",
        "  PE(pos, 2i+1) = cos(pos / 10000^(2i / d_model))",
        "",
        "d_model = 4, two tokens:",
        "  pos 0: i = 0 -> sin(0) = 0, cos(0) = 1; i = 1 -> sin(0) = 0, cos(0) = 1",
        # the values of the table below, rounded as there: cos(1/100) = 0.99995 is 1.0000 or 0.9999 at four
        # decimals depending on its last float32 bit, so five decimals show the same number in both places
        f"  pos 1: i = 0 -> sin(1) = {pe4[1, 0]:.{prec}f}, cos(1) = {pe4[1, 1]:.{prec}f}; "
        f"i = 1 -> sin(1/100) = {pe4[1, 2]:.{prec}f}, cos(1/100) = {pe4[1, 3]:.{prec}f}",
        matrix("decoderlab.PositionEncoding(d_model=4, max_len=2).pe:", pe4, ["pos 0", "pos 1"],
                ["sin i=0", "cos i=0", "sin i=1", "cos i=1"], prec=prec),
        check_line(pe4, ref4),
        "",
        "The lesson's defaults in its table, max_len = 3, d_model = 2 (first column sine, second cosine):",
        matrix("decoderlab.PositionEncoding(d_model=2, max_len=3).pe:", pe2, ["pos 0", "pos 1", "pos 2"],
                ["sin", "cos"]),
        check_line(pe2, ref2),
        "",
        "These values are added to the word embeddings: encoded = word embedding + PE[pos].",
    ]
    return "\n".join(lines)


#: The worked examples of ``decoderlab explain --example NAME``: name -> (function, one-line description).
EXAMPLES = {
    "self-attention-101": (_example_self_attention_101, "A=[1,0], B=[0,1], C=[1,1], Q=K=V=X, unscaled and scaled"),
    "statquest-self-attention": (_example_statquest_self_attention,
                                 "the lesson's SelfAttention, seed 42, every step checked by hand"),
    "position-encoding": (_example_position_encoding, "the lesson's sinusoidal position encoding values"),
}


def explain_example(name: str) -> str:
    """The step-by-step text of a worked example (see ``EXAMPLES``).

    Raises ``ValueError`` for an unknown name, listing the known ones."""
    if name not in EXAMPLES:
        raise ValueError(f"unknown example {name!r}; known examples: {', '.join(EXAMPLES)}")
    return EXAMPLES[name][0]()


#: models with d_model up to this print every matrix in ``explain``
