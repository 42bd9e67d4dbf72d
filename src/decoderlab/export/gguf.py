"""One GGUF file for llama.cpp and ollama: a GPT-2-shaped model in llama.cpp's ``gpt2`` architecture, with its
tokenizer, in f32, f16, q8_0, q4_0 or q4_1, written with the ``gguf`` package (``pip install 'decoderlab[gguf]'``).

Tensor mapping (ours -> GGUF; the ``gguf`` writer stores a (rows, cols) array as ggml's (cols, rows), and our
``nn.Linear`` weights are already (out, in), the layout llama.cpp multiplies with)::

    we.weight                       (num_tokens, d_model)  -> token_embd.weight
    pe.weight                       (max_len, d_model)     -> position_embd.weight           (always f32)
    blocks.{i}.norm_1.weight/bias   (d_model,)             -> blk.{i}.attn_norm.weight/bias  (f32)
    blocks.{i}.attention.qkv.*      (3 d_model, d_model)   -> blk.{i}.attn_qkv.weight/bias
    blocks.{i}.attention.proj.*     (d_model, d_model)     -> blk.{i}.attn_output.weight/bias
    blocks.{i}.norm_2.weight/bias                          -> blk.{i}.ffn_norm.weight/bias   (f32)
    blocks.{i}.mlp.fc.*             (d_ff, d_model)        -> blk.{i}.ffn_up.weight/bias
    blocks.{i}.mlp.proj.*           (d_model, d_ff)        -> blk.{i}.ffn_down.weight/bias
    norm_f.weight/bias                                     -> output_norm.weight/bias        (f32)
    fc_layer.weight (untied only)   (num_tokens, d_model)  -> output.weight (tied: llama.cpp reuses token_embd)

Norms, biases and the position table stay float32 as llama.cpp's own converter keeps them; the other matrices
take ``dtype`` (q8_0, q4_0, q4_1: blocks of 32 weights with a float16 scale, :mod:`decoderlab.quant`, the bytes
llama.cpp's reference quantizers write; a matrix whose rows are not a multiple of 32 is written as f16, as the
converter does). A model already holding blocks of ``dtype`` (``--dtype q4_1``) writes them as they are, not
quantized again. Missing biases (``bias=False``) are written as zeros.

The tokenizer (``tokenizer.ggml.*``) is written in llama.cpp's byte-level BPE form (``model = "gpt2"``) with the
pre-tokenizer named (``pre = "gpt-2"``: GPT-2's split, which decoderlab's BPE uses), so llama.cpp reads it as it
is -- its own converter refuses a BPE whose hash it does not know, which every decoderlab-trained BPE is:
* a byte-level BPE: every token's bytes in the byte-level alphabet, its merges in order, control tokens
  (``<PAD>``, ``<EOS>``, a chat template's) typed CONTROL;
* a character vocabulary: the same form with one token per character and merges that join the UTF-8 bytes of
  each multi-byte character (so "é" is one token, as in decoderlab); text holding a character outside the
  vocabulary loses it in llama.cpp, where decoderlab raises (or gives ``<unk>``);
* a word vocabulary has no form llama.cpp reads: refused.
``<EOS>`` is the end of text (``eos_token_id``, and ``bos_token_id``, which llama.cpp does not add), ``<PAD>`` the
padding, a chat template's first end-of-turn token ``eot_token_id``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ..config.names import BLOCK_DTYPES, GGUF_DTYPES
from ..quant import GGML_TYPES, BlockWeight, is_block_layer
from ..tokenizers import byte_level_text

_INSTALL_HINT = "pip install 'decoderlab[gguf]'"
#: GGUF's pre-tokenizer name of GPT-2's split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT2)
PRE_TOKENIZER = "gpt-2"
_BLOCK_MAP = (("norm_1", "attn_norm"), ("attention.qkv", "attn_qkv"), ("attention.proj", "attn_output"),
              ("norm_2", "ffn_norm"), ("mlp.fc", "ffn_up"), ("mlp.proj", "ffn_down"))


def require_gguf():
    """The ``gguf`` package, or ``ImportError`` saying how to install it."""
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"GGUF export needs the gguf package; install it with: {_INSTALL_HINT}") from e
    return gguf


def gguf_tensors(model) -> list[tuple[str, np.ndarray, bool]]:
    """``(GGUF name, float32 array, takes the weight dtype)`` for every tensor of a GPT-2-shaped ``model``, in
    llama.cpp's order (module docstring). Arrays are (rows, cols) as ours; missing biases are zeros; a block layer's
    weight is its :class:`decoderlab.quant.BlockWeight`."""
    def arr(t, like: int):
        if t is None:
            return np.zeros(like, dtype=np.float32)
        if is_block_layer(t):  # a block layer's weight: its blocks, written as they are where dtype is theirs
            return t.blocks
        t = t.detach()
        return t.to(device="cpu", dtype=torch.float32).numpy().copy()

    def pair(module, gguf_name: str, matrix: bool) -> list[tuple[str, np.ndarray, bool]]:
        w = module if is_block_layer(module) else module.weight
        rows = module.out_features if is_block_layer(module) else w.shape[0]
        return [(f"{gguf_name}.weight", arr(w, rows), matrix),
                (f"{gguf_name}.bias", arr(getattr(module, "bias", None), rows), False)]

    out = [("token_embd.weight", arr(model.we if is_block_layer(model.we) else model.we.weight, 0), True),
           ("position_embd.weight", arr(model.pe.weight, 0), False)]
    for i, block in enumerate(model.blocks):
        for ours, theirs in _BLOCK_MAP:
            module = block.get_submodule(ours)
            out += pair(module, f"blk.{i}.{theirs}", not theirs.endswith("norm"))
    out += pair(model.norm_f, "output_norm", False)
    if not model.config.tie_weights:
        out.append(("output.weight", arr(model.fc_layer if is_block_layer(model.fc_layer) else model.fc_layer.weight, 0),
                    True))
    return out


def _token_pieces(tokenizer) -> tuple[list[str], list[int], list[str]]:
    """(token strings, token types, merges) of ``tokenizer`` in llama.cpp's byte-level BPE form."""
    gguf = require_gguf()
    kind = getattr(tokenizer, "kind", type(tokenizer).__name__)
    if kind == "bpe":
        if not tokenizer.byte_level or not _gpt2_split(tokenizer):
            raise ValueError("GGUF export takes a byte-level BPE with GPT-2's pre-tokenizer (decoderlab's); this "
                             "BPE tokenizer splits text otherwise, which llama.cpp would tokenize differently")
        merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer.to_dict()["model"]["merges"]]
    elif kind == "char":
        merges = _char_merges(tokenizer)
    else:
        raise ValueError(f"GGUF export takes a BPE or character tokenizer; a {kind} vocabulary has no form "
                         "llama.cpp reads (it splits text into bytes and merges, not into whitespace-separated "
                         "words): retrain with --tokenizer char or --tokenizer bpe")
    special = tokenizer.special_ids
    tokens, types = [], []
    for i in range(tokenizer.vocab_size):
        if i in special:
            tokens.append(tokenizer.id_to_token[i])
            types.append(int(gguf.TokenType.CONTROL))
        else:
            tokens.append(byte_level_text(tokenizer.token_bytes(i)))
            types.append(int(gguf.TokenType.NORMAL))
    return tokens, types, merges


def _gpt2_split(tokenizer) -> bool:
    spec = tokenizer.to_dict()
    pre = spec.get("pre_tokenizer") or {}
    return (spec.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and not pre.get("add_prefix_space", False))


def _char_merges(tokenizer) -> list[str]:
    """Merges that join each multi-byte character's UTF-8 bytes left to right (b1 b2, then b1b2 b3, ...)."""
    merges, seen = [], set()
    for i in range(tokenizer.vocab_size):
        if i in tokenizer.special_ids:
            continue
        data = tokenizer.token_bytes(i)
        for k in range(1, len(data)):
            m = f"{byte_level_text(data[:k])} {byte_level_text(data[k:k + 1])}"
            if m not in seen:
                seen.add(m)
                merges.append(m)
    return merges


def _write_tokenizer(writer, tokenizer) -> None:
    tokens, types, merges = _token_pieces(tokenizer)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    eos = tokenizer.eos_id
    if eos is not None:
        writer.add_eos_token_id(eos)
        writer.add_bos_token_id(eos)
    if tokenizer.pad_id is not None:
        writer.add_pad_token_id(tokenizer.pad_id)
    turn_ends = [i for i in tokenizer.end_of_text_ids if i != eos and tokenizer.id_to_token[i].startswith("<|end")]
    if turn_ends:
        writer.add_eot_token_id(turn_ends[0])
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)


def _weight(gguf, data, dtype: str, matrix: bool):
    """(array to write, its GGML type): ``dtype`` for a matrix, f32 otherwise; a block type where the rows allow
    (f16 else); ``data`` a float32 array or a :class:`BlockWeight` (written as it is when of type ``dtype``)."""
    q = gguf.GGMLQuantizationType
    if isinstance(data, BlockWeight):
        if data.kind == dtype:
            return data.to_gguf(), q(GGML_TYPES[dtype])
        data = data.dequantize().numpy()
    if not matrix or dtype == "f32":
        return data, q.F32
    if dtype in BLOCK_DTYPES and data.shape[-1] % 32 == 0:
        return BlockWeight.quantize(torch.from_numpy(data), dtype).to_gguf(), q(GGML_TYPES[dtype])
    return data.astype(np.float16), q.F16


def to_gguf(model, tokenizer, path: str | os.PathLike, *, dtype: str = "f32", name: str | None = None) -> dict:
    """Write a GPT-2-shaped ``model`` and its ``tokenizer`` as one GGUF file at ``path`` (module docstring: the
    tensors, which of them take ``dtype``, the tokenizer's form). ``dtype``: "f32", "f16", "q8_0", "q4_0" or
    "q4_1". The file
    is written next to ``path`` and renamed into place. Returns ``{"bytes", "tensors", "types"}`` (the GGML
    type of each tensor by name).

    Raises:
        ValueError: a shape llama.cpp's gpt2 architecture cannot carry (naming the field and the train option,
            :func:`decoderlab.export.check_shape`); an unknown ``dtype``; a word tokenizer, or a BPE with another
            pre-tokenizer; a tokenizer whose size is not the model's.
        ImportError: the gguf package is not installed.
    """
    from . import check_shape

    if dtype not in GGUF_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(GGUF_DTYPES)}, got {dtype!r}")
    check_shape(model.config, "gguf")
    if tokenizer.vocab_size != model.config.num_tokens:
        raise ValueError(f"tokenizer vocabulary size {tokenizer.vocab_size} does not match the model's num_tokens "
                         f"{model.config.num_tokens}")
    gguf = require_gguf()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    cfg = model.config
    writer = gguf.GGUFWriter(str(tmp), "gpt2")
    try:
        _write_header(writer, gguf, cfg, dtype, name or "decoderlab")
        _write_tokenizer(writer, tokenizer)
        types = {}
        for tname, data, matrix in gguf_tensors(model):
            arr, qtype = _weight(gguf, data, dtype, matrix)
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
    return {"bytes": path.stat().st_size, "tensors": len(types), "types": types}


def _write_header(writer, gguf, cfg, dtype: str, name: str) -> None:
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
    writer.add_layer_norm_eps(float(cfg.norm_eps))
