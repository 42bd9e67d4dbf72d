"""llama.cpp's ``gemma3`` architecture, both ways: Gemma 3's text model -- rotary positions (rotate-half, as written)
with a base per layer kind, five sliding-window layers to one full, norms before and after attention and the MLP,
a GELU-gated MLP, the embedding scaled by sqrt(d_model), per-head q/k RMSNorm with a gain, multi-query or
grouped-query attention with a head size of its own, no biases, the output layer tied when the file has no
``output.weight``.

What llama.cpp reads, and decoderlab with it (``gemma3.``): the shared sizes (:mod:`.architecture`),
``attention.head_count_kv``, ``attention.key_length`` (= ``value_length``), ``attention.layer_norm_rms_epsilon``,
``rope.freq_base`` (the full layers' base), ``attention.sliding_window``. What llama.cpp fixes rather than reads
(``llama_model::load_hparams``): every sixth layer full, the others sliding; the sliding layers' rotary base
10,000; the attention scale 1 / sqrt(key_length) -- 1 / sqrt(d_model / n_head) for the 62-layer 27B, as Gemma's
own config.py has it. decoderlab reads those the same way, and ``attention.sliding_window_pattern`` (a period, or
one flag per layer) and ``rope.freq_base_swa`` where a file states them. Gemma's RMSNorm gain 1 + weight is
stored as it is computed (the converter adds the 1), as decoderlab holds it.

Tensors, besides the shared ``token_embd`` / ``output_norm`` / ``output``: per block ``attn_norm``,
``attn_q`` / ``attn_k`` / ``attn_v`` (stacked into our one projection, rows as written), ``attn_q_norm`` /
``attn_k_norm`` (d_head,), ``attn_output``, ``post_attention_norm``, ``ffn_norm``, ``ffn_gate`` / ``ffn_up`` /
``ffn_down``, ``post_ffw_norm``.

A model is written as gemma3 when it computes what llama.cpp's gemma3 computes: Gemma's options, the layer
pattern llama.cpp fixes, the sliding layers' base 10,000, the attention scale it derives; anything else is
refused, naming the field.

Source: llama.cpp's ``convert_hf_to_gguf.py`` (``Gemma3Model``: ``set_gguf_parameters``, the norm shift),
``llama-model.cpp`` (``LLM_ARCH_GEMMA3``'s hyperparameters and graph), ``llama-arch.cpp`` (the tensor names).
"""

from __future__ import annotations

import numpy as np

from .metadata import number, positive
from .weights import array, layer_tensors, split_rows

ARCHITECTURES = ("gemma3",)
#: q, k and v are three tensors, stacked into our one projection when read
SPLIT_QKV = True
LEARNED_POSITIONS = NORM_BIAS = False
#: metadata keys that :mod:`.architecture` refuses for other architectures and gemma3 carries
CARRIED = ("attention.sliding_window",)
#: llama.cpp's fixed values for gemma3 (``llama_model::load_hparams``)
PATTERN, LOCAL_THETA = 6, 10_000.0
#: the layer count of Gemma 3 27B, whose attention scale llama.cpp takes from d_model / n_head
_LAYERS_27B = 62
#: the fields a model needs to be written as gemma3: (field, value, train option, why)
GEMMA3_SHAPE = (
    ("position", "rope", "--position", "llama.cpp's gemma3 has rotary positions"),
    ("rope_layout", "rotate_half", None, "its rotary pairs are rotate-half's (NEOX)"),
    ("norm", "rmsnorm", "--norm", "it uses RMSNorm"),
    ("mlp", "geglu", "--mlp", "its blocks have a GELU-gated MLP"),
    ("sandwich_norm", True, None, "it has norms before and after attention and the MLP"),
    ("embed_scale", True, None, "it scales the embedding by sqrt(d_model)"),
    ("qk_norm", True, None, "it normalises each head's queries and keys"),
    ("bias", False, "--bias", "it has no biases"),
    ("qkv_bias", False, None, "it has no q/k/v biases"),
    ("attn_out_proj", True, None, "its attention has an output projection"),
    ("lm_head_bias", False, None, "its output layer has no bias"),
)


def layer_types(meta: dict, arch: str, n_layer: int, path="") -> tuple:
    """Each layer's type: ``attention.sliding_window_pattern`` where the file states it (a period: every
    period-th layer full; or a flag per layer, true = sliding), else llama.cpp's fixed period of 6.

    Raises:
        ValueError: a pattern that is neither a positive integer nor one flag per layer."""
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", PATTERN)
    if isinstance(pattern, list) and len(pattern) == n_layer and all(isinstance(p, bool) for p in pattern):
        slides = pattern
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
        slides = [bool((i + 1) % pattern) for i in range(n_layer)]
    else:
        raise ValueError(f"{path}: GGUF metadata {arch}.attention.sliding_window_pattern is {pattern!r:.80}; allowed: "
                         f"a positive integer, or {n_layer} flags (one per layer)")
    return tuple("sliding_attention" if s else "full_attention" for s in slides)


def fields(meta: dict, arch: str, common: dict, names, path="") -> dict:
    """The ModelConfig fields of a gemma3 file besides the shared sizes (``common``), as llama.cpp reads them
    (module docstring).

    Raises:
        ValueError: no sliding window (llama.cpp requires one); a head count not a multiple of the key/value
            head count; a value length other than the key length -- each naming the key."""
    d_model, n_head, n_layer = common["d_model"], common["n_head"], common["n_layer"]
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
    window = positive(meta, arch, "attention.sliding_window", path)
    types = layer_types(meta, arch, n_layer, path)
    scalar = d_model // n_head if n_layer == _LAYERS_27B else head_dim
    return dict(n_kv_head=n_kv_head, head_dim=0 if head_dim * n_head == d_model else head_dim,
                norm="rmsnorm", position="rope", rope_layout="rotate_half",
                rope_theta=float(number(meta, arch, "rope.freq_base", 1_000_000.0, path=path)),
                rope_local_theta=float(number(meta, arch, "rope.freq_base_swa", LOCAL_THETA, path=path)),
                norm_eps=float(number(meta, arch, "attention.layer_norm_rms_epsilon", 1e-6, path=path)),
                mlp="geglu", bias=False, qkv_bias=False, qk_norm=True, qk_norm_gain=True, sandwich_norm=True,
                embed_scale=True, query_pre_attn_scalar=float(scalar), sliding_window=window,
                layer_types=types if "sliding_attention" in types else (), attn_out_proj=True, lm_head_bias=False)


def block_shapes(arch: str, fields: dict) -> dict[str, tuple[int, ...]]:
    """A block's tensors (llama.cpp's name after ``blk.{i}.`` -> logical shape)."""
    d, f, h, kv = fields["d_model"], fields["d_ff"], fields["n_head"], fields["n_kv_head"]
    dh = fields["head_dim"] or d // h
    return {"attn_norm.weight": (d,), "attn_q.weight": (h * dh, d), "attn_k.weight": (kv * dh, d),
            "attn_v.weight": (kv * dh, d), "attn_q_norm.weight": (dh,), "attn_k_norm.weight": (dh,),
            "attn_output.weight": (d, h * dh), "post_attention_norm.weight": (d,), "ffn_norm.weight": (d,),
            "ffn_gate.weight": (f, d), "ffn_up.weight": (f, d), "ffn_down.weight": (d, f),
            "post_ffw_norm.weight": (d,)}


def qkv_orders(arch: str, fields: dict) -> list:
    """q, k and v rows as written (the converter does not permute Gemma's)."""
    return [None] * 3


def block_tensors(block, i: int, cfg, arch: str) -> list[tuple]:
    """Block ``i``'s tensors as the writer takes them (:func:`~.weights.layer_tensors`): q, k and v cut from our
    one projection; a QK-norm without a gain written with gains of ones."""
    from ..quant import is_block_layer

    att, b, ours = block.attention, f"blk.{i}", f"blocks.{i}"
    out = layer_tensors(block.norm_1, f"{b}.attn_norm", f"{ours}.norm_1", False, False)
    rows = array(att.qkv if is_block_layer(att.qkv) else att.qkv.weight)
    h, kv, dh = cfg.n_head, cfg.kv_heads, cfg.d_head
    for part, which in zip(split_rows(rows, [h * dh, (h + kv) * dh]), "qkv"):
        out.append((f"{b}.attn_{which}.weight", part, True, f"{ours}.attention.qkv.weight ({which} rows)"))
    for which in ("q", "k"):
        norm = getattr(att, f"{which}_norm", None)
        gain = array(norm.weight) if norm is not None else np.ones(dh, np.float32)
        out.append((f"{b}.attn_{which}_norm.weight", gain, False, f"{ours}.attention.{which}_norm.weight"))
    out += layer_tensors(att.proj, f"{b}.attn_output", f"{ours}.attention.proj", True, False)
    out += layer_tensors(block.norm_1_post, f"{b}.post_attention_norm", f"{ours}.norm_1_post", False, False)
    out += layer_tensors(block.norm_2, f"{b}.ffn_norm", f"{ours}.norm_2", False, False)
    for mine, theirs in (("gate", "ffn_gate"), ("fc", "ffn_up"), ("proj", "ffn_down")):
        out += layer_tensors(getattr(block.mlp, mine), f"{b}.{theirs}", f"{ours}.mlp.{mine}", True, False)
    out += layer_tensors(block.norm_2_post, f"{b}.post_ffw_norm", f"{ours}.norm_2_post", False, False)
    return out


def write_header(writer, cfg, arch: str) -> None:
    """The metadata a gemma3 file has besides the shared sizes (what llama.cpp reads)."""
    writer.add_head_count_kv(cfg.kv_heads)
    writer.add_layer_norm_rms_eps(float(cfg.norm_eps))
    writer.add_key_length(cfg.d_head)
    writer.add_value_length(cfg.d_head)
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_sliding_window(int(cfg.sliding_window or cfg.max_len))
    writer.add_vocab_size(cfg.num_tokens)


# -- which models it computes -------------------------------------------------------------------------------------


def shape_faults(config) -> list[tuple]:
    """The rows of :data:`GEMMA3_SHAPE` (field, value, train option, why) where ``config`` differs, and what
    llama.cpp fixes rather than reads: the layer pattern, the sliding layers' base, the attention scale."""
    bad = [(f, v, opt, why) for f, v, opt, why in GEMMA3_SHAPE if getattr(config, f) != v]
    if bad:
        return bad
    n = config.n_layer
    fixed = tuple("sliding_attention" if (i + 1) % PATTERN else "full_attention" for i in range(n))
    types = tuple("sliding_attention" if config.window_of(i) else "full_attention" for i in range(n))
    if types != fixed:
        bad.append(("layer_types", list(fixed), None, "llama.cpp's gemma3 makes every sixth layer full and the "
                                                      "others sliding"))
    if "sliding_attention" in fixed and (config.rope_local_theta or config.rope_theta) != LOCAL_THETA:
        bad.append(("rope_local_theta", LOCAL_THETA, None, "llama.cpp's gemma3 turns its sliding layers with a "
                                                           "base of 10,000"))
    scalar = config.d_model // config.n_head if n == _LAYERS_27B else config.d_head
    if (config.query_pre_attn_scalar or config.d_head) != scalar:
        bad.append(("query_pre_attn_scalar", scalar, None, "llama.cpp's gemma3 scales attention by 1 / sqrt(head "
                                                           "size), or 1 / sqrt(d_model / n_head) for 62 layers"))
    return bad


def architecture(config) -> str:
    """The architecture of a model without :func:`shape_faults`."""
    return "gemma3"
