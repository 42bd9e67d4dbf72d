"""Head detectors: how much each head attends as a previous-token, duplicate-token or induction head, and
how strongly heads of different layers compose.

The detection patterns and scores are TransformerLens's ``head_detector`` definitions, so the numbers
compare: a (T, T) 0/1 pattern of the query-key pairs such a head attends to, and the score "mul" = the share
of the head's attention that falls on them (sum(pattern * detection) / sum(pattern)), or "abs" = 1 - the
mean absolute difference times T (rounded to 3 decimals, as there). A batch of sequences gets the mean of
the rows' scores (TransformerLens's list of prompts). On a sequence of random tokens repeated twice
(:func:`repeated_tokens`) a perfect induction head scores 1/2 ("mul": each query of the second half on
its target; the first half has nothing to copy yet).

Sources: Olsson et al. 2022, "In-context Learning and Induction Heads"; Elhage et al. 2021, "A Mathematical
Framework for Transformer Circuits" (composition scores); TransformerLens ``head_detector.py`` and
``all_composition_scores`` (processed weights: norm gain folded into the reading weights, reading and
writing weights centred for layernorm).
"""

from __future__ import annotations

import numbers

import torch
import torch.nn as nn

from ..hooks import hook_model
from .cache import ActivationCache, as_ids, plain_linear, record

#: the detectors, by name (TransformerLens's without the "_head")
KINDS = ("previous_token", "duplicate_token", "induction")
ERROR_MEASURES = ("mul", "abs")


def detection_pattern(kind: str, tokens: torch.Tensor) -> torch.Tensor:
    """The (T, T) float 0/1 lower-triangular pattern of ``kind`` for one row of ``tokens`` (T,):

    - previous_token: query i attends to key i - 1;
    - duplicate_token: query i attends to every earlier key j holding the same token;
    - induction: query i attends to every key j + 1 after an earlier copy j of its token.

    Raises ``ValueError`` for an unknown kind (listing them)."""
    if kind not in KINDS:
        raise ValueError(f"unknown head detector {kind!r}; allowed: {', '.join(KINDS)}")
    tokens = tokens.reshape(-1).cpu()
    t = tokens.numel()
    if kind == "previous_token":
        return torch.diag(torch.ones(t - 1), -1)
    same = (tokens[:, None] == tokens[None, :]).float()
    duplicate = torch.tril(same, -1)  # an earlier copy, not the token itself
    if kind == "duplicate_token":
        return duplicate
    shifted = torch.zeros_like(duplicate)
    shifted[:, 1:] = duplicate[:, :-1]  # the key after each earlier copy
    return torch.tril(shifted)


def _score(patterns: torch.Tensor, det: torch.Tensor, exclude_bos: bool, exclude_current: bool,
           measure: str) -> torch.Tensor:
    """(H,) scores of one row's patterns (H, T, T) against its detection pattern (T, T)."""
    t = det.size(0)
    p = patterns.cpu().double()  # (float64 on the CPU, wherever the model runs: MPS has none)
    det = det.cpu().double()
    if measure == "mul":
        if exclude_bos or exclude_current:
            p = p.clone()
        if exclude_bos:
            p[:, :, 0] = 0
        if exclude_current:
            p.diagonal(dim1=-2, dim2=-1).zero_()
        return (p * det).sum((-2, -1)) / p.sum((-2, -1))
    diff = (p - det).abs()
    if exclude_bos:
        diff[:, :, 0] = 0
    if exclude_current:
        diff.diagonal(dim1=-2, dim2=-1).zero_()
    return torch.tensor([1 - round(float(d.mean()) * t, 3) for d in diff], dtype=torch.float64)


def _check_options(kind: str, error_measure: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown head detector {kind!r}; allowed: {', '.join(KINDS)}")
    if error_measure not in ERROR_MEASURES:
        raise ValueError(f"unknown error_measure {error_measure!r}; allowed: {', '.join(ERROR_MEASURES)}")


def pattern_names(model) -> list[str]:
    """The hook names the detectors read (every layer's ``attn.hook_pattern``)."""
    return [f"blocks.{i}.attn.hook_pattern" for i in range(hook_model(model).config.n_layer)]


def head_scores(model, token_ids=None, kind: str = "induction", *, cache: ActivationCache | None = None,
                exclude_bos: bool = False, exclude_current_token: bool = False, error_measure: str = "mul",
                tokenizer=None) -> torch.Tensor:
    """(n_layer, n_head) float64 score of every head as a ``kind`` head (see the module docstring).

    Args:
        model: a ``DecoderOnlyTransformer``.
        token_ids: ids (T,) or (B, T) (or a text with ``tokenizer``), T >= 2; ignored when ``cache`` is given.
        kind: "previous_token", "duplicate_token" or "induction".
        cache: an ``ActivationCache`` holding every layer's ``attn.hook_pattern`` (saves the pass).
        exclude_bos, exclude_current_token, error_measure: as TransformerLens's ``detect_head``.

    Raises:
        ValueError: an unknown kind or error measure; fewer than 2 tokens; bad ids.
    Source: TransformerLens ``head_detector.detect_head``.
    """
    return all_head_scores(model, token_ids, (kind,), cache=cache, exclude_bos=exclude_bos,
                           exclude_current_token=exclude_current_token, error_measure=error_measure,
                           tokenizer=tokenizer)[kind]


def all_head_scores(model, token_ids=None, kinds=KINDS, *, cache: ActivationCache | None = None,
                    exclude_bos: bool = False, exclude_current_token: bool = False, error_measure: str = "mul",
                    tokenizer=None) -> dict[str, torch.Tensor]:
    """{kind: (n_layer, n_head) scores} for several detectors from one forward pass (see :func:`head_scores`)."""
    model = hook_model(model)
    for kind in kinds:
        _check_options(kind, error_measure)
    if cache is None:
        ids = as_ids(model, token_ids, tokenizer)
        if ids.size(1) < 2:
            raise ValueError(f"the head detectors need at least 2 tokens per row, got {ids.size(1)}")
        cache = record(model, ids, pattern_names(model))
    ids = cache.token_ids
    patterns = [cache[name] for name in pattern_names(model)]  # n_layer x (B, H, T, T)
    out = {}
    for kind in kinds:
        dets = [detection_pattern(kind, row) for row in ids]
        rows = [torch.stack([_score(p[b], dets[b], exclude_bos, exclude_current_token, error_measure)
                             for p in patterns]) for b in range(ids.size(0))]
        out[kind] = torch.stack(rows).mean(0)
    return out


def repeated_tokens(num_tokens: int, length: int, *, repeats: int = 2, batch: int = 1, seed: int = 0,
                    first: int | None = None) -> torch.Tensor:
    """(batch, repeats * length (+1)) int64: ``length`` uniformly random ids from 0 .. num_tokens - 1, the same
    ids again ``repeats - 1`` times (the induction-head probe), after ``first`` when given (a start token
    such as ``<EOS>``). A seeded ``torch.Generator``; the global RNG is untouched.

    Raises ``ValueError`` for sizes below 1 (repeats below 2)."""
    for name, value, least in (("num_tokens", num_tokens, 1), ("length", length, 1), ("repeats", repeats, 2),
                               ("batch", batch, 1)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    gen = torch.Generator().manual_seed(int(seed))
    ids = torch.randint(0, num_tokens, (batch, length), generator=gen).repeat(1, repeats)
    if first is not None:
        ids = torch.cat([torch.full((batch, 1), int(first)), ids], dim=1)
    return ids


def _reading(model, w: torch.Tensor, layer: int) -> torch.Tensor:
    """A reading weight (d_model, ...) of ``layer`` with its norm's gain folded in (centred for layernorm)."""
    norm = model.blocks[layer].norm_1
    if isinstance(norm, nn.Identity):
        return w
    w = w * norm.weight.detach().to(w.device, w.dtype).view(-1, *([1] * (w.dim() - 1)))
    return w - w.mean(0, keepdim=True) if isinstance(norm, nn.LayerNorm) else w


def head_matrices(model, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """W_Q, W_K, W_V (H, d_model, d_head) and W_O (H, d_head, d_model) of ``layer`` in TransformerLens's
    layout (x @ W_Q), processed as TransformerLens's (norm gain folded in, centred for layernorm); the
    identity placement for W_O without an output projection; with grouped-query attention W_K and W_V of each
    query head are its group's. Float64, on the CPU (wherever the model runs)."""
    attn = model.blocks[layer].attention
    h, dh, d = attn.n_head, attn.d_head, attn.d_model
    qkv = plain_linear(attn.qkv, f"blocks.{layer}.attention.qkv").weight.detach().cpu().double()  # ((H + 2 H_kv) d_head, d_model)
    plain_linear(attn.proj, f"blocks.{layer}.attention.proj")
    q_rows, k_rows, v_rows = qkv.split((attn.q_size, attn.kv_size, attn.kv_size))
    w_q = _reading(model, q_rows.t().reshape(d, h, dh), layer).permute(1, 0, 2)
    # grouped-query attention: each query head's key/value head, repeated as TransformerLens's W_K / W_V are
    w_k, w_v = (_reading(model, rows.t().reshape(d, attn.n_kv_head, dh), layer).permute(1, 0, 2)
                .repeat_interleave(attn.group, dim=0) for rows in (k_rows, v_rows))
    if attn.proj is None:
        w_o = torch.eye(d, dtype=torch.float64).reshape(h, dh, d)
    else:
        w_o = attn.proj.weight.detach().cpu().double().t().reshape(h, dh, d)
        if isinstance(model.norm_f, nn.LayerNorm):  # what a layernorm reads is centred: centre what is written
            w_o = w_o - w_o.mean(-1, keepdim=True)
    return w_q, w_k, w_v, w_o


@torch.no_grad()
def composition_scores(model, mode: str = "K") -> torch.Tensor:
    """(n_layer, n_head, n_layer, n_head) float64: how much head (L1, H1)'s output is read by head (L2, H2)'s
    queries ("Q"), keys ("K") or values ("V"); ||W_OV1 W_2||_F / (||W_OV1||_F ||W_2||_F), with W_2 =
    W_QK2, W_QK2ᵀ or W_OV2, zero unless L1 < L2. Rotary positions and QK-norm act between the matrices and
    are not in the score (as in TransformerLens).

    Raises:
        ValueError: a model with one layer (composition is between heads of different layers: it needs
            two), or an unknown mode.
    Source: Elhage et al. 2021; TransformerLens ``all_composition_scores``.
    """
    model = hook_model(model)
    n = model.config.n_layer
    if mode not in ("Q", "K", "V"):
        raise ValueError(f"unknown composition mode {mode!r}; allowed: Q, K, V")
    if n < 2:
        raise ValueError(f"composition scores need a model with at least 2 layers (heads of an earlier layer "
                         f"read by a later one); this model has n_layer={n}")
    mats = [head_matrices(model, i) for i in range(n)]
    ov = torch.stack([w_v @ w_o for _, _, w_v, w_o in mats])  # (L, H, d, d)
    qk = torch.stack([w_q @ w_k.transpose(-2, -1) for w_q, w_k, _, _ in mats])
    right = {"Q": qk, "K": qk.transpose(-2, -1), "V": ov}[mode]
    left = ov[:, :, None, None]  # (L1, H1, 1, 1, d, d)
    prod = torch.linalg.matrix_norm(left @ right[None, None])
    scores = prod / torch.linalg.matrix_norm(ov)[:, :, None, None] / torch.linalg.matrix_norm(right)[None, None]
    earlier = torch.arange(n)[:, None, None, None] < torch.arange(n)[None, None, :, None]
    return torch.where(earlier, scores, torch.zeros_like(scores))


def scores_table(scores: dict[str, torch.Tensor]) -> str:
    """The CLI's table of :func:`all_head_scores`: one line per head, one column per detector."""
    kinds = list(scores)
    first = scores[kinds[0]]
    lines = ["  head    " + "".join(f"{k.replace('_', '-'):>17}" for k in kinds)]
    for layer in range(first.size(0)):
        for head in range(first.size(1)):
            row = "".join(f"{float(scores[k][layer, head]):17.3f}" for k in kinds)
            lines.append(f"  {f'L{layer}H{head}':<8}{row}")
    return "\n".join(lines)
