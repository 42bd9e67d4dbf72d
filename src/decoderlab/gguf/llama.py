"""llama.cpp's ``llama``, ``qwen2`` and ``qwen3`` architectures, both ways: rotary positions, RMSNorm, a SwiGLU MLP,
grouped-query attention, no biases -- and what each adds (:data:`VARIANTS`):

* ``llama``: its query and key rows in ggml's interleaved rotary order (llama.cpp's converter permuted Hugging
  Face's rotate-half rows: undone when read, done when written), the output layer tied when the file has no
  ``output.weight``;
* ``qwen2``: biases on the query, key and value projections, rows in rotate-half (NEOX) order as written;
* ``qwen3``: a learned RMSNorm gain on each head's queries and keys (``attn_q_norm`` / ``attn_k_norm``; a model
  with a QK-norm but no gain is written with gains of ones, the same numbers) and a head size of its own
  (``attention.key_length``).

Metadata (``<arch>.``): the shared sizes (:mod:`.architecture`), ``attention.head_count_kv`` -> n_kv_head,
``attention.key_length`` -> head_dim, ``rope.freq_base`` -> rope_theta, ``attention.layer_norm_rms_epsilon`` ->
norm_eps; ``attention.value_length`` and ``rope.dimension_count`` other than the head size are refused.

Tensors, besides the shared ones: per block ``attn_norm``, ``attn_q`` / ``attn_k`` / ``attn_v`` (stacked into our
one q | k | v projection), ``attn_output``, ``ffn_norm``, ``ffn_gate`` / ``ffn_up`` / ``ffn_down``, and the
variant's biases and norms.

Source: llama.cpp's ``llama-arch.cpp`` (the names) and ``convert_hf_to_gguf.py`` (``LlamaModel.permute``,
``Qwen2Model``, ``Qwen3Model``).
"""

from __future__ import annotations

import numpy as np
import torch

from .metadata import number, positive
from .weights import array, layer_tensors, permute, reorder_rows, split_rows, unpermute

#: what each architecture of the family adds to the common shape: its q/k rows in ggml's interleaved order
#: (``interleaved``), q/k/v biases, a per-head q/k RMSNorm gain
VARIANTS = {
    "llama": dict(interleaved=True, qkv_bias=False, qk_norm=False),
    "qwen2": dict(interleaved=False, qkv_bias=True, qk_norm=False),
    "qwen3": dict(interleaved=False, qkv_bias=False, qk_norm=True),
}
ARCHITECTURES = tuple(VARIANTS)
#: q, k and v are three tensors, stacked into our one projection when read
SPLIT_QKV = True
LEARNED_POSITIONS = NORM_BIAS = False
#: the fields every llama-family architecture needs: (field, value, train option, why)
LLAMA_SHAPE = (
    ("position", "rope", "--position", "llama.cpp's llama, qwen2 and qwen3 have rotary positions"),
    ("norm", "rmsnorm", "--norm", "they use RMSNorm"),
    ("mlp", "swiglu", "--mlp", "their blocks have a SwiGLU MLP"),
    ("bias", False, "--bias", "they have no biases but qwen2's on q/k/v"),
    ("attn_out_proj", True, None, "they have an attention output projection"),
    ("lm_head_bias", False, None, "their output layer has no bias"),
    ("sandwich_norm", False, None, "they have no norms after attention and the MLP (gemma3 has)"),
    ("embed_scale", False, None, "they do not scale the embedding (gemma3 does)"),
    ("sliding_window", 0, None, "they attend to every earlier position (gemma3 has sliding windows)"),
    ("query_pre_attn_scalar", 0, None, "they scale attention scores by 1 / sqrt(d_head)"),
)


def fields(meta: dict, arch: str, common: dict, names, path="") -> dict:
    """The ModelConfig fields of a file of ``arch`` besides the shared sizes (``common``: d_model, n_head, ...);
    ``names``: its tensors' (a llama file with ``attn_q.bias`` has q/k/v biases).

    Raises:
        ValueError: a head count not a multiple of the key/value head count; a value length or rotary dimension
            count other than the head size -- naming the key.
    """
    d_model, n_head = common["d_model"], common["n_head"]
    n_kv_head = positive(meta, arch, "attention.head_count_kv", path, default=n_head)
    if n_head % n_kv_head:
        raise ValueError(f"{path}: GGUF metadata {arch}.attention.head_count {n_head} is not a multiple of "
                         f"{arch}.attention.head_count_kv {n_kv_head}")
    head_dim = positive(meta, arch, "attention.key_length", path, default=d_model // n_head)
    for key in ("attention.value_length", "rope.dimension_count"):
        value = positive(meta, arch, key, path, default=head_dim)
        if value != head_dim:
            raise ValueError(f"{path}: GGUF metadata {arch}.{key} = {value} differs from the head size {head_dim}; "
                             f"decoderlab's model rotates and values whole heads")
    variant = VARIANTS[arch]
    return dict(n_kv_head=n_kv_head, head_dim=0 if head_dim * n_head == d_model else head_dim,
                norm="rmsnorm", position="rope", rope_layout="rotate_half",
                rope_theta=float(number(meta, arch, "rope.freq_base", 10000.0, path=path)),
                norm_eps=float(number(meta, arch, "attention.layer_norm_rms_epsilon", 1e-5, path=path)),
                mlp="swiglu", bias=False, qkv_bias=variant["qkv_bias"] or "blk.0.attn_q.bias" in names,
                qk_norm=variant["qk_norm"], qk_norm_gain=variant["qk_norm"], attn_out_proj=True, lm_head_bias=False)


def block_shapes(arch: str, fields: dict) -> dict[str, tuple[int, ...]]:
    """A block's tensors (llama.cpp's name after ``blk.{i}.`` -> logical shape)."""
    d, f, h, kv = fields["d_model"], fields["d_ff"], fields["n_head"], fields["n_kv_head"]
    dh = fields["head_dim"] or d // h
    out = {"attn_norm.weight": (d,), "attn_q.weight": (h * dh, d), "attn_k.weight": (kv * dh, d),
           "attn_v.weight": (kv * dh, d), "attn_output.weight": (d, h * dh), "ffn_norm.weight": (d,),
           "ffn_gate.weight": (f, d), "ffn_up.weight": (f, d), "ffn_down.weight": (d, f)}
    if fields["qkv_bias"]:
        out.update({"attn_q.bias": (h * dh,), "attn_k.bias": (kv * dh,), "attn_v.bias": (kv * dh,)})
    if fields["qk_norm_gain"]:
        out.update({"attn_q_norm.weight": (dh,), "attn_k_norm.weight": (dh,)})
    return out


def qkv_orders(arch: str, fields: dict) -> list:
    """The row order of q, k and v in the model, from the file's (llama: the converter's permutation undone;
    None: as written)."""
    if not VARIANTS[arch]["interleaved"]:
        return [None] * 3
    dh = fields["head_dim"] or fields["d_model"] // fields["n_head"]
    return [torch.from_numpy(unpermute(np.arange(n * dh), n)) for n in (fields["n_head"], fields["n_kv_head"])] + [None]


def block_tensors(block, i: int, cfg, arch: str) -> list[tuple]:
    """Block ``i``'s tensors as the writer takes them (:func:`~.weights.layer_tensors`): q, k and v cut from our
    one projection, their rows in the architecture's rotary order."""
    att, b, ours = block.attention, f"blk.{i}", f"blocks.{i}"
    out = layer_tensors(block.norm_1, f"{b}.attn_norm", f"{ours}.norm_1", False, False)
    out += _qkv(att, b, ours, cfg, arch)
    if cfg.qk_norm:
        for which in ("q", "k"):
            norm = getattr(att, f"{which}_norm", None)
            gain = array(norm.weight) if norm is not None and cfg.qk_norm_gain else np.ones(cfg.d_head, np.float32)
            out.append((f"{b}.attn_{which}_norm.weight", gain, False, f"{ours}.attention.{which}_norm.weight"))
    out += layer_tensors(att.proj, f"{b}.attn_output", f"{ours}.attention.proj", True, False)
    out += layer_tensors(block.norm_2, f"{b}.ffn_norm", f"{ours}.norm_2", False, False)
    for mine, theirs in (("gate", "ffn_gate"), ("fc", "ffn_up"), ("proj", "ffn_down")):
        out += layer_tensors(getattr(block.mlp, mine), f"{b}.{theirs}", f"{ours}.mlp.{mine}", True, False)
    return out


def _qkv(att, b: str, ours: str, cfg, arch: str) -> list[tuple]:
    from ..quant import is_block_layer

    h, kv, dh = cfg.n_head, cfg.kv_heads, cfg.d_head
    qkv = {"weight": array(att.qkv if is_block_layer(att.qkv) else att.qkv.weight)}
    if cfg.qkv_bias:
        qkv["bias"] = array(att.qkv.bias)
    interleaved = VARIANTS[arch]["interleaved"]
    out = []
    for param, rows in qkv.items():
        q, k, v = split_rows(rows, [h * dh, (h + kv) * dh])
        if interleaved != (cfg.rope_layout == "interleaved"):  # the file's layout is not the model's
            order = permute if interleaved else unpermute
            q, k = (reorder_rows(x, order(np.arange(x.shape[0]), n)) for x, n in ((q, h), (k, kv)))
        for part, which in ((q, "q"), (k, "k"), (v, "v")):
            out.append((f"{b}.attn_{which}.{param}", part, param == "weight",
                        f"{ours}.attention.qkv.{param} ({which} rows)"))
    return out


def write_header(writer, cfg, arch: str) -> None:
    """The metadata a file of ``arch`` has besides the shared sizes."""
    writer.add_head_count_kv(cfg.kv_heads)
    writer.add_layer_norm_rms_eps(float(cfg.norm_eps))
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_vocab_size(cfg.num_tokens)
    if arch == "llama":
        writer.add_rope_dimension_count(cfg.d_head)
    if cfg.d_head * cfg.n_head != cfg.d_model or arch == "qwen3":
        writer.add_key_length(cfg.d_head)
        writer.add_value_length(cfg.d_head)


# -- which models it computes -------------------------------------------------------------------------------------


def shape_faults(config) -> list[tuple]:
    """The rows of :data:`LLAMA_SHAPE` (field, value, train option, why) where ``config`` differs, and a model with
    both q/k/v biases and a QK-norm (no architecture of the family has both)."""
    bad = [(f, v, opt, why) for f, v, opt, why in LLAMA_SHAPE if getattr(config, f) != v]
    if config.qkv_bias and config.qk_norm:
        bad.append(("qk_norm", False, None, "no llama.cpp architecture has both q/k/v biases (qwen2) and a "
                                            "query/key norm (qwen3)"))
    return bad


def architecture(config) -> str:
    """The architecture of the family that computes a model without :func:`shape_faults`: ``qwen3`` (a QK-norm),
    ``qwen2`` (q/k/v biases), else ``llama``."""
    return "qwen3" if config.qk_norm else "qwen2" if config.qkv_bias else "llama"
