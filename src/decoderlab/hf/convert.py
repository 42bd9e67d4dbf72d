"""The shared converter: a family's table of names turned into our state dict and back.

A family module (:mod:`.gpt2`, :mod:`.llama`, :mod:`.qwen`, :mod:`.recipe`) says only what differs: the names of
its tensors beside ours (``TOP``: outside the blocks, ``BLOCK``: inside block ``i``), which of them carry a
bias in a given config, and how its config.json maps to a ``ModelConfig``. Everything else is here, once:

* :func:`table` walks a family's names for one model and yields an :class:`Entry` per tensor of ours -- the
  Hugging Face tensor(s) it is made of, stacked along rows (q, k and v make our one fused ``qkv``), transposed
  (GPT-2's ``Conv1D`` stores (in, out)), with the rope rows permuted between layouts -- or a :class:`Fill` for a
  tensor only the Hugging Face class has (a zero bias, a unit gain);
* :func:`read_state` builds our tensors from the weight files, each checked against the shape the config gives
  and copied once into its final dtype and device (:class:`.weights.WeightFiles` frees each file's pages after);
* :func:`write_state` gives the Hugging Face tensors of one of our models;
* :func:`center_writes` is the reshape that carries a LayerNorm without a bias into a class with RMSNorm.

The rope permutation: our ``rope_layout="interleaved"`` rotates the pairs (x[2i], x[2i+1]) of each head;
Hugging Face's Llama family (``rope_layout="rotate_half"``) the pairs (x[i], x[i + d_head/2]), with the same
angle for pair i. So a head's query/key rows (weights, biases, QK-norm gains) in the interleaved layout,
reordered [0, 2, 4, ..., 1, 3, 5, ...], are the rotate-half rows of the same function: the attention scores
q . k are sums over a head's dims, the same in any order both share.

Source: the shape of TransformerLens's ``pretrained/weight_conversions`` and llama.cpp's
``convert_hf_to_gguf.py`` (a table of names per architecture); the permutation is llama.cpp's ``permute``
read the other way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch

from ..config.model import ModelConfig
from .weights import WeightFiles


class ConfigError(ValueError):
    """A config.json field the class cannot honour or decoderlab cannot read; ``field`` names it."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Entry:
    """One tensor of ours and the Hugging Face tensor(s) it is made of.

    ``parts``: (Hugging Face name, rows, rope) for each, stacked along dim 0 in this order (one part: the whole
    tensor); rope = its rows are heads of ``d_head`` rows that rope turns (permuted between layouts). No parts:
    the class has no such tensor, and ours is zeros (a bias of ours the class lacks). ``transpose``: stored
    (in, out) (GPT-2's ``Conv1D``). ``offset``: ours is theirs + offset (Gemma's norms store weight for a gain
    of 1 + weight; ours holds the gain)."""

    ours: str
    parts: tuple[tuple[str, int, bool], ...]
    transpose: bool = False
    offset: float = 0.0


@dataclass(frozen=True)
class Fill:
    """A Hugging Face tensor of ``shape`` our model has no counterpart of: ``value`` everywhere (0 for a bias,
    1 for a norm's gain), which computes what ours computes without it."""

    theirs: str
    shape: tuple[int, ...]
    value: float


@dataclass(frozen=True)
class Names:
    """A family's names in one config: ``top`` and ``block`` map our module names to theirs (a tuple of theirs
    stacks them: q, k, v); ``bias(theirs)`` says whether that module of theirs has a bias in this config;
    ``gains`` are our QK-norm modules the class always has a gain for; ``prefix`` the name of block ``i``'s
    module of theirs; ``transposed`` their modules stored (in, out); ``norms`` our norm modules whose gain the
    class stores minus ``norm_offset`` (Gemma's 1 + weight)."""

    top: Mapping[str, str]
    block: Mapping[str, str | tuple[str, ...]]
    prefix: str
    bias: Callable[[str], bool]
    gains: tuple[str, ...] = ()
    transposed: tuple[str, ...] = ()
    norm_offset: float = 0.0
    norms: tuple[str, ...] = ()


def head_order(cfg: ModelConfig) -> torch.Tensor | None:
    """The row order that takes one head's rotated rows from our layout to Hugging Face's rotate-half (None:
    nothing to reorder -- no rope, or ours is rotate-half already)."""
    if cfg.position != "rope" or cfg.rope_layout == "rotate_half":
        return None
    d = cfg.d_head
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def _heads(t: torch.Tensor, order: torch.Tensor, d: int, inverse: bool) -> torch.Tensor:
    """``t``'s rows reordered head by head (``order`` within each head of ``d`` rows; ``inverse`` undoes it)."""
    if inverse:
        order = torch.argsort(order)
    return t.reshape(-1, d, *t.shape[1:])[:, order].reshape(t.shape)


def table(cfg: ModelConfig, own: Mapping[str, torch.Tensor], names: Names) -> Iterator[Entry | Fill]:
    """An :class:`Entry` for every tensor of ours in ``own`` (a state dict, real or on the meta device), and a
    :class:`Fill` for every tensor of theirs without a counterpart, for the model of ``cfg`` in the family
    ``names`` describes."""
    rows = {"q": cfg.n_head * cfg.d_head, "kv": cfg.kv_heads * cfg.d_head}
    modules = [(ours, theirs) for ours, theirs in names.top.items()]
    for i in range(cfg.n_layer):
        modules += [(f"blocks.{i}.{ours}", tuple(f"{names.prefix.format(i=i)}.{t}" for t in _tuple(theirs)))
                    for ours, theirs in names.block.items()]
    for ours, theirs in modules:
        theirs = _tuple(theirs)
        for kind in ("weight", "bias"):
            key = f"{ours}.{kind}"
            if cfg.tie_weights and key == "fc_layer.weight":
                continue  # the embedding's; a tied class stores no lm_head
            has_theirs = kind == "weight" or all(names.bias(t) for t in theirs)
            if key not in own:
                if not has_theirs or (kind == "weight" and not ours.endswith(names.gains)):
                    continue  # (a module neither has, or ours ties it: fc_layer to we)
                value = 1.0 - _offset(names, ours) if kind == "weight" else 0.0
                for name, n, _ in _parts(theirs, rows, cfg, own, ours):
                    yield Fill(f"{name}.{kind}", (n,), value)
                continue
            if not has_theirs:
                yield Entry(key, ())
                continue
            t = own[key]
            parts = tuple((f"{name}.{kind}", n if len(theirs) > 1 else t.shape[0], rope)
                          for name, n, rope in _parts(theirs, rows, cfg, own, ours))
            yield Entry(key, parts, transpose=kind == "weight" and any(t_.endswith(names.transposed) for t_ in theirs),
                        offset=_offset(names, ours) if kind == "weight" else 0.0)


def _offset(names: Names, ours: str) -> float:
    return names.norm_offset if names.norms and ours.endswith(names.norms) else 0.0


def _tuple(x) -> tuple[str, ...]:
    return x if isinstance(x, tuple) else (x,)


def _parts(theirs: tuple[str, ...], rows: dict, cfg: ModelConfig, own, ours: str):
    """(name, rows, rope) of each module of theirs making our module ``ours``: three for q, k, v, else one (its
    rows from our weight; ``rope`` for the QK-norm gains, whose d_head entries are one head's rows)."""
    if len(theirs) == 3:
        return [(theirs[0], rows["q"], True), (theirs[1], rows["kv"], True), (theirs[2], rows["kv"], False)]
    weight = own.get(f"{ours}.weight")
    n = weight.shape[0] if weight is not None else cfg.d_head
    return [(theirs[0], n, ours.endswith(("q_norm", "k_norm")))]


# ----------------------------------------------------------------------------------------------------------
# In: the files -> our state dict
# ----------------------------------------------------------------------------------------------------------


def read_state(files: WeightFiles, entries: list[Entry | Fill], own: Mapping[str, torch.Tensor], cfg: ModelConfig,
               lookup: Mapping[str, str], *, config_file: str) -> dict[str, torch.Tensor]:
    """Fill our tensors ``own`` (a model's state dict, allocated in its dtype and device) from ``files``: each
    entry's parts checked against the shape ``cfg`` gives them and copied into its place once (the file's pages
    then let go). ``lookup``: each name of the family's table -> the name as stored. Returns ``own``'s filled
    tensors by name.

    Raises:
        ValueError: a missing or mis-shaped tensor, naming the file, the tensor and the shape ``config_file``
            gives it.
    """
    order = head_order(cfg)
    state = {}
    for e in entries:
        if isinstance(e, Fill):
            continue
        out = own[e.ours]
        shape = tuple(out.shape)
        if not e.parts:
            state[e.ours] = out.zero_()
            continue
        at = 0
        for name, n, rope in e.parts:
            want = (n, *shape[1:])
            stored = lookup.get(name)
            if stored is None:
                raise ValueError(f"{files.where()}: missing tensor {name!r} (shape {_theirs_shape(want, e)}), which "
                                 f"{config_file} says the model has")
            got = files.shape(stored)
            if got != _theirs_shape(want, e):
                raise ValueError(f"{files.where(stored)}: tensor {stored!r} has shape {got}, but {config_file} gives "
                                 f"it {_theirs_shape(want, e)}; allowed: the shapes config.json's sizes make")
            v = files.view(stored)
            v = v.t() if e.transpose else v
            if rope and order is not None:
                v = _heads(v, order, cfg.d_head, inverse=True)
            if e.offset:  # (in float32, as the class adds it at run time, then into our dtype)
                v = v.float() + e.offset
            out[at:at + n].copy_(v)
            files.release(stored)
            at += n
        state[e.ours] = out
    return state


def _theirs_shape(ours_shape: tuple[int, ...], e: Entry) -> tuple[int, ...]:
    return tuple(reversed(ours_shape)) if e.transpose else tuple(ours_shape)


def stored_names(files: WeightFiles, prefix: str, ignored: re.Pattern | None) -> tuple[dict[str, str], list[str]]:
    """(canonical name -> stored name, stored names that are not weights): stored names without wrapper
    prefixes (``module.``, ``_orig_mod.``), and with the base model's ``prefix`` when a bare base model's
    state dict lacks it (``transformer.`` of GPT-2, ``model.`` of Llama's); ``ignored`` matches the stored
    buffers that are no weights (rotary ``inv_freq``, GPT-2's causal masks)."""
    lookup: dict[str, str] = {}
    skipped = []
    for stored in files.names():
        name = stored
        while name.startswith(("module.", "_orig_mod.")):
            name = name.split(".", 1)[1]
        if not name.startswith(prefix) and not name.startswith("lm_head."):
            name = prefix + name
        if ignored is not None and ignored.search(name):
            skipped.append(stored)
            continue
        if name in lookup:
            raise ValueError(f"{files.where(stored)}: tensor {name!r} is stored twice (as {lookup[name]!r} and "
                             f"{stored!r})")
        lookup[name] = stored
    return lookup, skipped


# ----------------------------------------------------------------------------------------------------------
# Out: our state dict -> their tensors
# ----------------------------------------------------------------------------------------------------------


def write_state(state: Mapping[str, torch.Tensor], entries: list[Entry | Fill], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors (name -> a tensor of its own) of our ``state`` dict, by ``entries``.

    Raises:
        ValueError: a tensor of ours the class has no place for that is not zero (a config mapping that
            chose the wrong class: a guard, named).
    """
    order = head_order(cfg)
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        if isinstance(e, Fill):
            dtype = state["we.weight"].dtype
            out[e.theirs] = torch.full(e.shape, e.value, dtype=dtype)
            continue
        t = state[e.ours].detach()
        if not e.parts:
            if torch.count_nonzero(t):
                raise ValueError(f"{e.ours} is not zero, and the Hugging Face class has no such tensor; allowed: a "
                                 f"zero {e.ours.rsplit('.', 2)[-2]} {e.ours.rsplit('.', 1)[-1]} (or a model without "
                                 "bias)")
            continue
        at = 0
        for name, n, rope in e.parts:
            part = t[at:at + n]
            if rope and order is not None:
                part = _heads(part, order, cfg.d_head, inverse=False)
            if e.offset:
                part = (part.float() - e.offset).to(part.dtype)
            out[name] = (part.t() if e.transpose else part).contiguous().clone()
            at += n
    return out


def center_writes(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A model with LayerNorm (no bias) as the same function with RMSNorm: every tensor that writes into the
    residual stream (the word and position embeddings, each block's attention and MLP output projections) made
    mean-free along d_model, so the stream is mean-free everywhere and LayerNorm's centring is the identity --
    LayerNorm(x) = RMSNorm(x) with the same gain. The output layer keeps the embedding as it was (so a tied
    model comes out untied). TransformerLens's ``center_writing_weights``.

    Returns (the config with norm="rmsnorm" and tie_weights=False, the new state dict); ``state`` is not changed.
    """
    out = dict(state)
    out["fc_layer.weight"] = state["fc_layer.weight"]
    out["we.weight"] = state["we.weight"] - state["we.weight"].mean(1, keepdim=True)
    if "pe.weight" in state:
        out["pe.weight"] = state["pe.weight"] - state["pe.weight"].mean(1, keepdim=True)
    for key, t in state.items():
        if key.endswith(("attention.proj.weight", "mlp.proj.weight")):
            out[key] = t - t.mean(0, keepdim=True)
        elif key.endswith(("attention.proj.bias", "mlp.proj.bias")):
            out[key] = t - t.mean()
    return cfg.replace(norm="rmsnorm", tie_weights=False), out


# ----------------------------------------------------------------------------------------------------------
# The config of the rotary families (Llama, Mistral, Qwen, Apertus, Arcee): what they share
# ----------------------------------------------------------------------------------------------------------

_SIZES = (("num_tokens", "vocab_size"), ("d_model", "hidden_size"), ("n_layer", "num_hidden_layers"),
          ("n_head", "num_attention_heads"), ("max_len", "max_position_embeddings"), ("d_ff", "intermediate_size"))


def rotary_config(hf: dict, where: str, *, default_theta: float = 10000.0, tied: bool = False) -> dict:
    """The ``ModelConfig`` fields a rotary family's config.json gives: the sizes, grouped-query heads
    (``num_key_value_heads``), ``head_dim``, ``rms_norm_eps``, ``tie_word_embeddings`` (the class's default
    ``tied`` when absent), and the rotary base, for rope of the plain kind (rotate-half, every dim of a head).

    Raises:
        ConfigError: a missing or non-integer size; rope settings (:func:`rope_block`: ``rope_scaling`` over
            ``rope_parameters``) of a kind other than "default" (linear, dynamic, yarn, llama3, longrope are not
            implemented); a partial rotary factor.
    """
    fields: dict = {}
    for ours, theirs in _SIZES:
        value = hf.get(theirs)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{where}: {theirs} is {value!r}; allowed: a positive integer ({ours})", theirs)
        fields[ours] = value
    kv = hf.get("num_key_value_heads") or fields["n_head"]
    head_dim = hf.get("head_dim") or fields["d_model"] // fields["n_head"]
    key, rope = rope_block(hf, where)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        over = " (read over rope_parameters, as transformers does)" if key == "rope_scaling" and hf.get(
            "rope_parameters") else ""
        raise ConfigError(f"{where}: {key} of rope_type {kind!r}{over} is not implemented; allowed: rope_type "
                          "'default' (or no rope_scaling): plain rotary positions", key)
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"{where}: partial_rotary_factor {partial!r} is not implemented; allowed: 1.0 (rope on "
                          "every dim of a head)", "partial_rotary_factor")
    theta = rope.get("rope_theta", hf.get("rope_theta", default_theta))
    return dict(fields, n_kv_head=0 if kv == fields["n_head"] else kv,
                head_dim=0 if head_dim * fields["n_head"] == fields["d_model"] else head_dim,
                norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
                tie_weights=bool(hf.get("tie_word_embeddings", tied)), position="rope", rope_layout="rotate_half",
                norm="rmsnorm", attention="sdpa", attn_out_proj=True, lm_head_bias=False, dropout=0.0,
                init="default")


def rope_block(hf: dict, where: str) -> tuple[str, dict]:
    """``(key, block)`` of the rope settings transformers reads from a config.json: the legacy ``rope_scaling``
    whenever it holds anything, else ``rope_parameters`` ({} for neither). transformers 5 takes
    ``rope_scaling or rope_parameters`` (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict``), so a YaRN
    block added under the old key overrides a plain ``rope_parameters``; the block's missing ``rope_theta`` then
    comes from the top-level ``rope_theta`` or the class's default, never from the block it replaced.

    Raises:
        ConfigError: the chosen block is not a JSON object.
    """
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(key) or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: {key} {rope!r} is not a JSON object; allowed: null or "
                          "{\"rope_type\": \"default\", \"rope_theta\": ...}", key)
    return key, rope


def window_of(hf: dict, default: int | None, where: str) -> int | None:
    """config.json's ``sliding_window`` (``default``, the class's, when the key is absent; null: none).

    Raises:
        ConfigError: a value that is neither null nor a positive integer.
    """
    window = hf.get("sliding_window", default)
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ConfigError(f"{where}: sliding_window is {window!r}; allowed: null or a positive integer",
                          "sliding_window")
    return window


def layer_list(layers: list[int]) -> str:
    """``layers`` as "layer 3" / "layers 0-27" / "layers 0, 2-5" (runs of consecutive indices joined)."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    text = ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
    return f"layer {text}" if len(layers) == 1 else f"layers {text}"


def rotary_theirs(cfg: ModelConfig, architecture: str, model_type: str) -> dict:
    """The config.json fields every rotary family writes for ``cfg`` (sizes, heads, rope, eps, tying)."""
    return dict(architectures=[architecture], model_type=model_type, vocab_size=cfg.num_tokens,
                hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                num_key_value_heads=cfg.kv_heads, head_dim=cfg.d_head, intermediate_size=cfg.ff_size,
                max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps,
                rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                tie_word_embeddings=cfg.tie_weights, attention_dropout=0.0)


def rotary_mismatches(cfg: ModelConfig, mlp, class_name: str) -> list[tuple[str, object, object, str]]:
    """(field, value, needed, why) of what a rotary class cannot carry: positions other than rope, a norm other
    than RMSNorm (or LayerNorm without a bias, carried by :func:`center_writes`), another MLP, no attention output
    projection, a bias in the LM head."""
    want = [("position", "rope", f"{class_name} has rotary positions"),
            ("mlp", mlp, f"{class_name}'s MLP is {mlp if isinstance(mlp, str) else ' or '.join(mlp)}"),
            ("attn_out_proj", True, f"{class_name} attention has an output projection (o_proj)"),
            ("lm_head_bias", False, f"{class_name}'s lm_head has no bias")]
    out = [(f, getattr(cfg, f), v, why) for f, v, why in want
           if getattr(cfg, f) not in (v if isinstance(v, tuple) else (v,))]
    out += plain_faults(cfg, class_name)
    if cfg.norm != "rmsnorm" and not (cfg.norm == "layernorm" and not cfg.bias):
        out.append(("norm", cfg.norm, "rmsnorm", f"{class_name} uses RMSNorm (a LayerNorm without a bias is carried "
                                                  "too: its centring is folded into the weights)"))
    return out


def plain_faults(cfg: ModelConfig, class_name: str, *, windows: bool = False) -> list[tuple[str, object, object, str]]:
    """(field, value, needed, why) of Gemma's options a class without them cannot carry: norms after attention
    and the MLP, a scaled embedding, another attention scale, a rotary base of the sliding layers -- and sliding
    windows unless ``windows`` (the class has them)."""
    out = []
    for field, plain, what in (("sandwich_norm", False, "norms after attention and the MLP"),
                               ("embed_scale", False, "an embedding scaled by sqrt(d_model)")):
        if getattr(cfg, field) != plain:
            out.append((field, getattr(cfg, field), plain, f"{class_name} has no {what}"))
    if cfg.query_pre_attn_scalar not in (0, cfg.d_head):
        out.append(("query_pre_attn_scalar", cfg.query_pre_attn_scalar, 0,
                    f"{class_name} scales attention scores by 1 / sqrt(head_dim)"))
    if cfg.rope_local_theta not in (0, cfg.rope_theta):
        out.append(("rope_local_theta", cfg.rope_local_theta, 0, f"{class_name} has one rotary base"))
    if cfg.sliding_window and not windows and any(cfg.window_of(i) for i in range(cfg.n_layer)):
        out.append(("sliding_window", cfg.sliding_window, 0, f"{class_name} has no sliding window"))
    return out


def prepare_norm(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """For a rotary class (RMSNorm): a LayerNorm model's weights centred (:func:`center_writes`); else as is."""
    return center_writes(cfg, state) if cfg.norm == "layernorm" else (cfg, state)
