"""One GGUF file for llama.cpp and ollama, written with the ``gguf`` package (``pip install 'decoderlab[gguf]'``):
the model in the llama.cpp architecture that computes exactly what it computes, its tokenizer
(:mod:`.gguf_tokenizer`), its chat template (``tokenizer.chat_template``), in f32, f16, q8_0, q4_0 or q4_1; an
ollama ``Modelfile`` beside it (:mod:`.modelfile`).

Architectures (:func:`decoderlab.export.shape.gguf_architecture`; anything else is refused naming the field, before
a file is written):

* ``gpt2``: GPT-2's shape (``decoderlab.config.names.GPT2_SHAPE``: learned positions, LayerNorm, GELU);
* ``llama``: rotary positions, RMSNorm, SwiGLU, grouped-query attention, no biases;
* ``qwen2``: llama's shape with biases on q/k/v only (``qkv_bias``);
* ``qwen3``: llama's shape with an RMS norm on each head's queries and keys (``qk_norm``; without a learned gain
  it is written as a gain of ones, the same numbers).

Tensor mapping (ours -> GGUF; the ``gguf`` writer stores a (rows, cols) array as ggml's (cols, rows), and our
``nn.Linear`` weights are already (out, in), the layout llama.cpp multiplies with)::

    we.weight                       (num_tokens, d_model)   -> token_embd.weight
    pe.weight                       (max_len, d_model)      -> position_embd.weight         (gpt2; always f32)
    blocks.{i}.norm_1.*             (d_model,)              -> blk.{i}.attn_norm.*          (f32)
    blocks.{i}.attention.qkv.*      (3 d_model, d_model)    -> blk.{i}.attn_qkv.*           (gpt2)
    blocks.{i}.attention.qkv.*      rows [q | k | v]        -> blk.{i}.attn_q / attn_k / attn_v.*  (the others)
    blocks.{i}.attention.q_norm/k_norm.weight (d_head,)     -> blk.{i}.attn_q_norm / attn_k_norm.weight (qwen3)
    blocks.{i}.attention.proj.*                             -> blk.{i}.attn_output.*
    blocks.{i}.norm_2.*                                     -> blk.{i}.ffn_norm.*           (f32)
    blocks.{i}.mlp.gate.weight      (d_ff, d_model)         -> blk.{i}.ffn_gate.weight      (SwiGLU)
    blocks.{i}.mlp.fc.*             (d_ff, d_model)         -> blk.{i}.ffn_up.*
    blocks.{i}.mlp.proj.*           (d_model, d_ff)         -> blk.{i}.ffn_down.*
    norm_f.*                                                -> output_norm.*                (f32)
    fc_layer.weight (untied only)   (num_tokens, d_model)   -> output.weight (tied: llama.cpp reuses token_embd)

Query and key rows follow the architecture's rotary layout: llama's is ggml's interleaved pairs (x[2i], x[2i+1])
-- a rotate-half model's rows are permuted as llama.cpp's converter permutes Hugging Face's --, qwen2's and
qwen3's is rotate-half (NEOX) -- an interleaved model's rows are permuted the other way. Norms, biases and the
position table stay float32 as llama.cpp's converter keeps them; the other matrices take ``dtype`` (q8_0, q4_0,
q4_1: blocks of 32 weights with a float16 scale, :mod:`decoderlab.quant`, the bytes llama.cpp's reference
quantizers write; a matrix whose rows are not a multiple of 32 is written as f16, as the converter does). A
model already holding blocks of ``dtype`` (loaded with ``--dtype q4_1``) writes them as they are, rows moved
whole, not quantized again. GPT-2's missing biases (``bias=False``) are written as zeros. LoRA adapters are
merged first; a weight outside what ``dtype``'s float16 numbers hold is refused, naming the tensor.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ..config.names import BLOCK_DTYPES, GGUF_DTYPES
from ..quant import GGML_TYPES, BlockWeight, is_block_layer
from .shape import gguf_architecture

_INSTALL_HINT = "pip install 'decoderlab[gguf]'"
_GPT2_BLOCK = (("norm_1", "attn_norm"), ("attention.qkv", "attn_qkv"), ("attention.proj", "attn_output"),
               ("norm_2", "ffn_norm"), ("mlp.fc", "ffn_up"), ("mlp.proj", "ffn_down"))
_FLOAT16_MAX = 65504.0
#: the largest |weight| each type holds, in float16's largest numbers: f16 itself; q8_0's scale is max / 127,
#: q4_0's max / 8; q4_1 keeps each block's minimum as a float16
_HEADROOM = {"f16": 1, "q8_0": 127, "q4_0": 8, "q4_1": 1}


def require_gguf():
    """The ``gguf`` package, or ``ImportError`` saying how to install it."""
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"GGUF export needs the gguf package; install it with: {_INSTALL_HINT}") from e
    return gguf


def _array(t: torch.Tensor | None, like: int = 0) -> np.ndarray:
    if t is None:
        return np.zeros(like, dtype=np.float32)
    if is_block_layer(t):  # a block layer: its blocks, written as they are where dtype is theirs
        return t.blocks
    return t.detach().to(device="cpu", dtype=torch.float32).numpy().copy()


def _pair(module, name: str, ours: str, matrix: bool, zero_bias: bool) -> list[tuple[str, np.ndarray, bool, str]]:
    """A layer's weight (a block-quantized layer's dequantized: decoderlab.quant) and bias (zeros where the
    architecture has one and the model none) as ``name.weight`` / ``name.bias``."""
    w = module if is_block_layer(module) else module.weight
    out = [(f"{name}.weight", _array(w), matrix, f"{ours}.weight")]
    bias = getattr(module, "bias", None)
    if bias is not None or zero_bias:
        rows = module.blocks.shape[0] if is_block_layer(module) else w.shape[0]
        out.append((f"{name}.bias", _array(bias, rows), False, f"{ours}.bias"))
    return out


def _rows(rows, n_head: int, to_interleaved: bool):
    """A query/key projection's rows (float rows, a bias, or a BlockWeight's rows of blocks) between
    rotate-half and interleaved head layouts."""
    from ..gguf_import.weights import unpermute

    index = np.arange(rows.shape[0])
    if not to_interleaved:
        index = unpermute(index, n_head)  # interleaved -> rotate-half
    else:
        index = index.reshape(n_head, 2, -1).swapaxes(1, 2).reshape(-1)
    return rows.rows(torch.from_numpy(index)) if isinstance(rows, BlockWeight) else rows[index]


def _split(rows, cuts: list[int]) -> list:
    """Rows [0, a), [a, b), [b, end) of a float array or a BlockWeight."""
    if isinstance(rows, BlockWeight):
        edges = [0, *cuts, rows.shape[0]]
        return [rows.rows(slice(a, b)) for a, b in zip(edges, edges[1:])]
    return np.split(rows, cuts)


def gguf_tensors(model, arch: str) -> list[tuple[str, np.ndarray, bool, str]]:
    """``(GGUF name, float32 array, takes the weight dtype, our name)`` for every tensor of ``model`` written as
    ``arch``, in llama.cpp's order (module docstring). Arrays are (rows, cols) as ours."""
    cfg = model.config
    out = [("token_embd.weight", _array(model.we if is_block_layer(model.we) else model.we.weight), True,
            "we.weight")]
    if arch == "gpt2":
        out.append(("position_embd.weight", _array(model.pe.weight), False, "pe.weight"))
    for i, block in enumerate(model.blocks):
        if arch == "gpt2":
            for ours, theirs in _GPT2_BLOCK:
                out += _pair(block.get_submodule(ours), f"blk.{i}.{theirs}", f"blocks.{i}.{ours}",
                             not theirs.endswith("norm"), True)
        else:
            out += _llama_block(block, i, cfg, arch)
    out += _pair(model.norm_f, "output_norm", "norm_f", False, arch == "gpt2")
    if not cfg.tie_weights:
        head = model.fc_layer
        out.append(("output.weight", _array(head if is_block_layer(head) else head.weight), True, "fc_layer.weight"))
    return out


def _llama_block(block, i: int, cfg, arch: str) -> list[tuple[str, np.ndarray, bool, str]]:
    h, kv, dh = cfg.n_head, cfg.kv_heads, cfg.d_head
    att, b, ours = block.attention, f"blk.{i}", f"blocks.{i}"
    qkv = {"weight": _array(att.qkv if is_block_layer(att.qkv) else att.qkv.weight)}
    if cfg.qkv_bias:
        qkv["bias"] = _array(att.qkv.bias)
    out = _pair(block.norm_1, f"{b}.attn_norm", f"{ours}.norm_1", False, False)
    interleaved = cfg.rope_layout == "interleaved"
    for param, rows in qkv.items():
        q, k, v = _split(rows, [h * dh, (h + kv) * dh])
        if interleaved != (arch == "llama"):  # the file's layout is not the model's
            q, k = _rows(q, h, arch == "llama"), _rows(k, kv, arch == "llama")
        for part, which in ((q, "q"), (k, "k"), (v, "v")):
            out.append((f"{b}.attn_{which}.{param}", part, param == "weight",
                        f"{ours}.attention.qkv.{param} ({which} rows)"))
    if cfg.qk_norm:
        for which in ("q", "k"):
            norm = getattr(att, f"{which}_norm", None)
            gain = _array(norm.weight) if norm is not None and cfg.qk_norm_gain else np.ones(dh, np.float32)
            out.append((f"{b}.attn_{which}_norm.weight", gain, False, f"{ours}.attention.{which}_norm.weight"))
    out += _pair(att.proj, f"{b}.attn_output", f"{ours}.attention.proj", True, False)
    out += _pair(block.norm_2, f"{b}.ffn_norm", f"{ours}.norm_2", False, False)
    for mine, theirs in (("gate", "ffn_gate"), ("fc", "ffn_up"), ("proj", "ffn_down")):
        out += _pair(getattr(block.mlp, mine), f"{b}.{theirs}", f"{ours}.mlp.{mine}", True, False)
    return out


def _encode(gguf, data, dtype: str, matrix: bool, name: str):
    """(array to write, its GGML type): ``dtype`` for a matrix, f32 otherwise; a block type where the rows allow
    (f16 else); ``data`` a float32 array or a :class:`~decoderlab.quant.BlockWeight` (written as it is when of
    type ``dtype``).

    Raises:
        ValueError: a value outside what ``dtype``'s float16 numbers hold (:data:`_HEADROOM`), naming the tensor.
    """
    q = gguf.GGMLQuantizationType
    if isinstance(data, BlockWeight):
        if data.kind == dtype:
            return data.to_gguf(), q(GGML_TYPES[dtype])
        data = data.dequantize().numpy()
    if not matrix or dtype == "f32":
        return data, q.F32
    blocks = dtype in BLOCK_DTYPES and data.shape[-1] % 32 == 0
    limit = _FLOAT16_MAX * (_HEADROOM[dtype] if blocks else 1)
    peak = float(np.abs(data).max()) if data.size else 0.0
    if not peak <= limit:
        room = f" x {_HEADROOM[dtype]} for a {dtype} scale" if limit > _FLOAT16_MAX else ""
        raise ValueError(f"tensor {name} holds {peak:g}, outside float16's range (+-{_FLOAT16_MAX:g}{room}): --dtype "
                         f"{dtype} cannot hold it; write it with --dtype f32")
    if blocks:
        return BlockWeight.quantize(torch.from_numpy(data), dtype).to_gguf(), q(GGML_TYPES[dtype])
    return data.astype(np.float16), q.F16


def to_gguf(model, tokenizer, path: str | os.PathLike, *, dtype: str = "f32", name: str | None = None,
            template=None, force: bool = False, modelfile: bool = True) -> dict:
    """Write ``model`` (LoRA adapters merged first), its ``tokenizer`` and chat ``template`` as one GGUF file at
    ``path`` (module docstring), and an ollama Modelfile beside it (``<path without .gguf>.Modelfile``, unless
    ``modelfile=False``). ``dtype``: "f32", "f16", "q8_0", "q4_0" or "q4_1". Both are written next to their place
    and renamed into it: a failure leaves nothing. Returns ``{"architecture", "bytes", "tensors", "types", "modelfile"}``.

    Raises:
        FileExistsError: ``path`` (or the Modelfile) exists and ``force`` is False.
        ValueError: a shape no llama.cpp architecture computes exactly (naming the field,
            :func:`gguf_architecture`); an unknown ``dtype``; a weight outside float16's range for f16 / q8_0
            (naming the tensor); a tokenizer the format cannot carry, or whose size is not the model's.
        FileNotFoundError: the directory of ``path`` does not exist (naming it).
        ImportError: the gguf package is not installed.
    """
    from ..hf import plain_model
    from .modelfile import modelfile_path, modelfile_text

    if dtype not in GGUF_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(GGUF_DTYPES)}, got {dtype!r}")
    model = plain_model(model)
    arch = gguf_architecture(model.config)
    if tokenizer.vocab_size != model.config.num_tokens:
        raise ValueError(f"tokenizer vocabulary size {tokenizer.vocab_size} does not match the model's num_tokens "
                         f"{model.config.num_tokens}")
    path = Path(path)
    if not path.parent.is_dir():  # (else the writer's error names its temporary file)
        raise FileNotFoundError(f"cannot write the GGUF file {path}: directory {path.parent} does not exist")
    side = modelfile_path(path) if modelfile else None
    for p in (path, side):
        if p is not None and p.exists() and not force:
            raise FileExistsError(f"refusing to replace {p}: it exists (--force, or force=True, replaces it)")
    gguf = require_gguf()
    chat_template = None if template is None else _chat_template_text(template, tokenizer)
    types = _write(gguf, model, tokenizer, path, arch, dtype, name, template, chat_template)
    if side is not None:
        from ..files import atomic_write_text

        atomic_write_text(side, modelfile_text(path, template, tokenizer, chat_template))
    return {"architecture": arch, "bytes": path.stat().st_size, "tensors": len(types), "types": types,
            "modelfile": None if side is None else str(side)}


def _chat_template_text(template, tokenizer) -> str:
    from ..chat.hf_templates import chat_template_jinja

    return chat_template_jinja(template, tokenizer)


def _write(gguf, model, tokenizer, path: Path, arch: str, dtype: str, name, template, chat_template) -> dict:
    """The GGUF file written next to ``path`` and renamed into place; the GGML type of each tensor by name."""
    from .gguf_tokenizer import write_tokenizer

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        _write_header(writer, gguf, model.config, arch, dtype, name or "decoderlab")
        write_tokenizer(writer, tokenizer, template, chat_template)
        types = {}
        for tname, data, matrix, ours in gguf_tensors(model, arch):
            arr, qtype = _encode(gguf, data, dtype, matrix, ours)
            writer.add_tensor(tname, arr, raw_dtype=qtype)
            types[tname] = qtype.name
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return types


def _write_header(writer, gguf, cfg, arch: str, dtype: str, name: str) -> None:
    file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                  "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                  "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}
    writer.add_name(name)
    writer.add_file_type(int(file_types[dtype]))
    if dtype in BLOCK_DTYPES:
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(cfg.max_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_feed_forward_length(cfg.ff_size)
    writer.add_block_count(cfg.n_layer)
    writer.add_head_count(cfg.n_head)
    if arch == "gpt2":
        writer.add_layer_norm_eps(float(cfg.norm_eps))
        return
    writer.add_head_count_kv(cfg.kv_heads)
    writer.add_layer_norm_rms_eps(float(cfg.norm_eps))
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_vocab_size(cfg.num_tokens)
    if arch == "llama":
        writer.add_rope_dimension_count(cfg.d_head)
    if cfg.d_head * cfg.n_head != cfg.d_model or arch == "qwen3":
        writer.add_key_length(cfg.d_head)
        writer.add_value_length(cfg.d_head)
