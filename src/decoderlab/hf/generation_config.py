"""The ids a Hugging Face model's generation ends at, read and written: ``eos_token_id``, one id or a list.

transformers' ``generate`` stops at every id of its ``GenerationConfig.eos_token_id``, which
``from_pretrained`` takes from ``generation_config.json`` when the directory has one -- that file alone, its
``eos_token_id`` or none, config.json's not consulted -- and from config.json's otherwise
(``GenerationMixin.adjust_generation_fn``). Llama 3 Instruct lists three ids there, Qwen2.5 Instruct two,
Gemma two; most are control tokens, which decoderlab ends a text at anyway, but not all need be. Read as
transformers reads them, they become the tokenizer's :attr:`~decoderlab.tokenizers.Tokenizer.eos_ids`, part
of its ``end_of_text_ids`` -- what ``generate``, ``chat``, the command line and the server stop at -- and are
saved with it; an export writes them back (:func:`eos_token_id_of`).

Source: transformers 5's ``generation/utils.py`` (``adjust_generation_fn``, ``_prepare_special_tokens``) and
``generation/configuration_utils.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..checkpoint import CONFIG_FILE
from .convert import ConfigError

GENERATION_CONFIG = "generation_config.json"


def read_eos_ids(directory: str | os.PathLike, hf: dict, num_tokens: int) -> tuple[int, ...]:
    """The ids ``eos_token_id`` names for a Hugging Face directory, in their order (() for none):
    generation_config.json's when the file exists, else config.json's (``hf``, already read).

    Raises:
        ConfigError (field ``eos_token_id``): a value other than null, an id or a list of ids in 0 ..
            ``num_tokens`` - 1 (naming the file, the value and the id at fault); ValueError: a
            generation_config.json that is not a JSON object.
    """
    path = Path(directory) / GENERATION_CONFIG
    if path.is_file():
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a JSON file ({e})") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path}: must hold a JSON object, got {type(config).__name__}")
    else:
        path, config = Path(directory) / CONFIG_FILE, hf
    value = config.get("eos_token_id")
    ids = [] if value is None else value if isinstance(value, list) else [value]
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_tokens:
            raise ConfigError(f"{path}: eos_token_id {value!r} names id {i!r}; allowed: token ids 0 .. "
                              f"{num_tokens - 1} (vocab_size {num_tokens}): one, a list of them, or null",
                              "eos_token_id")
    return tuple(dict.fromkeys(ids))


def with_eos_ids(tokenizer, ids: tuple[int, ...]):
    """``tokenizer`` with :attr:`eos_ids` ``ids`` when they name more than its ``eos_id`` (else as it is: the
    common single id the tokenizer already ends at is not stored twice)."""
    if not ids or ids == (tokenizer.eos_id,):
        return tokenizer
    return tokenizer.with_eos_ids(ids)


def eos_token_id_of(eos: int | None, eos_ids: tuple[int, ...]) -> int | list[int] | None:
    """config.json's and generation_config.json's ``eos_token_id`` for a tokenizer whose end token is ``eos``
    and whose :attr:`eos_ids` are ``eos_ids``: ``eos``, or with ``eos_ids`` a list of every id generation ends
    at -- ``eos`` first (transformers pads with the first), then the others in their order. None: none."""
    ids = list(dict.fromkeys(([eos] if eos is not None else []) + list(eos_ids)))
    return None if not ids else ids[0] if len(ids) == 1 else ids
