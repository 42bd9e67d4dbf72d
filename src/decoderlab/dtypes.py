"""Inference dtypes: the same trained weights held in fewer bytes, for faster decoding.

At batch 1 every generated token reads all the weights once, so on a CPU decoding is bound by memory traffic:
fewer bytes per weight is the lever. ``DTYPES`` are the choices of ``load_checkpoint(..., dtype=...)`` and of
``decoderlab generate/sample/chat --dtype``:

* ``float32`` (the default): the weights as trained; generation with the KV cache equals the no-cache loop.
* ``bfloat16`` / ``float16``: every floating parameter and buffer cast (``Module.to``); activations, the KV
  cache and the logits follow (sampling upcasts low-precision logits before its softmax).
* ``int8``: weight-only int8 quantization, symmetric, one scale per output row, of the linear layers inside the
  decoder blocks (attention ``qkv`` / ``proj`` and the MLP), with ``torchao`` (PyTorch's quantization library;
  ``pip install "decoderlab[quant]"``); the embeddings, norms and the output layer stay float32 (they are
  small, and the output layer shares its weight with the embedding in the GPT presets). Activations stay
  float32. ``torch.ao.quantization.quantize_dynamic``, the older path inside PyTorch, is deprecated in favour
  of torchao and not used.
* ``q8_0`` / ``q4_0`` / ``q4_1``: GGUF's block-quantized weights (:mod:`decoderlab.quant`: 32 weights per block
  with a float16 scale, and a minimum for q4_1; 8.5, 4.5 and 5 bits a weight) for every linear layer and the
  output layer -- with a tied output layer, the word embedding too (one matrix, as a GGUF file keeps it). Norms,
  biases, position tables and an untied embedding stay float32, and so do the activations and the KV cache. The
  compiled and ahead-of-time decode steps multiply the blocks as they are; eagerly each layer dequantizes.

The measured speed and quality of each (decode tokens/s, full-validation loss, greedy agreement with float32)
are in docs/benchmarks.md and ``bench/generate.py``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .config.names import BLOCK_DTYPES, DTYPES
from .output import quiet_imports
from .quant import block_dtype, quantize_model

_TORCH = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.int8: "int8"}


def dtype_name(dtype) -> str:
    """The name in ``DTYPES`` of ``dtype``: one of those names (``q8_0``, ``q4_0``, ``q4_1``: GGUF's blocks), or
    ``torch.float32`` / ``torch.bfloat16`` / ``torch.float16`` / ``torch.int8`` (int8 weight-only quantization).
    None means float32.

    Raises:
        ValueError: anything else, naming the value and the allowed names.
    """
    if dtype is None:
        return "float32"
    if isinstance(dtype, torch.dtype) and dtype in _TORCH:
        return _TORCH[dtype]
    if isinstance(dtype, str) and dtype in DTYPES:
        return dtype
    raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}")


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


def is_quantized_linear(module: nn.Module, fqn: str) -> bool:
    """The modules ``int8`` quantizes: ``nn.Linear`` layers inside the decoder blocks (not ``fc_layer``)."""
    return isinstance(module, nn.Linear) and fqn.startswith("blocks.")


def to_inference_dtype(model: nn.Module, dtype) -> nn.Module:
    """Convert ``model`` (a ``DecoderOnlyTransformer``) in place for inference in ``dtype``; returns it.

    Args:
        model: the model, float32 as trained (tied weights stay tied for bfloat16/float16).
        dtype: a name in ``DTYPES`` or a torch dtype (see :func:`dtype_name`).

    Raises:
        ValueError: an unknown dtype; a block dtype for a model with a linear layer whose input width is not a
            multiple of 32 (the layer named).
        ImportError: ``int8`` without ``torchao`` installed (the message says how to install it).
    """
    name = dtype_name(dtype)
    if name in ("bfloat16", "float16"):
        return model.to(getattr(torch, name))
    if name in BLOCK_DTYPES:
        return quantize_model(model, name)
    if name == "int8":
        quantize_int8(model)
    return model


def quantize_int8(model: nn.Module) -> nn.Module:
    """Int8 weight-only quantization (per output row) of the decoder blocks' linear layers, in place, with
    torchao's ``quantize_(model, Int8WeightOnlyConfig())``. A ``Linear``'s weight becomes an int8 tensor
    (1 byte per weight plus one float scale per row) that its forward multiplies with float32 activations.

    Raises ``ImportError`` when torchao is missing.
    """
    # Importing torchao logs warnings that concern no CPU user: one per CUDA-only kernel library a CPU build
    # cannot load, and torch's notice about how torchao registers an enum (shown with decoderlab --verbose).
    try:
        with quiet_imports():
            from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as e:
        raise ImportError(f"dtype int8 needs torchao (PyTorch's quantization library): "
                          f'pip install "decoderlab[quant]" (or pip install torchao); import failed: {e}') from None
    # set_inductor_config=False: leave torch.compile's global settings alone (nothing here is compiled)
    quantize_(model, Int8WeightOnlyConfig(set_inductor_config=False), filter_fn=is_quantized_linear)
    return model


def model_dtype(model: nn.Module) -> str:
    """The name in ``DTYPES`` of the weights ``model`` holds: its block type when it has block-quantized layers,
    ``int8`` for torchao's, else its first parameter's dtype."""
    kind = block_dtype(model)
    if kind is not None:
        return kind
    for p in model.parameters():
        if hasattr(p, "qdata"):
            return "int8"
    return dtype_name(next(model.parameters()).dtype)
