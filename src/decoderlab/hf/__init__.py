"""Hugging Face models in and out: directories (and ``transformers`` models in memory) of GPT-2, Llama,
Mistral, Qwen2, Qwen3, Apertus and Arcee, to and from one ``DecoderOnlyTransformer`` with the same logits.

    model, tokenizer = load_hf_directory("SmolLM2-135M")      # what decoderlab.load and every --checkpoint read
    save_hf_directory(model, tokenizer, "out")                # what decoderlab export --format hf writes
    from_hf(transformers_model) / to_hf(model)                # the same, in memory

Each family is a room of its own -- a table of names and the few reshapes it needs, beside one shared loader
and writer (the shape of TransformerLens's weight conversions and llama.cpp's converter); a new family is one
new module listed in :data:`.directory.FAMILIES`:

    gpt2.py       GPT2LMHeadModel: learned positions, LayerNorm, GELU (or ReLU²), a fused Conv1D q/k/v
    llama.py      LlamaForCausalLM, MistralForCausalLM: rope, RMSNorm, GQA, SwiGLU
    qwen.py       Qwen2ForCausalLM (q/k/v biases), Qwen3ForCausalLM (per-head q/k RMSNorm)
    recipe.py     ApertusForCausalLM (QK-norm) and ArceeForCausalLM: rope with a plain ReLU² / GELU MLP, the
                  recipes' models (the default recipe's LayerNorm carried by centring its weights)
    convert.py    the tables applied: stacking, transposes, the rope-layout permutation, the centring
    weights.py    the weight files, memory-mapped: one file or shards, F32 / BF16 / F16
    tokenizer.py  tokenizer.json + tokenizer_config.json in and out, for every decoderlab tokenizer
    generation_config.py  eos_token_id (one id or a list) in and out: the ids generation ends at
    directory.py  the loader and the writer; memory.py the same for transformers objects

Source: the names and configs of transformers 5 (``modeling_*.py``); TransformerLens's
``pretrained/weight_conversions``; llama.cpp's ``convert_hf_to_gguf.py``.
"""

from __future__ import annotations

import os

from .convert import ConfigError
from .directory import (ARCHITECTURES, FAMILIES, ExportError, export_family, is_hf_directory, load_hf_directory,
                        plain_model, read_hf_config, save_hf_directory)
from .memory import from_hf, to_hf
from .tokenizer import read_tokenizer
from .weights import WeightFiles

__all__ = ["ARCHITECTURES", "FAMILIES", "ConfigError", "ExportError", "WeightFiles", "checkpoint_reader", "export_family", "from_hf", "is_hf_directory", "load_hf_directory", "plain_model",
           "read_hf_config", "read_tokenizer", "save_hf_directory", "to_hf"]


def checkpoint_reader(directory: str | os.PathLike):
    """The reader of ``directory``'s format: :func:`load_hf_directory` for a Hugging Face directory
    (:func:`is_hf_directory`), else :func:`decoderlab.checkpoint.load_checkpoint` (which names a missing
    directory or missing files)."""
    from ..checkpoint import load_checkpoint

    return load_hf_directory if is_hf_directory(directory) else load_checkpoint
