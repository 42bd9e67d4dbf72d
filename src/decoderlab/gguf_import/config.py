"""A GGUF file's metadata -> decoderlab's ``ModelConfig`` fields, and the tensors that shape has, by llama.cpp's
names and logical shapes: what every file is checked against before a weight is read.

llama.cpp's architectures carried (``general.architecture``), and the ModelConfig they become:

* ``llama``: RMSNorm, rotary positions in Hugging Face's rotate-half layout (llama.cpp's converter permuted the
  query and key rows into its interleaved layout; :mod:`.weights` undoes it), SwiGLU, grouped-query attention
  (``attention.head_count_kv``), no biases, the output layer tied when the file has no ``output.weight``;
* ``qwen2``: llama's shape with biases on the query, key and value projections, rotate-half as written;
* ``qwen3``: llama's shape with a learned RMSNorm gain on each head's queries and keys (``attn_q_norm`` /
  ``attn_k_norm``) and a head size of its own (``attention.key_length``);
* ``gpt2``: GPT-2's shape (learned positions, LayerNorm, GELU, biases).

Metadata read (``<arch>.`` prefix): ``context_length`` -> max_len, ``embedding_length`` -> d_model,
``block_count`` -> n_layer, ``feed_forward_length`` -> d_ff, ``attention.head_count`` -> n_head,
``attention.head_count_kv`` -> n_kv_head, ``attention.key_length`` -> head_dim, ``rope.freq_base`` -> rope_theta,
``attention.layer_norm_rms_epsilon`` / ``attention.layer_norm_epsilon`` -> norm_eps; ``tokenizer.ggml.tokens``'
length -> num_tokens. What the model class does not carry -- rotary scaling, partial rotary dimensions,
sliding windows, experts, an architecture not listed -- is refused, named.

Source: llama.cpp's ``llama-arch.cpp`` (the names) and ``convert_hf_to_gguf.py`` (what each key holds).
"""

from __future__ import annotations

#: llama.cpp's architectures decoderlab's model class carries (``general.architecture``)
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gpt2")
_LLAMA_FAMILY = ("llama", "qwen2", "qwen3")
#: metadata keys (after ``<arch>.``) naming a feature the model class does not carry, and what it is
_NOT_CARRIED = {
    "rope.scaling.type": "rotary position scaling",
    "rope.scaling.factor": "rotary position scaling",
    "attention.sliding_window": "sliding-window attention",
    "expert_count": "a mixture of experts",
    "attention.clamp_kqv": "clamped q/k/v",
    "logit_scale": "scaled logits",
    "attention.logit_softcapping": "soft-capped attention logits",
    "final_logit_softcapping": "soft-capped logits",
}


def _meta(meta: dict, arch: str, key: str, default=None, *, path=""):
    value = meta.get(f"{arch}.{key}", default)
    if value is None:
        raise ValueError(f"{path}: GGUF metadata {arch}.{key} is missing (a {arch} file states it)")
    if isinstance(value, (list, str, bool)):
        raise ValueError(f"{path}: GGUF metadata {arch}.{key} is {value!r}, not a number")
    return value


def _positive(meta, arch, key, path, default=None) -> int:
    value = _meta(meta, arch, key, default, path=path)
    if int(value) != value or value < 1:
        raise ValueError(f"{path}: GGUF metadata {arch}.{key} must be a positive integer, got {value!r}")
    return int(value)


def check_architecture(meta: dict, path="") -> str:
    """The file's ``general.architecture``, or ``ValueError`` naming it and those carried."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not one decoderlab's model carries; allowed: "
                         f"{', '.join(ARCHITECTURES)}")
    for key, what in _NOT_CARRIED.items():
        value = meta.get(f"{arch}.{key}")
        if value not in (None, 0, "none", 1.0):  # absent, or stated as off
            raise ValueError(f"{path}: GGUF metadata {arch}.{key} = {value!r} asks for {what}, which decoderlab's "
                             f"model does not carry")
    return arch


def model_fields(meta: dict, tensor_names, num_tokens: int, path="") -> dict:
    """The ``ModelConfig`` fields (a dict) of a file of a carried architecture.

    Args:
        meta: the file's metadata.  tensor_names: the names of its tensors (``output.weight`` absent = tied).
        num_tokens: the tokenizer's vocabulary size (``tokenizer.ggml.tokens``).

    Raises:
        ValueError: an architecture not carried (named, with those allowed); a missing or non-numeric size; a
            feature the model does not carry (partial rotary dimensions, rope scaling, ...), each naming the key.
    """
    arch = check_architecture(meta, path)
    names = set(tensor_names)
    d_model = _positive(meta, arch, "embedding_length", path)
    n_head = _positive(meta, arch, "attention.head_count", path)
    common = dict(num_tokens=num_tokens, d_model=d_model, n_layer=_positive(meta, arch, "block_count", path),
                  n_head=n_head, max_len=_positive(meta, arch, "context_length", path),
                  d_ff=_positive(meta, arch, "feed_forward_length", path), attention="sdpa",
                  tie_weights="output.weight" not in names, dropout=0.0)
    if arch == "gpt2":
        return dict(common, norm="layernorm", position="learned", mlp="gelu", bias=True, attn_out_proj=True,
                    lm_head_bias=False, init="gpt2",
                    norm_eps=float(_meta(meta, arch, "attention.layer_norm_epsilon", 1e-5, path=path)))
    n_kv_head = _positive(meta, arch, "attention.head_count_kv", path, default=n_head)
    if n_head % n_kv_head:
        raise ValueError(f"{path}: GGUF metadata {arch}.attention.head_count {n_head} is not a multiple of "
                         f"{arch}.attention.head_count_kv {n_kv_head}")
    head_dim = _positive(meta, arch, "attention.key_length", path, default=d_model // n_head)
    value_dim = _positive(meta, arch, "attention.value_length", path, default=head_dim)
    rope_dims = _positive(meta, arch, "rope.dimension_count", path, default=head_dim)
    if value_dim != head_dim or rope_dims != head_dim:
        what = "attention.value_length" if value_dim != head_dim else "rope.dimension_count"
        raise ValueError(f"{path}: GGUF metadata {arch}.{what} = {value_dim if value_dim != head_dim else rope_dims} "
                         f"differs from the head size {head_dim}; decoderlab's model rotates and values whole heads")
    return dict(common, n_kv_head=n_kv_head, head_dim=0 if head_dim * n_head == d_model else head_dim,
                norm="rmsnorm", position="rope", rope_layout="rotate_half",
                rope_theta=float(_meta(meta, arch, "rope.freq_base", 10000.0, path=path)),
                norm_eps=float(_meta(meta, arch, "attention.layer_norm_rms_epsilon", 1e-5, path=path)),
                mlp="swiglu", bias=False, qkv_bias=arch == "qwen2" or "blk.0.attn_q.bias" in names,
                qk_norm=arch == "qwen3", qk_norm_gain=arch == "qwen3", attn_out_proj=True, lm_head_bias=False)


def expected_shapes(arch: str, fields: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a file of ``arch`` with these ModelConfig ``fields`` has: llama.cpp's name -> logical shape
    (rows, cols), in llama.cpp's order."""
    d, v, f = fields["d_model"], fields["num_tokens"], fields["d_ff"]
    out = {"token_embd.weight": (v, d)}
    if arch == "gpt2":
        out["position_embd.weight"] = (fields["max_len"], d)
    for i in range(fields["n_layer"]):
        out.update({f"blk.{i}.{k}": s for k, s in _block(arch, fields, d, f).items()})
    out["output_norm.weight"] = (d,)
    if arch == "gpt2":
        out["output_norm.bias"] = (d,)
    if not fields["tie_weights"]:
        out["output.weight"] = (v, d)
    return out


def _block(arch: str, fields: dict, d: int, f: int) -> dict[str, tuple[int, ...]]:
    if arch == "gpt2":
        shapes = {"attn_norm": (d,), "attn_qkv": (3 * d, d), "attn_output": (d, d), "ffn_norm": (d,),
                  "ffn_up": (f, d), "ffn_down": (d, f)}
        return {f"{k}.{p}": (s if p == "weight" else s[:1]) for k, s in shapes.items() for p in ("weight", "bias")}
    h, kv = fields["n_head"], fields["n_kv_head"]
    dh = fields["head_dim"] or d // h
    out = {"attn_norm.weight": (d,), "attn_q.weight": (h * dh, d), "attn_k.weight": (kv * dh, d),
           "attn_v.weight": (kv * dh, d), "attn_output.weight": (d, h * dh), "ffn_norm.weight": (d,),
           "ffn_gate.weight": (f, d), "ffn_up.weight": (f, d), "ffn_down.weight": (d, f)}
    if fields["qkv_bias"]:
        out.update({"attn_q.bias": (h * dh,), "attn_k.bias": (kv * dh,), "attn_v.bias": (kv * dh,)})
    if fields["qk_norm_gain"]:
        out.update({"attn_q_norm.weight": (dh,), "attn_k_norm.weight": (dh,)})
    return out


def check_tensors(path, arch: str, fields: dict, shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise ``ValueError`` (one line) when the file's tensors (name -> logical shape) are not exactly those its
    metadata implies: a tensor missing, one the architecture does not have, or one of another shape -- each
    named, with the metadata that sets its shape."""
    want = expected_shapes(arch, fields)
    missing = [n for n in want if n not in shapes]
    extra = [n for n in shapes if n not in want]
    if missing:
        raise ValueError(f"{path}: tensor {missing[0]} is missing ({len(missing)} missing): the metadata says "
                         f"{fields['n_layer']} blocks of the {arch} architecture, {len(want)} tensors; the file has "
                         f"{len(shapes)}")
    if extra:
        raise ValueError(f"{path}: tensor {extra[0]} is not one of the {arch} architecture's tensors for this "
                         f"metadata ({fields['n_layer']} blocks); decoderlab's model has no place for it")
    for name, shape in want.items():
        if tuple(shapes[name]) != shape:
            raise ValueError(f"{path}: tensor {name} has shape {tuple(shapes[name])}, but the metadata (d_model "
                             f"{fields['d_model']}, {fields['n_head']} heads, d_ff {fields['d_ff']}, "
                             f"{fields['num_tokens']} tokens) says {shape}")
