"""Inference dtypes: the same trained weights held in fewer bytes, for faster decoding.

At batch 1 every generated token reads all the weights once, so on a CPU decoding is bound by memory traffic:
fewer bytes per weight is the lever. ``DTYPES`` are the choices of ``load_checkpoint(..., dtype=...)`` and of
``decoderlab generate/sample/chat/serve/verify --dtype``:

* ``float32`` (the default): the weights as trained; generation with the KV cache equals the no-cache loop.
* ``bfloat16`` / ``float16``: every floating parameter and buffer cast (``Module.to``); activations, the KV
  cache and the logits follow (sampling upcasts low-precision logits before its softmax).
* ``q8_0`` / ``q4_0`` / ``q4_1`` / ``q5_0`` / ``q5_1``: GGUF's block-quantized weights (:mod:`decoderlab.quant`:
  32 weights per block with a float16 scale, and a minimum for q4_1 / q5_1; 8.5, 4.5, 5, 5.5 and 6 bits a weight)
  for every linear layer and the output layer -- with a tied output layer, the word embedding too (one matrix, as
  a GGUF file keeps it). Norms, biases, position tables and an untied embedding stay float32, and so do the
  activations and the KV cache. The decode step (eager or compiled) multiplies the blocks as they are through
  :mod:`decoderlab.kernels`; a prompt's many rows dequantize slices. ``q4_k`` / ``q5_k`` / ``q6_k`` (llama.cpp's
  K-quants) are read from GGUF files only: a float model is not quantized to them (refused, naming the others).

The measured speed and quality of each (decode tokens/s, full-validation loss, greedy agreement with float32)
are in docs/benchmarks.md, ``bench/generate.py`` and ``bench/llamacpp.py``. torchao's int8 weight-only
quantization was offered here before the block types and removed: its best decode (compiled, 15.6 tokens/s at the
shakespeare-char shape with GPT-2's vocabulary) was 0.41x the ahead-of-time q8_0 step's (38.0), same run.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .config.names import AUTO_DTYPE, BLOCK_DTYPES, DTYPES
from .quant import block_dtype, block_dtypes, quantize_model

_TORCH = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def dtype_name(dtype) -> str:
    """The name in ``DTYPES`` of ``dtype``: one of those names (``q8_0``, ``q4_k`` ...: GGUF's blocks), or
    ``torch.float32`` / ``torch.bfloat16`` / ``torch.float16``. None and ``"auto"`` mean float32 (a GGUF file's
    loader reads ``"auto"`` itself: the file's own types).

    Raises:
        ValueError: anything else, naming the value and the allowed names.
    """
    if dtype is None or dtype == AUTO_DTYPE:  # (auto: a GGUF file's own types, decided by its loader)
        return "float32"
    if isinstance(dtype, torch.dtype) and dtype in _TORCH:
        return _TORCH[dtype]
    if isinstance(dtype, str) and dtype in DTYPES:
        return dtype
    raise ValueError(f"unknown dtype {dtype!r}; allowed: {AUTO_DTYPE}, {', '.join(DTYPES)}")


def check_dtype(dtype, device=None) -> str:
    """``dtype``'s name (:func:`dtype_name`), checked against the ``device`` the model will run on.

    Raises:
        ValueError: an unknown dtype (the allowed ones listed); a block dtype (q8_0, q4_0, q4_1) on Apple MPS,
            where its products are not supported (they run on the CPU and CUDA GPUs).
    """
    name = dtype_name(dtype)
    if name in BLOCK_DTYPES and device is not None and torch.device(device).type == "mps":
        raise ValueError(f"dtype {name} runs on the CPU and CUDA GPUs, not Apple MPS (its block products are not "
                         f"supported there): use float16 or float32 on mps, or --device cpu")
    return name


def to_inference_dtype(model: nn.Module, dtype) -> nn.Module:
    """Convert ``model`` (a ``DecoderOnlyTransformer``) in place for inference in ``dtype``; returns it.

    Args:
        model: the model, float32 as trained (tied weights stay tied for bfloat16/float16).
        dtype: a name in ``DTYPES`` or a torch dtype (see :func:`dtype_name`).

    Raises:
        ValueError: an unknown dtype; a block dtype for a model with a linear layer whose input width is not a
            multiple of 32 (the layer named).
    """
    name = dtype_name(dtype)
    if name in ("bfloat16", "float16"):
        return model.to(getattr(torch, name))
    if name in BLOCK_DTYPES:
        return quantize_model(model, name)
    return model


def model_dtype(model: nn.Module) -> str:
    """The name in ``DTYPES`` of the weights ``model`` holds: its block type when it has block-quantized layers,
    else its first parameter's dtype (float64 too: a model cast for the float64 reference is not an inference
    dtype, but it has a name)."""
    dtype = next(model.parameters()).dtype
    return block_dtype(model) or _TORCH.get(dtype) or str(dtype).removeprefix("torch.")


def weights_said(model: nn.Module) -> str:
    """:func:`model_dtype` for the terminal, where a model's layers hold several block types: each of them, the
    type holding most weights first (``"q8_0 + q4_k + q6_k + q5_0"``, a K-quant file's mix), not the first alone."""
    kinds = block_dtypes(model)
    return " + ".join(kinds) if len(kinds) > 1 else model_dtype(model)
