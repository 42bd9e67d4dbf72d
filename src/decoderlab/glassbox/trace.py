"""``trace``: one forward pass of a ``DecoderOnlyTransformer`` with every intermediate kept (per layer and
head: q, k, v, similarities, scaled similarities, mask, attention percents, head output; per layer: the
block's input, normed input, attention output, residuals, MLP output; the logits and top-k next tokens).

The model's attention and blocks store their intermediates when their ``record`` attribute is a dict (no
PyTorch hooks); ``trace`` switches recording on for the layers it keeps and always off again.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields
from typing import Any, Iterable

import numpy as np
import torch

from ..checkpoint import unwrap_model
from ..model import DecoderOnlyTransformer


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


def unwrap(model):
    """The ``DecoderOnlyTransformer`` in ``model`` (compiled or wrapped); ``TypeError`` for anything else."""
    model = unwrap_model(model)
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
    if isinstance(wanted, bool) or not isinstance(wanted, (numbers.Integral, Iterable)):
        raise TypeError(f"{kind}s must be an int, a list of ints or None, got {type(wanted).__name__}")
    items = [wanted] if isinstance(wanted, numbers.Integral) else list(wanted)
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
    model = unwrap(model)
    cfg = model.config
    keep_layers = _select("layer", layers, cfg.n_layer)
    keep_heads = _select("head", heads, cfg.n_head)
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    top_k = int(top_k)
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


