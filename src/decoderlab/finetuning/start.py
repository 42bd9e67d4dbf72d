"""What a fine-tuning run starts from and holds fixed on a resume: the chat template, the starting model (a
decoderlab checkpoint or a Hugging Face directory, a preset from scratch, a model in memory, or on a
resume the run's own), the held-out split, the digest of the data and the padding id -- the pieces every
method shares."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from ..chat import (ChatTemplate, JinjaChatTemplate, add_chat_tokens, as_conversations, check_representable,
                    checkpoint_template, get_template, load_base, load_model, message_text, template_from_meta,
                    tools_template)
from ..checkpoint import TOKENIZER_FILE, read_config, read_meta
from ..config.names import DEFAULT_TEMPLATE, DEFAULT_TOKENIZER
from ..model import DecoderOnlyTransformer
from ..model import preset as preset_config
from ..tokenizers import Tokenizer, build_tokenizer
from ..training import Run


def sha256_of(*item_sets) -> str:
    """A digest of the conversations or preference rows (and held-out ones) a run was fine-tuned on."""
    sets = [list(c) for c in item_sets if c is not None]
    return hashlib.sha256(json.dumps(sets, default=repr).encode("utf-8")).hexdigest()


def path_or_none(data) -> str | None:
    return str(Path(data).resolve()) if isinstance(data, (str, os.PathLike)) else None


def base_template(checkpoint) -> ChatTemplate | JinjaChatTemplate | None:
    """The chat template of a base ``checkpoint`` (:func:`decoderlab.chat.checkpoint_template`: the one
    decoderlab stored, or a Hugging Face directory's own); None for a base language model or no checkpoint."""
    return None if checkpoint is None else checkpoint_template(checkpoint)


def run_template(run: Run, template, checkpoint=None, convs=()) -> ChatTemplate:
    """The run's chat template: the one given; else the base checkpoint's own (a chat model keeps the layout it
    learned) -- SmolLM2-Instruct's ChatML, which writes no tool calls, given ``chatml-tools`` when ``convs`` (the
    conversations) hold tool calls (:func:`decoderlab.chat.tools_template`: the same text without them) --, else
    "decoderlab"; on a resume the stored one, refusing another."""
    given = None if template is None else get_template(template)  # an unknown name lists the known ones
    if not run.resumed:
        own = base_template(checkpoint)
        if given is None and any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
                                 for c in convs for m in c):
            own = tools_template(own)
        return given or own or get_template(DEFAULT_TEMPLATE)
    stored = (template_from_meta(read_meta(run.run_dir)) or template_from_meta(run.info)
              or get_template(run.info.get("template")))
    run.keep("template", None if given is None else given.name, why="the model learned its tokens and layout")
    if given is not None and given != stored:
        raise ValueError(f"cannot resume {run.run_dir} with another {given.name!r} template than the one it was "
                         f"trained with; resume without a template, or start a new run")
    return stored


def held_out_fraction(run: Run, val_fraction, default: float) -> float:
    """The run's held-out share (a resume keeps its own), checked to be in [0, 1)."""
    fraction = run.keep("val_fraction", val_fraction, default=default, why="it defines the held-out conversations")
    if isinstance(fraction, bool) or not (isinstance(fraction, (int, float)) and 0 <= fraction < 1):
        raise ValueError(f"val_fraction must be in [0, 1), got {fraction!r}")
    return fraction


def split_held_out(items, fraction: float, seed: int, what: str = "conversations") -> tuple[list, list]:
    """``(training, held out)``: a seeded ``fraction`` of ``items`` held out (at least one, and never all).
    Raises ``ValueError`` when the fraction would leave none to train on."""
    n = len(items)
    if fraction <= 0 or n < 2:
        return list(items), []
    k = max(1, int(round(fraction * n)))
    if k >= n:
        raise ValueError(f"val_fraction={fraction:g} holds out {k} of the {n} {what} and leaves none to train "
                         f"on; use a smaller val_fraction, or give the held-out {what} as val_data")
    order = np.random.default_rng(seed).permutation(n)
    held = set(order[:k].tolist())
    return [c for i, c in enumerate(items) if i not in held], [c for i, c in enumerate(items) if i in held]


def starting_point(run: Run, checkpoint, preset, base_model, tokenizer, vocab_size, model_overrides,
                   template: str | ChatTemplate | None, convs: list, base_dtype: str = "float32") -> tuple:
    """``(model, tokenizer, template, start)``: the run's chat template (:func:`run_template`), the model and
    tokenizer with its tokens added; ``start`` is what run.json records: the base ``checkpoint`` (resolved), the
    ``preset`` and the ``added_tokens``. ``checkpoint`` is any kind :func:`decoderlab.chat.load_model` reads (a
    decoderlab checkpoint or run, a Hugging Face directory, a GGUF file, a LoRA run). A resume builds the run's own
    model and tokenizer (:func:`_resumed_model`), refusing another starting point, tokenizer or shape. ``convs``: the conversations the run trains on (their
    text must be representable in the tokenizer). ``base_dtype``: how a ``checkpoint`` (or a resume's base) loads --
    ``"float32"``, or ``"auto"`` for a LoRA run (:func:`run_base_dtype`: a GGUF file's blocks kept)."""
    template = run_template(run, template, checkpoint, convs)
    checkpoint = None if checkpoint is None else str(Path(checkpoint).resolve())
    if run.resumed:
        return (*_resumed_model(run, checkpoint, preset, base_model, tokenizer, vocab_size, model_overrides,
                                base_dtype),
                template, _resumed_start(run, checkpoint, preset))
    if base_model is not None:
        model, tok = base_model
    elif checkpoint is not None:  # any kind the one loader reads: a GGUF file (its blocks kept under LoRA adapters
        model, tok = load_model(checkpoint, dtype=base_dtype)[:2]  # by "auto", else dequantized), a LoRA run merged
    else:
        text = "\n".join(message_text(m) for c in convs for m in c)
        if (tokenizer or DEFAULT_TOKENIZER) == "char":  # the template's own characters, as its special tokens
            text += "\n" + template.text_characters
        tok = tokenizer if isinstance(tokenizer, Tokenizer) else build_tokenizer(tokenizer or DEFAULT_TOKENIZER,
                                                                                 text, vocab_size)
        shape = {**(model_overrides or {}), "num_tokens": tok.vocab_size}
        model = DecoderOnlyTransformer(preset_config(preset, **shape))
    check_representable(as_conversations(convs), tok)
    model, tok, added = add_chat_tokens(model, tok, template, inplace=base_model is None)  # (a copy of the caller's)
    return model.train(), tok, template, {"checkpoint": checkpoint, "preset": preset, "added_tokens": added}


_KEEP = "a resumed run keeps its model and tokenizer"


def _resumed_model(run: Run, checkpoint, preset, base_model, tokenizer, vocab_size, model_overrides,
                   base_dtype: str) -> tuple:
    """``(model, tokenizer)`` of a resume, refusing another: the run's config.json and tokenizer, its weights
    from the Lightning checkpoint -- a LoRA run's frozen base from its base, checked (:func:`decoderlab.chat.load_base`;
    the checkpoint holds the adapters alone)."""
    given = {"base_model": base_model, "tokenizer": tokenizer, "vocab_size": vocab_size,
             "model_overrides": model_overrides}
    if any(v is not None for v in given.values()):
        named = ", ".join(k for k, v in given.items() if v is not None)
        raise ValueError(f"cannot resume {run.run_dir} with {named}: {_KEEP}; resume without it, or start a new run")
    tok = Tokenizer.load(run.run_dir / TOKENIZER_FILE)
    if run.info.get("base_sha256"):
        return load_base(run.run_dir, run.info, dtype=base_dtype), tok
    return DecoderOnlyTransformer(read_config(run.run_dir)), tok


def _resumed_start(run: Run, checkpoint, preset) -> dict:
    return {"checkpoint": run.keep("checkpoint", checkpoint, why=_KEEP), "preset": run.keep("preset", preset, why=_KEEP),
            "added_tokens": run.info.get("added_tokens", [])}


#: how a fine-tuning run's base loads: a LoRA run's ``auto`` keeps a GGUF file's blocks (QLoRA-style)
BASE_DTYPES = ("auto", "float32")


def run_base_dtype(run: Run, dtype: str | None, lora: bool) -> str:
    """How the run's base loads (``run.json``'s ``base_dtype``): ``"float32"`` for a full fine-tune (every weight
    trains); for a LoRA run ``dtype`` (None: ``"auto"``: a GGUF file's block weights stay in their blocks under
    the adapters, as decoding keeps them; ``"float32"``: dequantized, the memory of a float32 copy) -- a resume
    keeps its own (float32 for a run recorded before blocks could train), refusing another.

    Raises:
        ValueError: a dtype other than :data:`BASE_DTYPES` (named), or another one than a resumed run's.
    """
    if dtype is not None and dtype not in BASE_DTYPES:
        raise ValueError(f"a fine-tuning run's base dtype is one of {', '.join(BASE_DTYPES)} (auto: a GGUF file's "
                         f"blocks kept under LoRA adapters), got {dtype!r}")
    if not lora:
        return "float32"
    if run.resumed and run.info.get("base_dtype") is None:  # (recorded before blocks could train: float32)
        run.info["base_dtype"] = "float32"
    return run.keep("base_dtype", dtype, default="auto", why=_BASE_KEPT)


_BASE_KEPT = "its adapters trained over this form of the base"


def pad_id_for(tokenizer: Tokenizer, template: ChatTemplate) -> int:
    """The padding id: ``<PAD>`` when the tokenizer has one, else 0 -- never the end-of-turn id (its label is
    -100 anyway, but the input must not read as an end of turn)."""
    eot = template.end_of_turn_id(tokenizer)
    pad = tokenizer.pad_id
    if pad is None or pad == eot:
        pad = next(i for i in range(tokenizer.vocab_size) if i != eot)
    return pad
