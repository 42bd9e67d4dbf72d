"""The one loader for inference: a checkpoint directory -> the model, its tokenizer, its chat template and its
``meta.json`` together, for the command line, chat and the server."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ..checkpoint import read_meta
from ..hf import load_any_checkpoint
from .templates import ChatTemplate, template_from_meta


class LoadedModel(NamedTuple):
    """What :func:`load_model` returns (unpacks as ``model, tokenizer, template, meta``).

    Attributes:
        model: the ``DecoderOnlyTransformer``, in eval mode.
        tokenizer: its tokenizer (with the template's special tokens, for a chat checkpoint).
        template: the stored chat template (a fine-tuned chat checkpoint's, or ``lesson`` for the lesson's
            pair model); None for a base language model and for a Hugging Face GPT-2 directory.
        meta: the checkpoint's ``meta.json`` ({} when there is none).
    """

    model: torch.nn.Module
    tokenizer: object
    template: ChatTemplate | None
    meta: dict


def load_model(directory: str | os.PathLike, *, map_location: str | torch.device = "cpu",
               dtype=None) -> LoadedModel:
    """Load a decoderlab checkpoint directory or a Hugging Face GPT-2 directory for inference
    (:func:`decoderlab.hf.load_any_checkpoint`, weights in ``dtype``; see :mod:`decoderlab.dtypes`) together
    with its chat template (:func:`~decoderlab.chat.template_from_meta`: a checkpoint of the lesson's pair
    training written by an earlier version reads as the ``lesson`` template) and its ``meta.json``.

    Raises:
        FileNotFoundError: the directory or a required file is missing (named).
        ValueError: a file that cannot be read (named, with the field for a bad ``config.json``); a tokenizer
            whose vocabulary size is not the model's; a malformed stored template; an unknown dtype.
    """
    model, tokenizer = load_any_checkpoint(directory, map_location=map_location, dtype=dtype)
    meta = read_meta(directory)  # ({} for a GPT-2 directory: it has no meta.json)
    return LoadedModel(model, tokenizer, template_from_meta(meta), meta)
