"""Models in memory: a ``transformers`` model, or a state dict, to ours (:func:`from_hf`), and ours to a
``transformers`` model (:func:`to_hf`) -- the same tables as the directories (:mod:`.directory`), without files.

``transformers`` is optional (``pip install 'decoderlab[hf]'``): needed only to build or take a transformers
model object; directories and state dicts need torch and safetensors alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch

from ..checkpoint import CONFIG_FILE
from ..model import DecoderOnlyTransformer
from . import gpt2
from .convert import stored_names
from .directory import (build_model, family_of, hf_config, hf_state, plain_model, read_hf_config,
                        save_hf_directory)
from .weights import WeightFiles

_INSTALL_HINT = "pip install 'decoderlab[hf]'"


def require_transformers():
    """The ``transformers`` package, or ``ImportError`` saying how to install it."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"decoderlab.hf needs Hugging Face transformers for a transformers model; install it "
                          f"with: {_INSTALL_HINT}") from e
    return transformers


def from_hf(source: Any, config: Any = None, attention: str = "sdpa", *,
            n_head: int | None = None) -> DecoderOnlyTransformer:
    """Our ``DecoderOnlyTransformer`` with the weights of a Hugging Face model; it computes the same logits
    (float32, eval mode).

    Args:
        source: a local directory (as :func:`.directory.load_hf_directory` reads it, tokenizer aside); a
            ``transformers`` model of a class in :data:`.directory.ARCHITECTURES` (or its base model, as
            ``GPT2Model``); or a state dict (with or without the base model's prefix).
        config: for a state dict: its config (a transformers config, or the dict of a config.json). Without
            it a state dict is read as GPT-2's, its sizes from the tensor shapes and ``n_head`` given.
        attention: our attention kernel, "sdpa" | "explicit".
        n_head: heads, for a GPT-2 state dict without ``config``.

    Raises:
        ValueError: a class or config field decoderlab cannot honour; a missing, unexpected or mis-shaped tensor
            (named, with the shape the config gives); no ``n_head`` for a bare state dict, or one that contradicts
            the config.
        FileNotFoundError: a directory that does not exist, or lacks config.json or its weights (named).
        TypeError: a source of another kind; a state dict value that is not a tensor.
    """
    if isinstance(source, (str, os.PathLike)):
        hf, family, _, cfg = read_hf_config(source)
        files, where = WeightFiles(source), str(Path(source) / CONFIG_FILE)
    else:
        state, hf, where = _state_and_config(source, config, n_head)
        files = WeightFiles.of_state(state, where)
        family, name = family_of(hf, where)
        cfg = family.to_ours(hf, name, where)
    if n_head is not None and n_head != cfg.n_head:
        raise ValueError(f"n_head={n_head} contradicts the config's n_head={cfg.n_head}")
    return build_model(files, family, hf, cfg.replace(attention=attention), config_file=where)


def _state_and_config(source, config, n_head) -> tuple[Mapping[str, torch.Tensor], dict, str]:
    """(state dict, config.json's dict, a name for messages) of a transformers model or a state dict."""
    if isinstance(source, torch.nn.Module) and hasattr(getattr(source, "config", None), "to_dict"):
        hf = source.config.to_dict()
        name = type(source).__name__
        if name == "GPT2Model":  # a base model: its class with the LM head
            name = "GPT2LMHeadModel"
        elif name.endswith("Model") and "For" not in name and "LMHead" not in name:
            name = name.removesuffix("Model") + "ForCausalLM"
        hf["architectures"] = [name]
        return source.state_dict(), hf, name
    if not isinstance(source, Mapping):
        raise TypeError("from_hf takes a directory, a transformers model or a state dict; "
                        f"got {type(source).__name__}")
    state = dict(source)
    where = "state dict"
    WeightFiles.of_state(state, where)  # every value a tensor
    if config is not None:
        hf = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        hf.setdefault("architectures", None)
        return state, hf, where
    lookup, _ = stored_names(WeightFiles.of_state(state), gpt2.PREFIX, gpt2.IGNORED)
    hf = gpt2.infer({name: tuple(state[stored].shape) for name, stored in lookup.items()}, n_head, where)
    head, wte = lookup.get("lm_head.weight"), lookup.get("transformer.wte.weight")
    hf["tie_word_embeddings"] = head is None or (state[head].shape == state[wte].shape and (
        state[head].data_ptr() == state[wte].data_ptr() or torch.equal(state[head], state[wte])))
    return state, hf, where


def to_hf(model: DecoderOnlyTransformer, path: str | os.PathLike | None = None, *, tokenizer=None,
          chat_template: str | None = None, **config_kwargs):
    """A ``transformers`` model with our model's weights (:func:`.directory.export_family` picks the class
    whose forward equals ours: GPT-2, Qwen2 / Qwen3, Llama, Apertus / Arcee); with ``path``, the directory
    :func:`.directory.save_hf_directory` writes too (with ``tokenizer``'s files and the Jinja
    ``chat_template``). LoRA adapters are merged first. Extra keyword arguments go to the transformers config
    (e.g. ``attn_implementation="eager"``).

    Returns the transformers model (in eval mode if ours is, in our dtype).

    Raises:
        ValueError: a model no Hugging Face class computes (the fields and the nearest class named); a
            tokenizer whose size is not the model's.  ImportError: transformers is not installed.
        TypeError: not a ``DecoderOnlyTransformer``.
    """
    model = plain_model(model)
    family, name, cfg, tensors = hf_state(model, tokenizer)  # refused (named) before transformers is needed
    transformers = require_transformers()
    dtype = model.we.weight.dtype
    config = {**hf_config(family, cfg, tokenizer, dtype), **config_kwargs}
    config.pop("torch_dtype")
    hf_cfg = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    own = hf.state_dict()
    if cfg.tie_weights:
        embed = next(k for k in tensors if k.endswith(("wte.weight", "embed_tokens.weight")))
        tensors["lm_head.weight"] = tensors[embed]
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or unexpected:  # a transformers version with other names
        raise ValueError(f"{name} tensor names differ: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        hf.load_state_dict(tensors, strict=True)
    hf.train(model.training)
    if path is not None:
        save_hf_directory(model, tokenizer, path, chat_template=chat_template)
    return hf
