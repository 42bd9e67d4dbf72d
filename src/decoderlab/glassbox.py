"""The glass box: trace every attention number, recompute it by hand in float64, and explain it.

Three things, in the spirit of the lessons, which print every intermediate matrix and validate it by hand:

- :func:`trace` runs one forward pass of a ``DecoderOnlyTransformer`` and keeps every intermediate (per layer
  and head: queries, keys, values, similarities Q Kᵀ, scaled similarities, the mask, the attention percents
  and the head's output; per layer: the block input, the normalised input, the attention output after the
  output projection, the residual sums and the MLP output; at the end the logits and the top-k next-token
  probabilities) in a :class:`Trace`.
- :func:`verify` recomputes the whole forward pass independently in float64 NumPy from the model's extracted
  weights (the lesson's "we can extract the weights ... and use them to validate the math") and returns a
  :class:`VerifyReport` with the max abs difference at every step.
- :func:`explain` / :func:`explain_example` tell the story step by step as text (and, with ``png``/``html``,
  as heatmaps and a self-contained HTML report; drawing lives in ``decoderlab.plotting``).

Sources: the StatQuest lessons ("Coding Self-Attention in PyTorch", "Coding a ChatGPT Like Transformer From
Scratch in PyTorch"); "Day 27: Self-Attention Explained From Scratch" (A=[1,0], B=[0,1], C=[1,1]);
Vaswani et al. 2017 (scaled dot-product attention, sinusoidal positions); Radford et al. 2019 (GPT-2);
Su et al. 2021 (rotary positions); Zhang & Sennrich 2019 (RMSNorm).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

__all__ = [
    "LayerTrace", "Trace", "trace",
    "VerifyStep", "VerifyReport", "verify", "numpy_forward",
    "EXAMPLES", "explain_example", "explain", "explain_trace",
]

# ----------------------------------------------------------------------------------------------------------
# trace
# ----------------------------------------------------------------------------------------------------------

_ATTN_KEYS = ("q", "k", "v", "sims", "scaled_sims", "percents", "head_out")
_BLOCK_KEYS = ("input", "normed", "attn_out", "resid_1", "normed_2", "mlp_out", "resid_2")


@dataclass
class LayerTrace:
    """Everything one decoder block computed, for the kept heads ``heads`` (indices into the model's heads).

    B = batch, T = tokens, h = ``len(heads)``, d_head = d_model / n_head. Masks: True marks an ignored
    similarity (a key after the query: the causal mask), as everywhere in decoderlab.

    Attributes:
        index: the layer's index in ``model.blocks``.
        heads: the model's head indices kept here; axis 1 of the per-head tensors follows this order.
        input: (B, T, d_model) the block's input (embeddings + positions for layer 0).
        normed: (B, T, d_model) norm_1(input) (the input itself when the model has no norm).
        q, k, v: (B, h, T, d_head) queries, keys and values (after rotary positions, if any).
        sims: (B, h, T, T) similarities Q Kᵀ, queries down, keys across, before masking.
        scaled_sims: (B, h, T, T) sims / sqrt(d_head), before masking.
        mask: (T, T) bool, True = ignored (None when nothing is masked).
        percents: (B, h, T, T) attention percents: softmax of the masked scaled similarities; rows sum to 1.
        head_out: (B, h, T, d_head) each head's output, percents @ V.
        attn_out: (B, T, d_model) the heads concatenated (all heads) and, if the model has one, passed through
            the output projection.
        resid_1: (B, T, d_model) input + attn_out.
        normed_2, mlp_out, resid_2: (B, T, d_model) norm_2(resid_1), mlp(normed_2), resid_1 + mlp_out;
            None when the model has no MLP.
    """

    index: int
    heads: list[int]
    input: torch.Tensor
    normed: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    sims: torch.Tensor
    scaled_sims: torch.Tensor
    mask: torch.Tensor | None
    percents: torch.Tensor
    head_out: torch.Tensor
    attn_out: torch.Tensor
    resid_1: torch.Tensor
    normed_2: torch.Tensor | None = None
    mlp_out: torch.Tensor | None = None
    resid_2: torch.Tensor | None = None

    @property
    def output(self) -> torch.Tensor:
        """(B, T, d_model) the block's output (resid_2, or resid_1 without an MLP)."""
        return self.resid_2 if self.resid_2 is not None else self.resid_1

    def head_slot(self, head: int) -> int:
        """Position along axis 1 of the per-head tensors of the model's head ``head``.

        Raises ``ValueError`` when that head was not kept, naming the kept ones."""
        if head not in self.heads:
            raise ValueError(f"head {head} of layer {self.index} was not kept in this trace; kept: {self.heads}")
        return self.heads.index(head)


@dataclass
class Trace:
    """One forward pass, every number kept (see :func:`trace`).

    B = batch, T = tokens, V = num_tokens (vocabulary), k = top_k.

    Attributes:
        token_ids: (B, T) int64 the input ids.
        tokens: B lists of T token strings (None without a tokenizer).
        config: the model's ``ModelConfig``.
        word_embeddings: (B, T, d_model) the word embedding rows of the ids (``we``).
        encoded: (B, T, d_model) word embeddings + position encodings (the input of layer 0; equal to
            ``word_embeddings`` for rotary or no positions, which act inside attention instead).
        layers: one :class:`LayerTrace` per kept layer, in model order.
        final_input: (B, T, d_model) the last block's output.
        final_normed: (B, T, d_model) after the final norm (equal to final_input without norms).
        logits: (B, T, V) the output of ``fc_layer``: the same numbers as ``model(token_ids)``.
        top_k_probs: (B, T, k) the k most probable next tokens' probabilities (softmax of logits), descending.
        top_k_ids: (B, T, k) int64 their ids.
        top_k_tokens: B x T lists of k token strings (None without a tokenizer).
    """

    token_ids: torch.Tensor
    tokens: list[list[str]] | None
    config: Any
    word_embeddings: torch.Tensor
    encoded: torch.Tensor
    layers: list[LayerTrace]
    final_input: torch.Tensor
    final_normed: torch.Tensor
    logits: torch.Tensor
    top_k_probs: torch.Tensor
    top_k_ids: torch.Tensor
    top_k_tokens: list[list[list[str]]] | None = None

    def layer(self, index: int) -> LayerTrace:
        """The :class:`LayerTrace` of model layer ``index``; ``ValueError`` naming the kept layers if absent."""
        for lt in self.layers:
            if lt.index == index:
                return lt
        raise ValueError(f"layer {index} was not kept in this trace; kept layers: {[lt.index for lt in self.layers]}")

    def labels(self, batch: int = 0) -> list[str]:
        """Token strings of batch row ``batch`` (the ids as strings without a tokenizer)."""
        if self.tokens is not None:
            return list(self.tokens[batch])
        return [str(int(i)) for i in self.token_ids[batch]]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the trace holds, by a dotted name (``layers.0.percents`` ...)."""
        out: dict[str, torch.Tensor] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value
        for lt in self.layers:
            for f in fields(lt):
                value = getattr(lt, f.name)
                if isinstance(value, torch.Tensor):
                    out[f"layers.{lt.index}.{f.name}"] = value
        return out

    def nbytes(self) -> int:
        """Bytes held by the trace's tensors (each storage counted once)."""
        seen: set[tuple[int, int]] = set()
        total = 0
        for t in self.tensors().values():
            st = t.untyped_storage()
            key = (st.data_ptr(), st.nbytes()) if t.device.type != "meta" else (id(t), 0)
            if key in seen:
                continue
            seen.add(key)
            total += st.nbytes() if t.device.type != "meta" else t.numel() * t.element_size()
        return total


def _unwrap(model):
    from .checkpoint import unwrap_model

    model = unwrap_model(model)
    from .model import DecoderOnlyTransformer

    if not isinstance(model, DecoderOnlyTransformer):
        raise TypeError(f"model must be a decoderlab DecoderOnlyTransformer, got {type(model).__name__}")
    return model


def _as_ids(model, token_ids_or_text, tokenizer) -> torch.Tensor:
    """(B, T) int64 ids on the model's device, from text (needs a tokenizer), a list or a tensor."""
    if isinstance(token_ids_or_text, str):
        if tokenizer is None:
            raise ValueError("a text input needs a tokenizer (pass tokenizer=...), or pass token ids instead")
        ids = tokenizer.encode(token_ids_or_text)  # KeyError/ValueError naming an unknown token
        ids = torch.tensor(ids, dtype=torch.long)
    elif isinstance(token_ids_or_text, torch.Tensor):
        ids = token_ids_or_text
    elif isinstance(token_ids_or_text, (list, tuple)):
        ids = torch.tensor(token_ids_or_text, dtype=torch.long)
    else:
        raise TypeError(
            f"token_ids_or_text must be a str, a list of ids or a tensor, got {type(token_ids_or_text).__name__}"
        )
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.size(1) == 0:
        raise ValueError(f"need at least one token, as ids of shape (T,) or (B, T); got shape {tuple(ids.shape)}")
    model.check_token_ids(ids)
    if ids.size(1) > model.config.max_len:
        raise ValueError(
            f"sequence length T={ids.size(1)} is longer than max_len={model.config.max_len}; "
            f"allowed: T <= {model.config.max_len}"
        )
    return ids.to(device=model.we.weight.device, dtype=torch.long)


def _select(kind: str, wanted, n: int) -> list[int]:
    """Validate ``layers``/``heads``: None = all; an int or an iterable of ints in 0 .. n-1."""
    if wanted is None:
        return list(range(n))
    if isinstance(wanted, bool) or not isinstance(wanted, (int, Iterable)):
        raise TypeError(f"{kind}s must be an int, a list of ints or None, got {type(wanted).__name__}")
    items = [wanted] if isinstance(wanted, int) else list(wanted)
    if not items:
        raise ValueError(f"{kind}s is empty; valid {kind}s are 0 .. {n - 1}")
    out = []
    for i in items:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"{kind} index must be an int, got {i!r}")
        i = int(i)
        if not 0 <= i < n:
            what = "n_layer" if kind == "layer" else "n_head"
            raise ValueError(f"{kind} {i} is out of range; valid {kind}s are 0 .. {n - 1} ({what}={n})")
        if i not in out:
            out.append(i)
    return sorted(out)


def trace(model, token_ids_or_text, tokenizer=None, layers=None, heads=None, top_k: int = 5) -> Trace:
    """Run one forward pass and keep every intermediate number (see :class:`Trace`, :class:`LayerTrace`).

    Args:
        model: a ``DecoderOnlyTransformer`` (compiled or wrapped is fine).
        token_ids_or_text: ids (T,) or (B, T) (tensor or list), or a text (needs ``tokenizer``).
        tokenizer: encodes a text and gives token strings for ``tokens`` / ``top_k_tokens``.
        layers: an int or a list of layer indices to keep (None = all). Layers not kept run with the model's
            configured kernel and nothing of them is stored.
        heads: an int or a list of head indices to keep in each kept layer (None = all); only those heads'
            slices of the per-head tensors are stored.
        top_k: how many most probable next tokens to keep at every position (capped at num_tokens).

    The pass runs in eval mode (no dropout) without gradients. Kept layers use the explicit kernel (the
    same function as ``sdpa``; the logits agree with ``model(token_ids)`` to about 1e-6). The model is left
    as it was (mode, ``record`` hooks, no forward hooks left), even when the pass raises.

    Memory: a kept layer costs 3 B h T² floats (sims, scaled sims, percents) plus O(B T d_model); the
    logits B T V floats. A GPT-2 small trace of 1,024 tokens keeping one layer holds about 0.4 GB.

    Raises:
        ValueError: a layer or head index out of range (naming the valid range); T > max_len; ids out of
            range; text without a tokenizer.
        KeyError: a word the tokenizer does not know (from ``tokenizer.encode``).
        TypeError: not a DecoderOnlyTransformer; bad argument types.
    """
    model = _unwrap(model)
    cfg = model.config
    keep_layers = _select("layer", layers, cfg.n_layer)
    keep_heads = _select("head", heads, cfg.n_head)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    ids = _as_ids(model, token_ids_or_text, tokenizer)
    all_heads = keep_heads == list(range(cfg.n_head))
    head_index = torch.tensor(keep_heads, device=ids.device)

    captured: dict[str, torch.Tensor] = {}
    layer_data: dict[int, dict[str, Any]] = {}
    handles = []
    saved_records = [(b.record, b.attention.record) for b in model.blocks]
    was_training = model.training

    def _keep_heads(t: torch.Tensor) -> torch.Tensor:
        return t if all_heads else t.index_select(1, head_index)

    def _block_hook(i):
        def hook(block, args, output):
            rec, arec = block.record, block.attention.record
            data = {key: rec.get(key) for key in _BLOCK_KEYS}
            for key in _ATTN_KEYS:
                data[key] = _keep_heads(arec[key])
            mask = arec.get("mask")
            data["mask"] = None if mask is None else mask.clone()
            layer_data[i] = data
            # drop the full (B, H, T, T) tensors now, so only one layer's are alive at a time
            rec.clear()
            arec.clear()
        return hook

    def _save(name, which):
        def hook(module, args, output):
            captured[name] = args[0] if which == "in" else output
        return hook

    try:
        model.eval()
        for i in keep_layers:
            block = model.blocks[i]
            block.record = {}
            block.attention.record = {}
            handles.append(block.register_forward_hook(_block_hook(i)))
        handles.append(model.we.register_forward_hook(_save("word_embeddings", "out")))
        handles.append(model.drop.register_forward_hook(_save("encoded", "out")))
        handles.append(model.norm_f.register_forward_hook(_save("final_input", "in")))
        handles.append(model.norm_f.register_forward_hook(_save("final_normed", "out")))
        with torch.no_grad():
            logits = model(ids)
            k = min(top_k, cfg.num_tokens)
            logp = torch.log_softmax(logits.float(), dim=-1)
            top_vals, top_ids = logp.topk(k, dim=-1)
            top_probs = top_vals.exp()
            del logp
    finally:
        for h in handles:
            h.remove()
        for b, (rec, arec) in zip(model.blocks, saved_records):
            b.record = rec
            b.attention.record = arec
        model.train(was_training)

    layer_traces = []
    for i in keep_layers:
        d = layer_data[i]
        layer_traces.append(LayerTrace(index=i, heads=list(keep_heads), **d))
    tokens = top_tokens = None
    if tokenizer is not None:
        tokens = [tokenizer.tokens(row.tolist()) for row in ids.cpu()]
        top_tokens = [[tokenizer.tokens(pos.tolist()) for pos in row] for row in top_ids.cpu()]
    return Trace(
        token_ids=ids, tokens=tokens, config=cfg, word_embeddings=captured["word_embeddings"],
        encoded=captured["encoded"], layers=layer_traces, final_input=captured["final_input"],
        final_normed=captured["final_normed"], logits=logits, top_k_probs=top_probs, top_k_ids=top_ids,
        top_k_tokens=top_tokens,
    )


# ----------------------------------------------------------------------------------------------------------
# verify: the whole forward pass again, in float64 NumPy, from the extracted weights
# ----------------------------------------------------------------------------------------------------------


def _np_weights(model) -> dict[str, np.ndarray]:
    return {k: v.detach().to("cpu", torch.float64).numpy() for k, v in model.state_dict().items()}


def _np_sinusoidal(t: int, d_model: int) -> np.ndarray:
    """pe[pos, 2i] = sin(pos / 10000^(2i/d_model)), pe[pos, 2i+1] = cos(same angle) (the lesson's squiggles)."""
    pe = np.zeros((t, d_model))
    for pos in range(t):
        for col in range(d_model):
            two_i = col - (col % 2)
            angle = pos / 10000.0 ** (two_i / d_model)
            pe[pos, col] = math.sin(angle) if col % 2 == 0 else math.cos(angle)
    return pe


def _np_rope(x: np.ndarray, base: float = 10000.0) -> np.ndarray:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of (B, H, T, d_head) by pos * base^(-2i/d_head)."""
    t, d = x.shape[-2], x.shape[-1]
    out = np.empty_like(x)
    for i in range(d // 2):
        theta = np.arange(t) * base ** (-2.0 * i / d)  # (T,)
        c, s = np.cos(theta)[:, None], np.sin(theta)[:, None]
        a, b = x[..., 2 * i : 2 * i + 1], x[..., 2 * i + 1 : 2 * i + 2]
        out[..., 2 * i : 2 * i + 1] = a * c - b * s
        out[..., 2 * i + 1 : 2 * i + 2] = a * s + b * c
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


def numpy_forward(model, token_ids) -> list[tuple[str, np.ndarray]]:
    """The forward pass of ``model`` on ``token_ids`` ((T,) or (B, T)), recomputed in float64 NumPy.

    Only the model's config and its extracted weights (``state_dict``) are used; no torch module does any
    of the math. Sinusoidal and rotary positions are recomputed from their formulas. Returns the steps in
    order as ``(name, array)``: word embeddings, + positions, then per layer norm_1, q, k, v (B, H, T, d_head),
    sims, scaled sims, mask, percents (B, H, T, T), head out, attention out, residual 1, norm_2, mlp out,
    residual 2, then final norm and logits (B, T, num_tokens).
    """
    model = _unwrap(model)
    cfg = model.config
    w = _np_weights(model)
    ids = np.asarray(token_ids.detach().cpu() if isinstance(token_ids, torch.Tensor) else token_ids, dtype=np.int64)
    if ids.ndim == 1:
        ids = ids[None, :]
    b, t = ids.shape
    h, dh, d = cfg.n_head, cfg.d_head, cfg.d_model
    steps: list[tuple[str, np.ndarray]] = []

    x = w["we.weight"][ids]  # (B, T, d)
    steps.append(("word embeddings", x))
    if cfg.position == "sinusoidal":
        x = x + _np_sinusoidal(t, d)
    elif cfg.position == "learned":
        x = x + w["pe.weight"][:t]
    steps.append(("+ positions", x))
    mask = np.arange(t)[None, :] > np.arange(t)[:, None]  # (T, T) True = a later key: ignored

    for i in range(cfg.n_layer):
        p = f"blocks.{i}."
        n1 = _np_norm(cfg.norm, x, w, p + "norm_1", cfg.norm_eps)
        qkv = _np_linear(n1, w, p + "attention.qkv")  # (B, T, 3d)

        def heads(m):
            return m.reshape(b, t, h, dh).transpose(0, 2, 1, 3)

        q, k, v = heads(qkv[..., :d]), heads(qkv[..., d : 2 * d]), heads(qkv[..., 2 * d :])
        if getattr(cfg, "qk_norm", False):  # each head's q and k divided by its RMS (no gain)
            q = q / np.sqrt((q**2).mean(axis=-1, keepdims=True) + cfg.norm_eps)
            k = k / np.sqrt((k**2).mean(axis=-1, keepdims=True) + cfg.norm_eps)
        if cfg.position == "rope":
            q, k = _np_rope(q), _np_rope(k)
        sims = q @ k.transpose(0, 1, 3, 2)
        scaled = sims / math.sqrt(dh)
        masked = np.where(mask, -np.inf, scaled)
        e = np.exp(masked - masked.max(axis=-1, keepdims=True))
        percents = e / e.sum(axis=-1, keepdims=True)
        head_out = percents @ v  # (B, H, T, dh)
        concat = head_out.transpose(0, 2, 1, 3).reshape(b, t, d)
        attn = _np_linear(concat, w, p + "attention.proj") if cfg.attn_out_proj else concat
        r1 = x + attn
        steps += [(f"layer {i} norm_1", n1), (f"layer {i} q", q), (f"layer {i} k", k), (f"layer {i} v", v),
                  (f"layer {i} sims Q K^T", sims), (f"layer {i} scaled sims", scaled),
                  (f"layer {i} mask", mask.astype(np.float64)), (f"layer {i} percents", percents),
                  (f"layer {i} head out", head_out), (f"layer {i} attention out", attn),
                  (f"layer {i} residual 1", r1)]
        x = r1
        if cfg.mlp != "none":
            n2 = _np_norm(cfg.norm, r1, w, p + "norm_2", cfg.norm_eps)
            act = _np_relu2 if cfg.mlp == "relu2" else _np_gelu_tanh
            m = _np_linear(act(_np_linear(n2, w, p + "mlp.fc")), w, p + "mlp.proj")
            x = r1 + m
            steps += [(f"layer {i} norm_2", n2), (f"layer {i} mlp out", m), (f"layer {i} residual 2", x)]
    nf = _np_norm(cfg.norm, x, w, "norm_f", cfg.norm_eps)
    steps.append(("final norm", nf))
    steps.append(("logits", _np_linear(nf, w, "fc_layer")))
    return steps


def _torch_steps(tr: Trace) -> list[tuple[str, torch.Tensor]]:
    """The same steps as :func:`numpy_forward`, from a full trace."""
    steps = [("word embeddings", tr.word_embeddings), ("+ positions", tr.encoded)]
    t = tr.token_ids.size(1)
    for lt in tr.layers:
        i = lt.index
        mask = lt.mask if lt.mask is not None else torch.zeros(t, t, dtype=torch.bool)
        steps += [(f"layer {i} norm_1", lt.normed), (f"layer {i} q", lt.q), (f"layer {i} k", lt.k),
                  (f"layer {i} v", lt.v), (f"layer {i} sims Q K^T", lt.sims),
                  (f"layer {i} scaled sims", lt.scaled_sims), (f"layer {i} mask", mask),
                  (f"layer {i} percents", lt.percents), (f"layer {i} head out", lt.head_out),
                  (f"layer {i} attention out", lt.attn_out), (f"layer {i} residual 1", lt.resid_1)]
        if lt.mlp_out is not None:
            steps += [(f"layer {i} norm_2", lt.normed_2), (f"layer {i} mlp out", lt.mlp_out),
                      (f"layer {i} residual 2", lt.resid_2)]
    steps += [("final norm", tr.final_normed), ("logits", tr.logits)]
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

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps)

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
            f"(x max(1, max |ref|)): " + ("all ok" if not bad else f"{len(bad)} FAILED: {', '.join(bad)}")
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def verify(model, token_ids, tol: float = 1e-5, *, tokenizer=None) -> VerifyReport:
    """Recompute the whole forward pass in float64 NumPy from the extracted weights and compare every step.

    Args:
        model: a ``DecoderOnlyTransformer``.
        token_ids: ids (T,) or (B, T) (tensor or list), or a text when ``tokenizer`` is given.
        tol: tolerance; a step passes when max |diff| <= tol * max(1, max |NumPy value|).

    Returns a :class:`VerifyReport` (``.ok``, ``.steps``, ``.table()``). The torch side is a full
    :func:`trace` (explicit kernel, eval mode); the NumPy side is :func:`numpy_forward`.

    Raises:
        ValueError: tol <= 0; bad ids (as :func:`trace`).
    """
    if not (isinstance(tol, (int, float)) and tol > 0):
        raise ValueError(f"tol must be a positive number, got {tol!r}")
    model = _unwrap(model)
    tr = trace(model, token_ids, tokenizer=tokenizer)
    ref = numpy_forward(model, tr.token_ids)
    ours = _torch_steps(tr)
    assert [n for n, _ in ref] == [n for n, _ in ours], "step lists differ"  # same recipe on both sides
    steps = []
    for (name, r), (_, o) in zip(ref, ours):
        o64 = o.detach().to("cpu", torch.float64).numpy()
        if o64.shape != r.shape:
            o64 = np.broadcast_to(o64, r.shape)
        diff = float(np.abs(o64 - r).max()) if r.size else 0.0
        scale = float(np.abs(r).max()) if r.size else 0.0
        steps.append(VerifyStep(name, tuple(r.shape), diff, scale, diff <= tol * max(1.0, scale)))
    return VerifyReport(steps=steps, tol=float(tol), dtype=str(model.we.weight.dtype).replace("torch.", ""))


# ----------------------------------------------------------------------------------------------------------
# explain: text for a person
# ----------------------------------------------------------------------------------------------------------


def _fmt_row(values: Iterable[float], width: int = 9, prec: int = 4) -> str:
    return "".join(f"{v:{width}.{prec}f}" for v in values)


def _label(tok: str) -> str:
    """A printable label for a token string (whitespace made visible)."""
    out = tok.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    if out == " ":
        return "␣"
    return out


def _matrix(title: str, m, rows: Sequence[str] | None = None, cols: Sequence[str] | None = None,
            mask=None, prec: int = 4) -> str:
    """A titled matrix with row and column labels; masked cells print as ``-``."""
    m = np.asarray(m, dtype=np.float64)
    if m.ndim == 1:
        m = m[None, :]
    rows = [_label(r) for r in rows] if rows is not None else [str(i) for i in range(m.shape[0])]
    cols = [_label(c) for c in cols] if cols is not None else [f"[{j}]" for j in range(m.shape[1])]
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


def _check_line(ours, ref) -> str:
    diff = float(np.abs(np.asarray(ours, dtype=np.float64) - np.asarray(ref, dtype=np.float64)).max())
    return f"check: max |diff| = {diff:.2e} (float64 NumPy by hand)"


def _np_softmax_rows(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _example_self_attention_101() -> str:
    from .attention import SelfAttention

    names = ["A", "B", "C"]
    X = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    Q = K = V = X
    scores = Q @ K.T
    dk = K.shape[1]
    w_plain = _np_softmax_rows(scores)
    w_scaled = _np_softmax_rows(scores / math.sqrt(dk))
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
        _matrix("X = Q = K = V (one row per word):", X, names, ["x0", "x1"]),
        "",
        _matrix("Step 2, attention scores Q Kᵀ (queries down, keys across):", scores, names, names),
        "",
        f"Step 3, weights = softmax of each row          | scaled: softmax(scores / sqrt({dk}) = scores / "
        f"{math.sqrt(dk):.4f})",
    ]
    left = _matrix("", w_plain, names, names).splitlines()[1:]
    right = _matrix("", w_scaled, names, names).splitlines()[1:]
    lines += [f"{a:<46}  | {b}" for a, b in zip(left, right)]
    lines += ["", "Step 4, output = weights V (weighted sum of the value rows)  | scaled"]
    left = _matrix("", out_plain, names, ["out0", "out1"]).splitlines()[1:]
    right = _matrix("", out_scaled, names, ["out0", "out1"]).splitlines()[1:]
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
        "unscaled, torch softmax(X Xᵀ) X vs NumPy: " + _check_line(torch_plain, out_plain),
        "scaled, decoderlab.SelfAttention with identity weights vs NumPy: " + _check_line(torch_scaled, out_scaled),
    ]
    return "\n".join(lines)


#: The lesson's encodings of three tokens (StatQuest, "Coding Self-Attention in PyTorch").
LESSON_ENCODINGS = [[1.16, 0.23], [0.57, 1.36], [4.41, -2.16]]


def _example_statquest_self_attention() -> str:
    from .attention import SelfAttention

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
    P = _np_softmax_rows(SS)
    O = P @ V
    toks = ["token 1", "token 2", "token 3"]
    cols = ["dim 1", "dim 2"]

    def block(title, ours, ref, rows=toks, c=cols):
        return _matrix(title, ours.detach().numpy() if isinstance(ours, torch.Tensor) else ours, rows, c) + \
            "\n" + _check_line(ours.detach().numpy() if isinstance(ours, torch.Tensor) else ours, ref)

    parts = [
        "StatQuest, \"Coding Self-Attention in PyTorch\": torch.manual_seed(42); "
        "SelfAttention(d_model=2, row_dim=0, col_dim=1)",
        "Every step is recomputed by hand in float64 NumPy from the extracted weights (x Wᵀ, as nn.Linear does).",
        _matrix("encodings matrix (word embeddings + positions, one row per token):", X, toks, cols),
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
    from .positions import PositionEncoding

    pe4 = PositionEncoding(d_model=4, max_len=2).pe.numpy()
    ref4 = _np_sinusoidal(2, 4)
    pe2 = PositionEncoding(d_model=2, max_len=3).pe.numpy()
    ref2 = _np_sinusoidal(3, 2)
    lines = [
        "Sinusoidal position encoding (StatQuest lesson; Vaswani et al. 2017, section 3.5):",
        "  PE(pos, 2i)   = sin(pos / 10000^(2i / d_model))",
        "  PE(pos, 2i+1) = cos(pos / 10000^(2i / d_model))",
        "",
        "d_model = 4, two tokens:",
        "  pos 0: i = 0 -> sin(0) = 0, cos(0) = 1; i = 1 -> sin(0) = 0, cos(0) = 1",
        f"  pos 1: i = 0 -> sin(1) = {math.sin(1):.4f}, cos(1) = {math.cos(1):.4f}; "
        f"i = 1 -> sin(1/100) = {math.sin(0.01):.4f}, cos(1/100) = {math.cos(0.01):.4f}",
        _matrix("decoderlab.PositionEncoding(d_model=4, max_len=2).pe:", pe4, ["pos 0", "pos 1"],
                ["sin i=0", "cos i=0", "sin i=1", "cos i=1"]),
        _check_line(pe4, ref4),
        "",
        "The lesson's defaults in its table, max_len = 3, d_model = 2 (first column sine, second cosine):",
        _matrix("decoderlab.PositionEncoding(d_model=2, max_len=3).pe:", pe2, ["pos 0", "pos 1", "pos 2"],
                ["sin", "cos"]),
        _check_line(pe2, ref2),
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
SMALL_D_MODEL = 8
#: longest input for which ``explain`` prints full T x T percent tables of a larger model
TABLE_MAX_T = 24


def _attends_line(labels: list[str], row: np.ndarray, q_pos: int, top: int = 8) -> str:
    order = [j for j in np.argsort(-row, kind="stable") if j <= q_pos][:top]
    parts = [f"{_label(labels[j])}@{j} {100 * row[j]:.1f}%" for j in order]
    return f"{_label(labels[q_pos])}@{q_pos} attends to: " + ", ".join(parts)


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
    pos_labels = [f"{_label(s)}@{i}" for i, s in enumerate(labels)]
    small = cfg.d_model <= SMALL_D_MODEL
    dims = [f"dim {j}" for j in range(cfg.d_model)]
    out = [
        f"Input: {' '.join(_label(s) for s in labels)}   ({t} tokens, ids {tr.token_ids[batch].tolist()})",
        f"Model: d_model {cfg.d_model}, {cfg.n_layer} layer(s), {cfg.n_head} head(s) of d_head {cfg.d_head}, "
        f"norm {cfg.norm}, positions {cfg.position}, mlp {cfg.mlp}, vocabulary {cfg.num_tokens}",
        "Rows are queries (the token looking), columns are keys (the tokens looked at); '-' marks a masked "
        "similarity (a later token: it cannot be seen).",
    ]

    def np_(x):
        return x[batch].detach().to("cpu", torch.float64).numpy()

    if small:
        out += ["", _matrix("word embeddings (we):", np_(tr.word_embeddings), pos_labels, dims)]
        if cfg.position in ("sinusoidal", "learned"):
            out += ["", _matrix("position encodings:", np_(tr.encoded) - np_(tr.word_embeddings), pos_labels, dims),
                    "", _matrix("encoded = word embeddings + positions:", np_(tr.encoded), pos_labels, dims)]
        elif cfg.position == "rope":
            out += ["", "positions: rotary (applied to queries and keys inside attention)"]
    for lt in tr.layers:
        out += ["", f"=== layer {lt.index} ==="]
        mask = lt.mask.cpu().numpy() if lt.mask is not None else np.zeros((t, t), dtype=bool)
        if small:
            if cfg.norm != "none":
                out += [_matrix(f"normalised input ({cfg.norm}):", np_(lt.normed), pos_labels, dims), ""]
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
                        out += [_matrix(f"{nm} (d_model x d_head):", part, dims, hdims), ""]
                for nm, ten in (("Q (queries)", lt.q), ("K (keys)", lt.k), ("V (values)", lt.v)):
                    out += [_matrix(f"{nm}:", np_(ten)[slot], pos_labels, hdims), ""]
                out += [_matrix("similarities Q Kᵀ:", np_(lt.sims)[slot], pos_labels, pos_labels), ""]
                out += [_matrix(f"scaled similarities / sqrt({cfg.d_head}):", np_(lt.scaled_sims)[slot], pos_labels,
                                pos_labels, mask=mask), ""]
            if small or t <= TABLE_MAX_T:
                out += [_matrix("attention percents (softmax of each row; masked keys get 0):",
                                np_(lt.percents)[slot], pos_labels, pos_labels, mask=mask)]
            pct = np_(lt.percents)[slot]
            rows = range(t) if t <= TABLE_MAX_T and not small else [t - 1]
            for i in rows:
                out.append(_attends_line(labels, pct[i], i))
            if small:
                out += ["", _matrix("head output = percents V:", np_(lt.head_out)[slot], pos_labels, hdims)]
            out.append("")
        if small:
            proj = " after the output projection" if cfg.attn_out_proj else " (heads concatenated, no projection)"
            out += [_matrix(f"attention output{proj}:", np_(lt.attn_out), pos_labels, dims), "",
                    _matrix("residual: input + attention output:", np_(lt.resid_1), pos_labels, dims)]
            if lt.mlp_out is not None:
                out += ["", _matrix("MLP output:", np_(lt.mlp_out), pos_labels, dims), "",
                        _matrix("residual: + MLP output:", np_(lt.resid_2), pos_labels, dims)]
    if small and cfg.num_tokens <= 16:
        vocab = range(cfg.num_tokens)
        cols = tokenizer.tokens(vocab) if tokenizer is not None else [str(j) for j in vocab]
        out += ["", _matrix("logits (fc_layer output; one column per vocabulary token):", np_(tr.logits), pos_labels,
                            cols)]
    out += ["", "top next-token probabilities at each position:"]
    positions = range(t) if t <= TABLE_MAX_T else range(t - 5, t)
    if t > TABLE_MAX_T:
        out.append(f"(last 5 of {t} positions)")
    for i in positions:
        ids = tr.top_k_ids[batch, i].tolist()
        probs = tr.top_k_probs[batch, i].tolist()
        toks = tr.top_k_tokens[batch][i] if tr.top_k_tokens is not None else [str(j) for j in ids]
        cells = ", ".join(f"{_label(s)} {p:.4f}" for s, p in zip(toks, probs))
        out.append(f"  after {pos_labels[i]}: {cells}")
    best = tr.top_k_tokens[batch][t - 1][0] if tr.top_k_tokens is not None else str(int(tr.top_k_ids[batch, t - 1, 0]))
    out += ["", f"=> the top next token after {_label(labels[-1])} is {_label(best)} "
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
        from .checkpoint import load_checkpoint

        model, ckpt_tok = load_checkpoint(model)
        tokenizer = tokenizer or ckpt_tok
    model = _unwrap(model)
    tr = trace(model, text_or_ids, tokenizer=tokenizer, layers=layer, heads=head, top_k=top_k)
    text = explain_trace(tr, model, tokenizer)
    if png_path is not None or html_path is not None:
        from . import plotting

        if png_path is not None:
            title = "attention percents: " + " ".join(_label(s) for s in tr.labels())
            plotting.save_attention_png(tr, png_path, title=title)
        if html_path is not None:
            plotting.write_html_report(tr, html_path, text=text)
    return text
