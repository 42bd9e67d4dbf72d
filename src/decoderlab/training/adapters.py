"""LoRA adapters in a run (``finetune``, DPO and ``rl``): the settings a run trains with, put on the model the
same way on a new run and on a resume, and the adapter directory a run writes.

A new run takes the settings given (``decoderlab.lora.lora_settings``: rank, alpha, dropout, targets) and
``run.json`` records them under ``"lora"``; a resume puts the recorded adapters on the model it rebuilt
*before* Lightning restores the checkpoint (whose state holds the adapters' weights under PEFT's names), and
refuses other settings. The exported checkpoint is always merged (:class:`~.callbacks.ExportCheckpoint`), so
it is an ordinary checkpoint every command loads; ``ADAPTER_DIR`` holds the adapter alone when asked.
"""

from __future__ import annotations

import torch

from ..lora import apply_lora, describe_lora, lora_settings
from .run import Run

#: where a run writes the adapter alone (PEFT's layout), inside the run directory
ADAPTER_DIR = "adapter"


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
