"""LoRA adapters in a run (``finetune``, DPO and ``rl``): the settings a run trains with, put on the model the
same way on a new run and on a resume, and the pointer to the frozen base the adapters fit.

A new run takes the settings given (``decoderlab.lora.lora_settings``: rank, alpha, dropout, targets) and
``run.json`` records them under ``"lora"``; a resume puts the recorded adapters on the model it rebuilt from the
base *before* Lightning restores the checkpoint (whose state holds the adapters' weights under PEFT's names, and
nothing of the frozen base: :class:`~.callbacks.AdapterState`), and refuses other settings. The run directory is
an adapter checkpoint (:func:`decoderlab.checkpoint.save_adapter_checkpoint`): the adapter, and the base as a
pointer (:func:`base_pointer`) that loading and resuming check.
"""

from __future__ import annotations

import torch

from ..checkpoint import BASE_DIR, checkpoint_digest, save_checkpoint
from ..lora import apply_lora, describe_lora, lora_settings, merge_lora
from .run import Run, first_process

def run_lora(run: Run, model: torch.nn.Module, lora: dict | None) -> dict | None:
    """Put the run's LoRA adapters on ``model`` (in place) and return their settings (None: no adapters,
    every parameter trains).

    ``lora``: ``{"rank", "alpha", "dropout", "targets"}`` (alpha, dropout, targets optional) for a new run;
    on a resume None (the run's own) or the same settings. The settings and the trainable parameter count
    (:func:`decoderlab.lora.describe_lora`) become one of the run's notes (:meth:`Run.announce` prints them).

    Raises:
        ValueError: bad settings (:func:`decoderlab.lora.lora_settings`, a rank larger than a layer, targets
            naming no layer), or on a resume settings other than the run's.
    """
    given = None if lora is None else lora_settings(**lora)
    settings = run.keep("lora", given, why="the run's weights hold these adapters")
    if settings is None:
        return None
    apply_lora(model, **settings)
    run.notes.append(describe_lora(model, settings))
    return settings


def run_merge(run: Run, merge: bool | None, settings: dict | None) -> bool:
    """Whether the run writes its merged model once at the end (``merge``; None: a resume's own, else False).

    Raises:
        ValueError: ``merge`` without LoRA adapters (``settings`` None).
    """
    merge = bool(merge if merge is not None else run.info.get("merge", False))
    if merge and not settings:
        raise ValueError("merge=True applies to a LoRA run (lora=...): the checkpoint of a run without adapters is "
                         "the whole model already")
    return merge


def base_pointer(run: Run, checkpoint, model: torch.nn.Module, tokenizer) -> dict:
    """Where a LoRA run's frozen base is, as ``run.json`` and ``meta.json`` record it: ``{"base": path,
    "base_sha256": digest}`` (:func:`decoderlab.checkpoint.check_base` reads it). On a resume the run's own; a
    base ``checkpoint`` given (a directory or a GGUF file): its absolute path and digest; a base without a file
    (a model given in memory, a preset from scratch): ``model`` -- the starting model, its adapters still zero --
    kept once in ``RUN_DIR/base``, written by the first process now: call it after every refusal."""
    if run.resumed:
        return {"base": run.info["base"], "base_sha256": run.info["base_sha256"]}
    if checkpoint is not None:
        return {"base": str(checkpoint), "base_sha256": checkpoint_digest(checkpoint)}
    if not first_process():
        return {"base": BASE_DIR, "base_sha256": None}
    directory = run.run_dir / BASE_DIR
    save_checkpoint(directory, merge_lora(model), tokenizer)  # (B = 0 at the start: the merge is the base, exactly)
    return {"base": BASE_DIR, "base_sha256": checkpoint_digest(directory)}
