"""A GGUF file's tensors <-> decoderlab's weights, both ways, by llama.cpp's names (:data:`BLOCK_NAMES`).

In: each tensor dequantized by the ``gguf`` package (``gguf.quants``: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, the K-quants, ...) to float32 -- or a linear layer's matrix kept in its blocks
(:class:`decoderlab.quant.BlockWeight`): every matrix of a type the kernels multiply (``keep="auto"``, the default
load: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), or those of one asked type --, q / k / v stacked into our one
projection in the row order the model computes with (:func:`unpermute`: llama's rows back in rotate-half order; of
different block types, three weights of one layer), renamed (:func:`state_dict`).

Out: each layer's arrays under llama.cpp's names (:func:`layer_tensors`), each encoded in the GGML type of the
asked dtype (:func:`encode`: f32 / bf16 / f16 by ``gguf.quants``, q8_0 / q4_0 / q4_1 by :mod:`decoderlab.quant`,
the bytes llama.cpp's reference quantizers write; a block layer of the asked type written as it is).

Tensor mapping (llama.cpp <-> ours; shapes (rows, cols) as PyTorch's ``nn.Linear``)::

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
    blk.{i}.post_attention_norm / post_ffw_norm.weight -> blocks.{i}.norm_1_post / norm_2_post.weight  (gemma3)
    output_norm.*                                      -> norm_f.*
    output.weight            (num_tokens, d_model)     -> fc_layer.weight  (absent: tied to we.weight)

The permutation: llama.cpp's converter (``LlamaModel.permute``) reorders each query / key head's rows from
Hugging Face's rotate-half pairing (x[i], x[i + d_head/2]) to ggml's interleaved one (x[2i], x[2i+1])
(:func:`permute`); :func:`unpermute` is its inverse. Both move whole rows, so they apply to quantized rows too.

Source: llama.cpp's ``convert_hf_to_gguf.py``; the ``gguf`` package's ``quants`` module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

#: llama.cpp's tensor names -> ours: in a block (``blk.{i}.<name>``), and outside the blocks
BLOCK_NAMES = {"attn_norm": "norm_1", "attn_output": "attention.proj", "attn_q_norm": "attention.q_norm",
               "attn_k_norm": "attention.k_norm", "ffn_norm": "norm_2", "ffn_gate": "mlp.gate", "ffn_up": "mlp.fc",
               "ffn_down": "mlp.proj", "attn_qkv": "attention.qkv", "post_attention_norm": "norm_1_post",
               "post_ffw_norm": "norm_2_post"}
TOP_NAMES = {"token_embd": "we", "position_embd": "pe", "output_norm": "norm_f", "output": "fc_layer"}


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


def permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's query/key permutation: ``rows`` (n_head * d_head, ...) in Hugging Face's rotate-half
    order -> ggml's interleaved rotary order (rows move whole)."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


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
    #: the block type the matrices not kept were quantized to afterwards (``load_gguf(dtype="q8_0")`` of a file
    #: whose matrices are float, or blocks of another type), or None
    requantized: str | None = None
    #: the load kept the file's own types (``--dtype auto``): the line starts "weights as in the file"; for a file of
    #: float32 matrices, their GGML type (``"f32"``), else None
    own: bool = False
    own_float: str | None = None
    #: the 16-bit dtype the whole model was cast to after the load (``--dtype bfloat16`` / ``float16``), or None
    cast: str | None = None

    def __str__(self) -> str:
        def counts(types: dict) -> str:
            return ", ".join(f"{n} {k}" for k, n in sorted(types.items(), key=lambda kv: -kv[1]))

        quantized = {k: n for k, n in self.types.items() if k != "F32"}
        parts = []
        if self.own:
            return self._own_line(quantized)
        if self.kept:
            parts.append(f"kept {sum(self.kept.values())} tensors in their blocks ({counts(self.kept)}, "
                         f"{self.kept_bytes / 1e6:.1f} MB)")
        if quantized:
            parts.append(f"dequantized {sum(quantized.values())} tensors ({counts(quantized)}): "
                         f"{self.file_bytes / 1e6:.1f} MB in the file -> "
                         f"{self.float_bytes / 1e6:.1f} MB of float32")
        if "F32" in self.types:
            parts.append(f"{self.types['F32']} F32 tensors as they are")
        if self.requantized:
            parts.append(f"{'the other' if self.kept else 'the'} matrices then quantized to {self.requantized}")
        if self.cast:
            parts.append(f"all then cast to {self.cast} ({self.float_bytes / 2e6:.1f} MB of matrices)")
        return "; ".join(parts or ["no tensors"]) + f" ({self.seconds:.1f} s)"

    def _own_line(self, dequantized: dict) -> str:
        """``--dtype auto``'s line: "weights as in the file: q4_1 (210 matrices), q8_0 (1) (96.5 MB); f32 norms
        and vectors (61)" -- and what was not its own (a type the kernels do not multiply, dequantized). An F16 /
        BF16 matrix is kept as it is (``kept``: decoderlab.half)."""
        kept = ", ".join(f"{k.lower()} ({n}{' matrices' if i == 0 else ''})"
                         for i, (k, n) in enumerate(sorted(self.kept.items(), key=lambda kv: -kv[1])))
        head = f"weights as in the file: {kept} ({self.kept_bytes / 1e6:.1f} MB)" if kept else \
            f"weights as in the file: {self.own_float or 'f32'} matrices"
        parts = [head]
        if dequantized:
            held = "" if not kept else " (no kernel for them)"
            parts.append(f"dequantized {sum(dequantized.values())} tensors ({', '.join(sorted(dequantized))})"
                         f"{held}: {self.file_bytes / 1e6:.1f} MB in the file -> {self.float_bytes / 1e6:.1f} MB of "
                         f"float32")
        if "F32" in self.types:
            parts.append(f"f32 norms and vectors ({self.types['F32']})")
        return "; ".join(parts) + f" ({self.seconds:.1f} s)"

    def to_dict(self) -> dict:
        return dict(types=dict(self.types), file_bytes=self.file_bytes, float_bytes=self.float_bytes,
                    seconds=round(self.seconds, 3), kept=dict(self.kept), kept_bytes=self.kept_bytes,
                    requantized=self.requantized, own=self.own, own_float=self.own_float, cast=self.cast)


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


#: GGML types kept as they are in a block layer, each as its dtype (decoderlab.quant's kinds: the kernels' types)
BLOCK_TYPES = {k.upper(): k for k in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")}
#: ``keep`` for every type of :data:`BLOCK_TYPES` (``--dtype auto``)
KEEP_ALL = "auto"
#: our layers that can hold block weights (a linear layer; the word embedding when tied to the output layer)
_BLOCK_LAYERS = ("attention.qkv", "attention.proj", "mlp.gate", "mlp.fc", "mlp.proj", "fc_layer")


def ours_name(name: str) -> str:
    """Our state-dict name of llama.cpp's tensor ``name`` (``blk.0.ffn_up.weight`` -> ``blocks.0.mlp.fc.weight``)."""
    prefix, param = name.rsplit(".", 1)
    if prefix.startswith("blk."):
        _, i, kind = prefix.split(".")
        return f"blocks.{i}.{BLOCK_NAMES[kind]}.{param}"
    return f"{TOP_NAMES[prefix]}.{param}"


def state_dict(gf, fields: dict, keep: str | None = None, qkv_orders: list | None = None):
    """``(state, blocks, report)`` of a checked file (:func:`~.architecture.check_tensors`): our state dict
    (float32 tensors by our names), the layers kept as block weights (layer name ->
    ``decoderlab.quant.BlockWeight``; empty unless ``keep``) and what it cost.

    ``keep``: a block dtype (``q8_0`` ... ``q6_k``): a matrix of a linear layer (and the word embedding when tied)
    stored in that very type is kept in its blocks, no float copy made (q | k | v fused when the three are); every
    other tensor -- a matrix of another block type included -- is dequantized. ``"auto"`` (:data:`KEEP_ALL`):
    every matrix of a type of :data:`BLOCK_TYPES` is kept (q | k | v of different types as three weights of the
    one layer). ``qkv_orders``: for an
    architecture whose q, k and v are three tensors, the row order of each in the model (None: as written);
    None for one fused ``attn_qkv``."""
    report, start = DequantReport(), time.perf_counter()
    state, blocks = {}, {}
    for name in gf.tensors:
        if qkv_orders is not None and name.startswith("blk.") and name.split(".")[2] in ("attn_q", "attn_k", "attn_v"):
            continue  # stacked below, per block
        ours = ours_name(name)
        layer = ours.rsplit(".", 1)[0]
        can_keep = layer.endswith(_BLOCK_LAYERS) or (layer == "we" and fields["tie_weights"])
        kept = _blocks(gf, [name], report, keep) if keep and ours.endswith(".weight") and can_keep else None
        half = _half(gf, [name], report, keep) if ours.endswith(".weight") and (can_keep or layer == "we") \
            else None
        if kept is not None:
            blocks[layer] = kept
        elif half is not None:
            state[ours] = half
        else:
            state[ours] = torch.from_numpy(dequantize(gf, name, report))
        gf.release(name)  # copied out: its pages leave the map (the peak holds the file's bytes once)
    for i in range(fields["n_layer"] if qkv_orders is not None else 0):
        names = [f"blk.{i}.attn_{x}.weight" for x in "qkv"]
        kept = _blocks(gf, names, report, keep, qkv_orders) if keep else None
        if kept is not None:
            blocks[f"blocks.{i}.attention.qkv"] = kept
        half = _half(gf, names, report, keep, qkv_orders) if kept is None else None
        if half is not None:
            state[f"blocks.{i}.attention.qkv.weight"] = half
        for param in ("weight", "bias") if fields["qkv_bias"] else ("weight",):
            if param == "weight" and (kept is not None or half is not None):
                continue
            parts = [dequantize(gf, f"blk.{i}.attn_{x}.{param}", report) for x in "qkv"]
            parts = [p if order is None else p[order.numpy()] for p, order in zip(parts, qkv_orders)]
            state[f"blocks.{i}.attention.qkv.{param}"] = torch.from_numpy(np.concatenate(parts))
        for name in (f"blk.{i}.attn_{x}.{p}" for x in "qkv" for p in ("weight", "bias")):
            if name in gf.tensors:
                gf.release(name)
    report.seconds = time.perf_counter() - start
    return state, blocks, report


def _keeps(type_name: str, keep: str) -> bool:
    kind = BLOCK_TYPES.get(type_name)
    return kind is not None and (keep == KEEP_ALL or kind == keep)


def _blocks(gf, names: list[str], report: DequantReport, keep: str, orders=None):
    """The tensors ``names`` (rows stacked, each reordered by ``orders``) as one ``BlockWeight`` -- or, of
    different types, a list of them --, None unless they are all kept (:func:`_keeps`). The rows are reordered and
    stacked as the file's bytes, then packed once."""
    from ..quant import BlockWeight

    if any(not _keeps(gf.tensors[n].type.name, keep) for n in names):
        return None
    raws, kinds = [], []
    for n, order in zip(names, orders or [None] * len(names)):
        t = gf.tensors[n]
        raw = gf.data(n)
        raws.append(raw if order is None else raw[np.asarray(order)])
        kinds.append(BLOCK_TYPES[t.type.name])
        report.kept[t.type.name] = report.kept.get(t.type.name, 0) + 1
        report.kept_bytes += t.nbytes
    width = gf.tensors[names[0]].shape[1]
    if len(set(kinds)) == 1:
        raw = raws[0] if len(raws) == 1 else np.concatenate([np.asarray(r) for r in raws])
        return BlockWeight.from_gguf(raw, kinds[0], (raw.shape[0], width))
    return [BlockWeight.from_gguf(r, k, (r.shape[0], width)) for r, k in zip(raws, kinds)]


#: the 16-bit float types a matrix keeps under ``keep="auto"`` (decoderlab.half: float32 activations)
HALF_TYPES = {"F16": torch.float16, "BF16": torch.bfloat16}


def _half(gf, names: list[str], report: DequantReport, keep: str | None, orders=None) -> torch.Tensor | None:
    """The matrices ``names`` (rows stacked, each reordered by ``orders``) as one float16 / bfloat16 tensor copied
    off the map -- under ``keep="auto"``, when all are of one 16-bit type --, else None."""
    types = {gf.tensors[n].type.name for n in names}
    if keep != KEEP_ALL or len(types) != 1 or next(iter(types)) not in HALF_TYPES:
        return None
    dtype, parts = HALF_TYPES[next(iter(types))], []
    for n, order in zip(names, orders or [None] * len(names)):
        t = gf.tensors[n]
        rows = torch.from_numpy(np.array(gf.data(n).view(np.int16))).view(dtype)
        parts.append(rows if order is None else rows[order])
        report.kept[t.type.name] = report.kept.get(t.type.name, 0) + 1
        report.kept_bytes += t.nbytes
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# -- out ----------------------------------------------------------------------------------------------------------

#: the largest |weight| each type holds, in float16's largest numbers: float16 itself; q8_0's scale is max / 127,
#: q4_0's max / 8; q4_1 keeps each block's minimum as a float16
_FLOAT16_MAX = 65504.0
_HEADROOM = {"float16": 1, "q8_0": 127, "q4_0": 8, "q4_1": 1}


def array(t: torch.Tensor | None, like: int = 0) -> np.ndarray:
    """A weight as the writer takes it: a float32 NumPy copy; a block layer's :class:`~decoderlab.quant.
    BlockWeight` as it is (written as it is where the dtype is its own; a layer of several block types
    dequantized); None -> ``like`` zeros."""
    from ..quant import is_block_layer

    if t is None:
        return np.zeros(like, dtype=np.float32)
    if is_block_layer(t):  # (weights of several types in one layer -- a K-quant file's q | k | v -- as floats)
        return t.blocks if len(set(t.kinds)) == 1 else t.dequantize().numpy()
    return t.detach().to(device="cpu", dtype=torch.float32).numpy().copy()


def layer_tensors(module, name: str, ours: str, matrix: bool, zero_bias: bool) -> list[tuple]:
    """A layer's weight and bias as ``(GGUF name, array, takes the weight dtype, our name)``: ``name.weight`` and
    ``name.bias`` (zeros where the architecture has a bias and the model none: ``zero_bias``)."""
    from ..quant import is_block_layer

    w = module if is_block_layer(module) else module.weight
    out = [(f"{name}.weight", array(w), matrix, f"{ours}.weight")]
    bias = getattr(module, "bias", None)
    if bias is not None or zero_bias:
        rows = module.blocks.shape[0] if is_block_layer(module) else w.shape[0]
        out.append((f"{name}.bias", array(bias, rows), False, f"{ours}.bias"))
    return out


def split_rows(rows, cuts: list[int]) -> list:
    """Rows [0, a), [a, b), [b, end) of a float array or a BlockWeight."""
    from ..quant import BlockWeight

    if isinstance(rows, BlockWeight):
        edges = [0, *cuts, rows.shape[0]]
        return [rows.rows(slice(a, b)) for a, b in zip(edges, edges[1:])]
    return np.split(rows, cuts)


def reorder_rows(rows, index: np.ndarray):
    """``rows[index]`` of a float array or a BlockWeight (its rows of blocks)."""
    from ..quant import BlockWeight

    return rows.rows(torch.from_numpy(index)) if isinstance(rows, BlockWeight) else rows[index]


def encode(data, dtype: str, matrix: bool, name: str):
    """``(array to write, its GGML type)``: ``dtype`` for a matrix, f32 otherwise; a block type where the rows
    allow (f16 else); ``data`` a float32 array or a :class:`~decoderlab.quant.BlockWeight` (written as it is when
    of type ``dtype``).

    Raises:
        ValueError: a value outside what ``dtype``'s float16 numbers hold (:data:`_HEADROOM`), naming the tensor.
    """
    import gguf

    from ..config.names import BLOCK_DTYPES
    from ..quant import GGML_TYPES, BlockWeight

    q = gguf.GGMLQuantizationType
    if isinstance(data, BlockWeight):
        if data.kind == dtype:
            return data.to_gguf(), q(GGML_TYPES[dtype])
        data = data.dequantize().numpy()
    if not matrix or dtype == "float32":
        return data, q.F32
    if dtype == "bfloat16":  # float32's range: nothing to refuse; rounded to nearest even, as torch rounds
        return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), q.BF16), q.BF16
    blocks = dtype in BLOCK_DTYPES and data.shape[-1] % 32 == 0
    limit = _FLOAT16_MAX * (_HEADROOM[dtype] if blocks else 1)
    peak = float(np.abs(data).max()) if data.size else 0.0
    if not peak <= limit:
        room = f" x {_HEADROOM[dtype]} for a {dtype} scale" if limit > _FLOAT16_MAX else ""
        raise ValueError(f"tensor {name} holds {peak:g}, outside float16's range (+-{_FLOAT16_MAX:g}{room}): --dtype "
                         f"{dtype} cannot hold it; write it with --dtype float32")
    if blocks:
        return BlockWeight.quantize(torch.from_numpy(data), dtype).to_gguf(), q(GGML_TYPES[dtype])
    return data.astype(np.float16), q.F16
