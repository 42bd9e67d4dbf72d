"""``verify``: the whole forward pass again, independently, in float64 NumPy from the extracted weights (the
lesson's "we can extract the weights ... and use them to validate the math"), compared step by step with
the model's own float32 (or other dtype) numbers from :func:`~decoderlab.glassbox.trace.trace`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..dtypes import weights_said
from ..quant import activation_types, dequantized_products, dequantized_state_dict
from .trace import Trace, trace, unwrap



def _np_weights(model) -> dict[str, np.ndarray]:
    """Every weight in float64 by its state-dict key; a block-quantized layer's (``--dtype q8_0`` ...) dequantized
    into ``.weight``: the quantization is a change of the weights, which the reference computes with exactly."""
    return {k: v.detach().to("cpu", torch.float64).numpy() for k, v in dequantized_state_dict(model).items()}


def np_sinusoidal(t: int, d_model: int) -> np.ndarray:
    """pe[pos, 2i] = sin(pos / 10000^(2i/d_model)), pe[pos, 2i+1] = cos(same angle) (the lesson's squiggles)."""
    pe = np.zeros((t, d_model))
    for pos in range(t):
        for col in range(d_model):
            two_i = col - (col % 2)
            angle = pos / 10000.0 ** (two_i / d_model)
            pe[pos, col] = math.sin(angle) if col % 2 == 0 else math.cos(angle)
    return pe


def _np_rope(x: np.ndarray, base: float = 10000.0, layout: str = "interleaved") -> np.ndarray:
    """Rotate pair i of (B, H, T, d_head) by pos * base^(-2i/d_head): the pair (x[2i], x[2i+1]) in the
    "interleaved" layout, (x[i], x[i + d_head/2]) in "rotate_half"."""
    t, d = x.shape[-2], x.shape[-1]
    out = np.empty_like(x)
    for i in range(d // 2):
        theta = np.arange(t) * base ** (-2.0 * i / d)  # (T,)
        c, s = np.cos(theta)[:, None], np.sin(theta)[:, None]
        j, k = (2 * i, 2 * i + 1) if layout == "interleaved" else (i, i + d // 2)
        a, b = x[..., j : j + 1], x[..., k : k + 1]
        out[..., j : j + 1] = a * c - b * s
        out[..., k : k + 1] = a * s + b * c
    return out


def _np_norm(kind: str, x: np.ndarray, w: dict, prefix: str, eps: float) -> np.ndarray:
    if kind == "none":
        return x
    if kind == "layernorm":
        mu = x.mean(axis=-1, keepdims=True)
        var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
        y = (x - mu) / np.sqrt(var + eps)
    elif kind == "rmsnorm":
        y = x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + eps)
    else:  # pragma: no cover - configs are validated
        raise ValueError(f"unknown norm {kind!r}")
    y = y * w[prefix + ".weight"]
    if prefix + ".bias" in w:
        y = y + w[prefix + ".bias"]
    return y


def _np_linear(x: np.ndarray, w: dict, prefix: str) -> np.ndarray:
    """nn.Linear's math: x Wᵀ + b."""
    y = x @ w[prefix + ".weight"].T
    if prefix + ".bias" in w:
        y = y + w[prefix + ".bias"]
    return y


def _np_gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _np_relu2(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0) ** 2


def _np_mlp(cfg, w: dict, p: str, x: np.ndarray) -> np.ndarray:
    """One block's MLP in float64: proj(act(fc(x))), or SwiGLU's proj(silu(gate(x)) * fc(x)), or GeGLU's
    proj(gelu_tanh(gate(x)) * fc(x))."""
    if cfg.mlp == "swiglu":
        g = _np_linear(x, w, p + "mlp.gate")
        hidden = g / (1.0 + np.exp(-g)) * _np_linear(x, w, p + "mlp.fc")
    elif cfg.mlp == "geglu":
        hidden = _np_gelu_tanh(_np_linear(x, w, p + "mlp.gate")) * _np_linear(x, w, p + "mlp.fc")
    else:
        hidden = (_np_relu2 if cfg.mlp == "relu2" else _np_gelu_tanh)(_np_linear(x, w, p + "mlp.fc"))
    return _np_linear(hidden, w, p + "mlp.proj")


def numpy_forward(model, token_ids) -> list[tuple[str, np.ndarray]]:
    """The forward pass of ``model`` on ``token_ids`` ((T,) or (B, T)), recomputed in float64 NumPy.

    Only the model's config and its extracted weights (``state_dict``) are used; no torch module does any
    of the math. Sinusoidal and rotary positions are recomputed from their formulas. Returns the steps in
    order as ``(name, array)``: word embeddings, + positions, then per layer norm_1, q, k, v (B, H, T, d_head:
    with grouped-query attention each query head's keys and values are those of its group's key/value head),
    sims, scaled sims, mask, percents (B, H, T, T), head out, attention out, residual 1, norm_2, mlp out,
    residual 2, then final norm and logits (B, T, num_tokens). A model without norms (``norm="none"``, the
    lesson's) has no norm steps; one without an MLP no norm_2, mlp out and residual 2.
    """
    return _np_pass(model, token_ids)[0]


def _np_attention(cfg, w: dict, p: str, n1: np.ndarray, mask: np.ndarray, layer: int = 0) -> tuple:
    """One block's self-attention in float64 on its normed input ``n1`` (B, T, d_model): ``(q, k, v, sims,
    scaled sims, percents, head out)``, each (B, H, T, .) -- q, k and v after the qk-norm and rope (the
    layer's own base) when the model has them; k and v of query head j are key/value head j // (n_head /
    n_kv_head)'s. ``mask`` (T, T): True = a later key (or one outside the layer's window), ignored."""
    b, t, _ = n1.shape
    h, kv, dh = cfg.n_head, cfg.kv_heads, cfg.d_head
    qkv = _np_linear(n1, w, p + "attention.qkv")  # (B, T, (H + 2 H_kv) d_head): [q heads | k heads | v heads]

    def heads(m, n):
        return m.reshape(b, t, n, dh).transpose(0, 2, 1, 3)

    q = heads(qkv[..., : h * dh], h)
    k, v = heads(qkv[..., h * dh : (h + kv) * dh], kv), heads(qkv[..., (h + kv) * dh :], kv)
    if cfg.qk_norm:  # each head's q and k divided by its RMS, times the gain shared by the heads if any
        q = q / np.sqrt((q**2).mean(axis=-1, keepdims=True) + cfg.norm_eps)
        k = k / np.sqrt((k**2).mean(axis=-1, keepdims=True) + cfg.norm_eps)
        if cfg.qk_norm_gain:
            q, k = q * w[p + "attention.q_norm.weight"], k * w[p + "attention.k_norm.weight"]
    if cfg.position == "rope":
        base = cfg.rope_theta_of(layer)
        q, k = _np_rope(q, base, cfg.rope_layout), _np_rope(k, base, cfg.rope_layout)
    group = [j * kv // h for j in range(h)]  # each query head's key/value head
    k, v = k[:, group], v[:, group]
    sims = q @ k.transpose(0, 1, 3, 2)
    scaled = sims / math.sqrt(cfg.query_pre_attn_scalar or dh)
    masked = np.where(mask, -np.inf, scaled)
    e = np.exp(masked - masked.max(axis=-1, keepdims=True))
    percents = e / e.sum(axis=-1, keepdims=True)
    return q, k, v, sims, scaled, percents, percents @ v  # head out (B, H, T, dh)


def _np_pass(model, token_ids) -> tuple[list[tuple[str, np.ndarray]], dict]:
    """:func:`numpy_forward`'s steps, and the parts the residual stream is the sum of: ``embed``, ``pos``
    (None for rope / no positions), per layer ``heads`` (B, T, H, d_model), ``attn_bias`` (d_model,) or None,
    ``mlp`` or None, and the ``final`` residual (B, T, d_model)."""

    model = unwrap(model)
    cfg = model.config
    w = _np_weights(model)
    ids = np.asarray(token_ids.detach().cpu() if isinstance(token_ids, torch.Tensor) else token_ids, dtype=np.int64)
    if ids.ndim == 1:
        ids = ids[None, :]
    b, t = ids.shape
    d = cfg.d_model
    steps: list[tuple[str, np.ndarray]] = []
    normed = cfg.norm != "none"  # a model without norms has no norm steps to list

    x = w["we.weight"][ids]  # (B, T, d)
    if cfg.embed_scale:
        x = x * math.sqrt(d)
    steps.append(("word embeddings", x))
    parts: dict = {"embed": x, "pos": None, "layers": []}
    if cfg.position == "sinusoidal":
        parts["pos"] = np.broadcast_to(np_sinusoidal(t, d), x.shape)
    elif cfg.position == "learned":
        parts["pos"] = np.broadcast_to(w["pe.weight"][:t], x.shape)
    x = x + parts["pos"] if parts["pos"] is not None else x
    steps.append(("+ positions", x))
    later = np.arange(t)[None, :] > np.arange(t)[:, None]  # (T, T) True = a later key: ignored

    for i in range(cfg.n_layer):
        p = f"blocks.{i}."
        window = cfg.window_of(i)  # a key W or more positions back is outside a sliding layer's window
        mask = later if window is None else later | (np.arange(t)[:, None] - np.arange(t)[None, :] >= window)
        n1 = _np_norm(cfg.norm, x, w, p + "norm_1", cfg.norm_eps)
        q, k, v, sims, scaled, percents, head_out = _np_attention(cfg, w, p, n1, mask, i)
        concat = head_out.transpose(0, 2, 1, 3).reshape(b, t, cfg.n_head * cfg.d_head)
        attn = _np_linear(concat, w, p + "attention.proj") if cfg.attn_out_proj else concat
        post = None  # a norm after attention: each head's part through it with the scale of the whole frozen
        if cfg.sandwich_norm:
            post = np.sqrt((attn**2).mean(axis=-1, keepdims=True) + cfg.norm_eps)[:, :, None]  # (B, T, 1, 1)
            attn = _np_norm(cfg.norm, attn, w, p + "norm_1_post", cfg.norm_eps)
        heads = _np_head_results(head_out, w, p, cfg)
        if post is not None:
            heads = heads / post * w[p + "norm_1_post.weight"]
        parts["layers"].append(dict(heads=heads, mlp=None,
                                    attn_bias=w.get(p + "attention.proj.bias") if cfg.attn_out_proj else None))
        r1 = x + attn
        steps += [(f"layer {i} norm_1", n1)] if normed else []
        steps += [(f"layer {i} q", q), (f"layer {i} k", k), (f"layer {i} v", v),
                  (f"layer {i} sims Q K^T", sims), (f"layer {i} scaled sims", scaled),
                  (f"layer {i} mask", mask.astype(np.float64)), (f"layer {i} percents", percents),
                  (f"layer {i} head out", head_out), (f"layer {i} attention out", attn),
                  (f"layer {i} residual 1", r1)]
        x = r1
        if cfg.mlp != "none":
            n2 = _np_norm(cfg.norm, r1, w, p + "norm_2", cfg.norm_eps)
            m = _np_mlp(cfg, w, p, n2)
            if cfg.sandwich_norm:
                m = _np_norm(cfg.norm, m, w, p + "norm_2_post", cfg.norm_eps)
            x = r1 + m
            parts["layers"][-1]["mlp"] = m
            steps += [(f"layer {i} norm_2", n2)] if normed else []
            steps += [(f"layer {i} mlp out", m), (f"layer {i} residual 2", x)]
    nf = _np_norm(cfg.norm, x, w, "norm_f", cfg.norm_eps)
    if normed:
        steps.append(("final norm", nf))
    steps.append(("logits", _np_linear(nf, w, "fc_layer")))
    parts["final"] = x
    return steps, parts


def _np_head_results(head_out: np.ndarray, w: dict, p: str, cfg) -> np.ndarray:
    """(B, T, H, d_model) each head's output written into the residual: its d_head columns of the output
    projection (its own d_head slice without one)."""
    b, h, t, dh = head_out.shape
    out = np.zeros((b, t, h, cfg.d_model))
    for j in range(h):
        z = head_out[:, j]  # (B, T, d_head)
        if cfg.attn_out_proj:
            out[:, :, j] = z @ w[p + "attention.proj.weight"][:, j * dh:(j + 1) * dh].T
        else:
            out[:, :, j, j * dh:(j + 1) * dh] = z
    return out


def numpy_head_results(model, token_ids) -> list[np.ndarray]:
    """Per layer, (B, T, H, d_model) what each head writes into the residual stream, recomputed in float64
    NumPy from the weights (the independent check of ``ActivationCache.head_results``)."""
    return [layer["heads"] for layer in _np_pass(model, token_ids)[1]["layers"]]


def numpy_decompose(model, token_ids, position: int, token: int, batch: int = 0
                    ) -> tuple[list[str], np.ndarray, float]:
    """The decomposition of :func:`~decoderlab.glassbox.attribution.decompose` recomputed in float64 NumPy from
    the weights: ``(labels, values, logit)`` with the same labels, each part's contribution through the final
    norm with its scale frozen (computed here from the recomputed final residual), and the recomputed logit."""
    model = unwrap(model)
    cfg = model.config
    steps, parts = _np_pass(model, token_ids)
    w = _np_weights(model)
    labels, vecs = ["embed"], [parts["embed"][batch, position]]
    if parts["pos"] is not None:
        labels.append("pos_embed")
        vecs.append(parts["pos"][batch, position])
    for i, layer in enumerate(parts["layers"]):
        labels += [f"L{i}H{j}" for j in range(cfg.n_head)]
        vecs += list(layer["heads"][batch, position])
        if layer["attn_bias"] is not None:
            labels.append(f"L{i} attn bias")
            vecs.append(layer["attn_bias"])
        if layer["mlp"] is not None:
            labels.append(f"L{i} mlp")
            vecs.append(layer["mlp"][batch, position])
    final = parts["final"][batch, position]
    w_u = w["fc_layer.weight"][token]
    values = []
    for v in vecs:
        if cfg.norm == "layernorm":
            v = (v - v.mean()) / math.sqrt(((final - final.mean()) ** 2).mean() + cfg.norm_eps) * w["norm_f.weight"]
        elif cfg.norm == "rmsnorm":
            v = v / math.sqrt((final**2).mean() + cfg.norm_eps) * w["norm_f.weight"]
        values.append(float(v @ w_u))
    if cfg.norm == "layernorm" and "norm_f.bias" in w:
        labels.append("final norm bias")
        values.append(float(w["norm_f.bias"] @ w_u))
    if "fc_layer.bias" in w:
        labels.append("unembed bias")
        values.append(float(w["fc_layer.bias"][token]))
    return labels, np.array(values), float(steps[-1][1][batch, position, token])


def _torch_steps(tr: Trace) -> list[tuple[str, torch.Tensor]]:
    """The same steps as :func:`numpy_forward`, from a full trace."""
    steps = [("word embeddings", tr.word_embeddings), ("+ positions", tr.encoded)]
    t = tr.token_ids.size(1)
    normed = tr.config.norm != "none"
    for lt in tr.layers:
        i = lt.index
        mask = lt.mask if lt.mask is not None else torch.zeros(t, t, dtype=torch.bool)
        steps += [(f"layer {i} norm_1", lt.normed)] if normed else []
        steps += [(f"layer {i} q", lt.q), (f"layer {i} k", lt.k),
                  (f"layer {i} v", lt.v), (f"layer {i} sims Q K^T", lt.sims),
                  (f"layer {i} scaled sims", lt.scaled_sims), (f"layer {i} mask", mask),
                  (f"layer {i} percents", lt.percents), (f"layer {i} head out", lt.head_out),
                  (f"layer {i} attention out", lt.attn_out), (f"layer {i} residual 1", lt.resid_1)]
        if lt.mlp_out is not None:
            steps += [(f"layer {i} norm_2", lt.normed_2)] if normed else []
            steps += [(f"layer {i} mlp out", lt.mlp_out), (f"layer {i} residual 2", lt.resid_2)]
    steps += [("final norm", tr.final_normed)] if normed else []
    steps.append(("logits", tr.logits))
    return steps


@dataclass
class VerifyStep:
    """One row of a :class:`VerifyReport`: the step, its shape, max |torch - NumPy|, max |NumPy| and ok."""

    name: str
    shape: tuple[int, ...]
    max_abs_diff: float
    max_abs_ref: float
    ok: bool


@dataclass
class VerifyReport:
    """The per-step comparison of the model's forward pass with the float64 NumPy recomputation.

    A step is ok when max |torch - NumPy| <= tol * max(1, max |NumPy|): an absolute tolerance for values of
    order one, relative for larger ones (float32 keeps about 7 significant digits).
    """

    steps: list[VerifyStep]
    tol: float
    dtype: str = "float32"
    #: lines after the table (a block model: how its products ran here and how they run when decoding; a 16-bit
    #: model: the drift of its own pass)
    note: str = ""
    #: a 16-bit model whose own pass overflows on this text: the first step that does ("" when none; not ok)
    overflow: str = ""

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps) and not self.overflow

    @property
    def max_abs_diff(self) -> float:
        return max(s.max_abs_diff for s in self.steps)

    def step(self, name: str) -> VerifyStep:
        for s in self.steps:
            if s.name == name:
                return s
        raise KeyError(f"no step {name!r}; steps: {', '.join(s.name for s in self.steps)}")

    def table(self) -> str:
        """The report as a fixed-width text table."""
        w = max(len(s.name) for s in self.steps)
        lines = [f"{'step':<{w}}  {'shape':<22}  {'max |diff|':>11}  {'max |ref|':>10}  ok",
                 f"{'-' * w}  {'-' * 22}  {'-' * 11}  {'-' * 10}  --"]
        for s in self.steps:
            lines.append(f"{s.name:<{w}}  {str(s.shape):<22}  {s.max_abs_diff:11.3e}  {s.max_abs_ref:10.3g}  "
                         f"{'ok' if s.ok else 'FAIL'}")
        bad = [s.name for s in self.steps if not s.ok]
        lines.append(
            f"{len(self.steps)} steps, {self.dtype} model vs float64 NumPy, tolerance {self.tol:g} "
            f"(x max(1, max |ref|)): " + (f"{len(bad)} FAILED: {_first(bad)}" if bad else
                                          f"all ok in float32, but the {self.dtype} pass overflows at "
                                          f"{self.overflow}" if self.overflow else "all ok")
        )
        return "\n".join(lines + [self.note] * bool(self.note))

    def __str__(self) -> str:
        return self.table()


def _first(names: list[str], shown: int = 8) -> str:
    """The failed steps for the summary line: the first ``shown`` (the earliest is where a fault starts; the
    table above lists every step), then how many more."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def verify(model, token_ids, tol: float = 1e-5, *, tokenizer=None) -> VerifyReport:
    """Recompute the whole forward pass in float64 NumPy from the extracted weights and compare every step.

    Args:
        model: a ``DecoderOnlyTransformer``; with block-quantized weights (``q8_0`` ... ``q6_k``) the
            reference takes their dequantized values (the quantization changed the weights; what is checked is
            the arithmetic done with them: the block products run on the dequantized weights here, and the report's
            note says which activation blocks the kernels quantize to when decoding); cast whole to bfloat16 or
            float16, a float32 copy computes on its 16-bit weights and the note gives the 16-bit pass's own drift
            (the report is not ok when that pass overflows: ``.overflow`` names the step).
        token_ids: ids (T,) or (B, T) (tensor or list), or a text when ``tokenizer`` is given.
        tol: tolerance; a step passes when max |diff| <= tol * max(1, max |NumPy value|).

    Returns a :class:`VerifyReport` (``.ok``, ``.steps``, ``.table()``). The torch side is a full
    :func:`trace` (explicit kernel, eval mode); the NumPy side is :func:`numpy_forward`.

    Raises:
        ValueError: tol <= 0; bad ids (as :func:`trace`).
    """
    if not (isinstance(tol, (int, float)) and tol > 0):
        raise ValueError(f"tol must be a positive number, got {tol!r}")
    model = unwrap(model)
    rounding = _rounding_dtype(model)
    # a model cast whole to 16 bits rounds every activation too: its error grows through the layers (up to a
    # quarter of a step's largest value in bfloat16, measured on SmolLM2), so no tolerance separates a fault from
    # the format. What is checked is the arithmetic on its 16-bit weights, in float32, as for block models.
    checked = copy.deepcopy(model).float() if rounding is not None else model
    with dequantized_products():  # the arithmetic with the dequantized weights, as the reference computes it
        tr = trace(checked, token_ids, tokenizer=tokenizer)
    ref = numpy_forward(model, tr.token_ids)
    steps = _compare(ref, _torch_steps(tr), tol)
    notes = []
    quantized = activation_types(model)
    if quantized:
        notes.append(f"block products here: F.linear on the dequantized weights; when decoding, decoderlab.kernels "
                     f"quantize their activations to {' / '.join(quantized)} blocks as ggml does (not checked here)")
    overflow = ""
    if rounding is not None:
        note, overflow = _rounding_note(model, tr.token_ids, ref, rounding)
        notes.append(note)
    return VerifyReport(steps=steps, tol=float(tol), dtype=weights_said(model), note="\n".join(notes),
                        overflow=overflow)


def _compare(ref, ours, tol: float) -> list[VerifyStep]:
    """One :class:`VerifyStep` per step: ``ref`` and ``ours`` are ``[(name, value)]`` in the same order."""
    assert [n for n, _ in ref] == [n for n, _ in ours], "step lists differ"  # same recipe on both sides
    steps = []
    for (name, r), (_, o) in zip(ref, ours):
        o64 = o.detach().to("cpu", torch.float64).numpy()
        if o64.shape != r.shape:
            o64 = np.broadcast_to(o64, r.shape)
        diff = float(np.abs(o64 - r).max()) if r.size else 0.0
        scale = float(np.abs(r).max()) if r.size else 0.0
        steps.append(VerifyStep(name, tuple(r.shape), diff, scale, diff <= tol * max(1.0, scale)))
    return steps


def _rounding_dtype(model) -> torch.dtype | None:
    """The 16-bit dtype a model was cast to whole (``--dtype bfloat16`` / ``float16``: its plain linear layers
    hold it), or None. A GGUF file's 16-bit matrices kept by :mod:`decoderlab.half` compute in float32: not this."""
    linear = next((m for m in model.modules() if type(m) is torch.nn.Linear), None)
    dtype = linear.weight.dtype if linear is not None else next(model.parameters()).dtype
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


def _rounding_note(model, token_ids, ref, rounding: torch.dtype) -> tuple[str, str]:
    """``(note, overflow)``: what the 16-bit pass itself does on this text -- its largest drift from float64
    (x max(1, max |ref|)) and where, or the first step where it overflows (float16's largest value is 65,504), the
    step's name then in ``overflow`` ("" when it does not)."""
    name = str(rounding).removeprefix("torch.")
    with dequantized_products():
        drift = _compare(ref, _torch_steps(trace(model, token_ids)), 1.0)
    worst = max(drift, key=lambda s: s.max_abs_diff / max(1.0, s.max_abs_ref))
    said = f"weights checked as they are in {name}, the pass here in float32; the {name} pass"
    if not math.isfinite(worst.max_abs_diff):
        bad = next(s for s in drift if not math.isfinite(s.max_abs_diff))
        return f"{said} overflows on this text (at {bad.name}): use bfloat16 or float32", bad.name
    return (f"{said} drifts from float64 by up to {worst.max_abs_diff / max(1.0, worst.max_abs_ref):.2g} x max(1, "
            f"max |ref|) on this text (at {worst.name}): {name}'s rounding of every activation, not checked"), ""


