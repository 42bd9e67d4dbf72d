"""A GGUF file's tensors -> decoderlab's state dict: each dequantized by the ``gguf`` package
(``gguf.quants.dequantize``: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants, ...) to float32, llama's
query and key rows put back in Hugging Face's rotate-half order, and renamed.

Tensor mapping (llama.cpp -> ours; shapes (rows, cols) as PyTorch's ``nn.Linear``)::

    token_embd.weight        (num_tokens, d_model)     -> we.weight
    position_embd.weight     (max_len, d_model)        -> pe.weight                        (gpt2)
    blk.{i}.attn_norm.*      (d_model,)                -> blocks.{i}.norm_1.*
    blk.{i}.attn_q/k/v.*     (heads * d_head, d_model) -> blocks.{i}.attention.qkv.*       (concatenated q | k | v)
    blk.{i}.attn_qkv.*       (3 d_model, d_model)      -> blocks.{i}.attention.qkv.*       (gpt2)
    blk.{i}.attn_output.*    (d_model, n_head d_head)  -> blocks.{i}.attention.proj.*
    blk.{i}.attn_q_norm/attn_k_norm.weight (d_head,)   -> blocks.{i}.attention.q_norm/k_norm.weight   (qwen3)
    blk.{i}.ffn_norm.*                                 -> blocks.{i}.norm_2.*
    blk.{i}.ffn_gate.weight  (d_ff, d_model)           -> blocks.{i}.mlp.gate.weight
    blk.{i}.ffn_up.*         (d_ff, d_model)           -> blocks.{i}.mlp.fc.*
    blk.{i}.ffn_down.*       (d_model, d_ff)           -> blocks.{i}.mlp.proj.*
    output_norm.*                                      -> norm_f.*
    output.weight            (num_tokens, d_model)     -> fc_layer.weight  (absent: tied to we.weight)

The permutation: llama.cpp's converter (``LlamaModel.permute``) reorders each query / key head's rows from
Hugging Face's rotate-half pairing (x[i], x[i + d_head/2]) to ggml's interleaved one (x[2i], x[2i+1]); its
inverse is applied here to the rows (so it works on quantized rows too), and the model uses rotate-half rope.
qwen2 / qwen3 files are written in rotate-half order (llama.cpp's NEOX rope) and are not permuted.

Source: llama.cpp's ``convert_hf_to_gguf.py``; the ``gguf`` package's ``quants`` module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

_BLOCK = {"attn_norm": "norm_1", "attn_output": "attention.proj", "attn_q_norm": "attention.q_norm",
          "attn_k_norm": "attention.k_norm", "ffn_norm": "norm_2", "ffn_gate": "mlp.gate", "ffn_up": "mlp.fc",
          "ffn_down": "mlp.proj", "attn_qkv": "attention.qkv"}
_TOP = {"token_embd": "we", "position_embd": "pe", "output_norm": "norm_f", "output": "fc_layer"}


@lru_cache(maxsize=1)
def dequantizable() -> tuple[str, ...]:
    """The GGML types the installed ``gguf`` package dequantizes (each tried on one zero block)."""
    import gguf

    ok = []
    for qtype, (_, size) in gguf.GGML_QUANT_SIZES.items():
        try:
            gguf.quants.dequantize(np.zeros((1, size), dtype=np.uint8), qtype)
        except (NotImplementedError, ValueError, TypeError):
            continue
        ok.append(qtype.name)
    return tuple(ok)


def check_types(gf) -> None:
    """Raise ``ValueError`` naming the first tensor of ``gf`` (a :class:`~.reader.GGUFFile`) whose GGML type the
    ``gguf`` package cannot dequantize, with the types it can -- before any tensor is read."""
    ok = dequantizable()
    for t in gf.tensors.values():
        if t.type.name not in ok:
            raise ValueError(f"{gf.path}: tensor {t.name} is {t.type.name}, a GGML type the gguf package cannot "
                             f"dequantize; allowed: {', '.join(ok)}")


def unpermute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's converter's query/key permutation: ``rows`` (n_head * d_head, ...) in ggml's
    interleaved rotary order -> Hugging Face's rotate-half order. Works on float rows and on rows of
    quantized blocks alike (rows move whole)."""
    d_head = rows.shape[0] // n_head
    return rows.reshape(n_head, d_head // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


@dataclass
class DequantReport:
    """What a load dequantized: tensors by GGML type (F32 ones read as they are), the bytes the dequantized ones
    held in the file and as float32; the tensors kept in their blocks (``kept``, ``kept_bytes``: a block dtype
    asked); the seconds it took. ``str()``
    is the line the command line shows."""

    types: dict[str, int] = field(default_factory=dict)
    file_bytes: int = 0
    float_bytes: int = 0
    seconds: float = 0.0
    kept: dict[str, int] = field(default_factory=dict)
    kept_bytes: int = 0

    def __str__(self) -> str:
        def counts(types: dict) -> str:
            return ", ".join(f"{n} {k}" for k, n in sorted(types.items(), key=lambda kv: -kv[1]))

        quantized = {k: n for k, n in self.types.items() if k != "F32"}
        parts = []
        if self.kept:
            parts.append(f"kept {sum(self.kept.values())} tensors in their blocks ({counts(self.kept)}, "
                         f"{self.kept_bytes / 1e6:.1f} MB)")
        if quantized:
            parts.append(f"dequantized {sum(quantized.values())} tensors ({counts(quantized)}): "
                         f"{self.file_bytes / 1e6:.1f} MB in the file -> "
                         f"{self.float_bytes / 1e6:.1f} MB of float32")
        if "F32" in self.types:
            parts.append(f"{self.types['F32']} F32 tensors as they are")
        return "; ".join(parts or ["no tensors"]) + f" ({self.seconds:.1f} s)"

    def to_dict(self) -> dict:
        return dict(types=dict(self.types), file_bytes=self.file_bytes, float_bytes=self.float_bytes,
                    seconds=round(self.seconds, 3), kept=dict(self.kept), kept_bytes=self.kept_bytes)


#: values dequantized per call of a type's block dequantizer (16 MB of float32)
_CHUNK_VALUES = 1 << 22


def dequantize_rows(raw: np.ndarray, qtype) -> np.ndarray:
    """Rows of GGML blocks (uint8, (rows, bytes per row)) -> float32 (rows, values per row), by the ``gguf``
    package's dequantizer of ``qtype``. Its block function is called on chunks of ~4M values rather than through
    ``gguf.quants.dequantize``, which splits a tensor into groups of 16 rows and copies them together again: the
    same numbers (a test holds them equal), in half the time (2.3 s against 4.6 s for SmolLM2's Q4_1 file on a
    loaded 2-core machine)."""
    import gguf

    q = getattr(gguf.quants, qtype.name, None)
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) or \
            getattr(q, "qtype", None) != qtype:
        return gguf.quants.dequantize(raw, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    q.init_grid()  # the lattice tables of the IQ types, made once
    rows, cols = raw.shape[0], raw.shape[1] // size * block
    out = np.empty((rows, cols), dtype=np.float32)
    step = max(1, _CHUNK_VALUES // max(cols, 1))
    for start in range(0, rows, step):
        part = np.ascontiguousarray(raw[start:start + step]).reshape(-1, size)
        out[start:start + step] = q.dequantize_blocks(part).reshape(-1, cols)
    return out


def dequantize(gf, name: str, report: DequantReport | None = None) -> np.ndarray:
    """Tensor ``name`` of ``gf`` as a writable float32 array of its logical shape."""
    import gguf

    t = gf.tensors[name]
    raw = gf.data(name)
    if t.type == gguf.GGMLQuantizationType.F32:
        out = np.array(raw.view(np.float32), copy=True)  # off the read-only map
    else:
        out = dequantize_rows(raw, t.type)
    if report is not None:
        report.types[t.type.name] = report.types.get(t.type.name, 0) + 1
        if t.type != gguf.GGMLQuantizationType.F32:  # the bytes of what was dequantized
            report.file_bytes += t.nbytes
            report.float_bytes += out.size * 4
    return out.reshape(t.shape)


#: GGML types the model keeps as they are when a block dtype is asked (decoderlab.quant's kinds)
BLOCK_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
#: our layers that can hold block weights (a linear layer; the word embedding when tied to the output layer)
_BLOCK_LAYERS = ("attention.qkv", "attention.proj", "mlp.gate", "mlp.fc", "mlp.proj", "fc_layer")


def _ours(name: str) -> str:
    prefix, param = name.rsplit(".", 1)
    if prefix.startswith("blk."):
        _, i, kind = prefix.split(".")
        return f"blocks.{i}.{_BLOCK[kind]}.{param}"
    return f"{_TOP[prefix]}.{param}"


def state_dict(gf, arch: str, fields: dict, keep_blocks: bool = False):
    """``(state, blocks, report)`` of a checked file (:func:`~.config.check_tensors`): our state dict (float32
    tensors by our names), the layers kept as block weights (layer name -> ``decoderlab.quant.BlockWeight``;
    empty unless ``keep_blocks``) and what it cost.

    ``keep_blocks``: a matrix of a linear layer (and the word embedding when tied) stored as Q8_0, Q4_0 or Q4_1
    is kept in its blocks, no float copy made (q | k | v fused when the three share a type; llama's rows
    unpermuted as rows of blocks); every other tensor is dequantized."""
    report, start = DequantReport(), time.perf_counter()
    state, blocks = {}, {}
    block_ok = keep_blocks and fields["tie_weights"]
    for name in gf.tensors:
        if name.startswith("blk.") and name.split(".")[2] in ("attn_q", "attn_k", "attn_v"):
            continue  # fused below, per block
        ours = _ours(name)
        layer = ours.rsplit(".", 1)[0]
        if keep_blocks and ours.endswith(".weight") and (layer.endswith(_BLOCK_LAYERS) or (layer == "we" and block_ok)):
            kept = _blocks(gf, [name], report)
            if kept is not None:
                blocks[layer] = kept
                continue
        state[ours] = torch.from_numpy(dequantize(gf, name, report))
    if arch != "gpt2":
        for i in range(fields["n_layer"]):
            names = [f"blk.{i}.attn_{x}.weight" for x in "qkv"]
            kept = _blocks(gf, names, report, _head_orders(arch, fields)) if keep_blocks else None
            if kept is not None:
                blocks[f"blocks.{i}.attention.qkv"] = kept
            for param in ("weight", "bias") if fields["qkv_bias"] else ("weight",):
                if param == "weight" and kept is not None:
                    continue
                parts = [_head_rows(gf, arch, fields, f"blk.{i}.attn_{x}.{param}", x, report) for x in "qkv"]
                state[f"blocks.{i}.attention.qkv.{param}"] = torch.from_numpy(np.concatenate(parts))
    report.seconds = time.perf_counter() - start
    return state, blocks, report


def _head_orders(arch: str, fields: dict) -> list:
    """The row order of q, k and v in the model (llama: rotate-half, the converter's permutation undone)."""
    if arch != "llama":
        return [None] * 3
    dh = fields["head_dim"] or fields["d_model"] // fields["n_head"]
    return [torch.from_numpy(unpermute(np.arange(n * dh), n)) for n in (fields["n_head"], fields["n_kv_head"])] + [None]


def _blocks(gf, names: list[str], report: DequantReport, orders=None):
    """The tensors ``names`` (rows stacked, each reordered by ``orders``) as one ``BlockWeight``, None when they
    are not all of one block type."""
    from ..quant import BlockWeight

    kinds = {gf.tensors[n].type.name for n in names}
    if len(kinds) != 1 or next(iter(kinds)) not in BLOCK_TYPES:
        return None
    kind = BLOCK_TYPES[kinds.pop()]
    parts = []
    for n, order in zip(names, orders or [None] * len(names)):
        t = gf.tensors[n]
        w = BlockWeight.from_gguf(gf.data(n), kind, t.shape)
        parts.append(w if order is None else w.rows(order))
        report.kept[t.type.name] = report.kept.get(t.type.name, 0) + 1
        report.kept_bytes += t.nbytes
    return parts[0] if len(parts) == 1 else BlockWeight.cat(parts)


def _head_rows(gf, arch: str, fields: dict, name: str, which: str, report) -> np.ndarray:
    rows = dequantize(gf, name, report)
    if arch == "llama" and which in "qk":
        rows = unpermute(rows, fields["n_head"] if which == "q" else fields["n_kv_head"])
    return rows
