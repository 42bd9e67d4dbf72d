""":func:`finetune`: one run of a fine-tuning method -- supervised fine-tuning (``method="sft"``,
:mod:`.sft`) or preference tuning (``"dpo"``, :mod:`.dpo`) -- on the run plumbing
(:mod:`decoderlab.training.run`), optionally through LoRA adapters. The method is chosen once, from
:data:`METHODS`; everything that differs between methods is its room's (:class:`~.method.Method`)."""

from __future__ import annotations

import os
from typing import Sequence

import lightning as L
import torch

from ..chat import CHAT_TEMPLATE_KEY, ChatTemplate, JinjaChatTemplate, get_template, weights_dtype
from ..config.names import FINETUNE_METHODS
from ..config.recipes import finetune_defaults
from ..lora import trainable_parameters
from ..tokenizers import Tokenizer
from ..training import (ExportCheckpoint, InterruptNotice, NonFiniteLossGuard, ShareRunDirectory, TrainConfig,
                        fit_run, make_trainer, plan_run)
from ..training.adapters import base_pointer, run_lora, run_merge
from ..training.module import frozen_copy
from ..training.trainer import check_run_options
from .dpo import DPO
from .method import Job, Method
from .sft import SFT
from .start import base_template, run_base_dtype, starting_point

#: the fine-tuning methods by name: each one's parts (its room ends with them)
METHODS: dict[str, Method] = {m.name: m for m in (SFT, DPO)}
assert tuple(METHODS) == FINETUNE_METHODS, "config.names.FINETUNE_METHODS (read by --help) names every method"


def finetune(data=None, *, out: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
             preset: str | None = None, template: str | ChatTemplate | JinjaChatTemplate | None = None, val_data=None,
             val_fraction: float | None = None, tokenizer: str | Tokenizer | None = None, vocab_size: int | None = None,
             model_overrides: dict | None = None, train_config: TrainConfig | None = None,
             config_overrides: dict | None = None, resume: str | os.PathLike | bool | None = None,
             devices: int | str = 1, strategy: str = "auto", num_nodes: int = 1, accelerator: str = "auto",
             eval_max_new_tokens: int = 64, eval_prompts: int | None = 100, callbacks: Sequence[L.Callback] = (),
             progress_bar: bool | str = True, logger: bool = True, base_model=None, method: str | None = None,
             beta: float | None = None, lora: dict | None = None, merge: bool | None = None,
             dtype: str | None = None):
    """Fine-tune a model on conversations (``method="sft"``, the default) or on preference pairs (``"dpo"``);
    return ``(model, tokenizer, summary)`` (:class:`FinetuneSummary` / :class:`PreferenceSummary`).

    Start from a base ``checkpoint`` (a decoderlab checkpoint or a Hugging Face directory), an in-memory
    ``base_model=(model, tokenizer)``, or a ``preset`` from scratch (a ``tokenizer`` kind, default "char", built
    from the data's text); the ``template`` (a name, a ``*.jinja`` file or a template object) has its special
    tokens added (:func:`decoderlab.chat.add_chat_tokens`; default: the base checkpoint's own template -- a
    Hugging Face directory's Jinja template too --, else "decoderlab"). ``data``, ``val_data``: JSONL paths or
    lists -- of conversations for SFT, of TRL's ``prompt``/``chosen``/``rejected`` rows for DPO
    (:func:`decoderlab.finetuning.dpo.load_preferences`); ``val_fraction`` (default 0.1; 0: evaluate on the
    training data) of ``data`` is held out, seeded, without ``val_data``. Training: ``train_config`` (default
    :func:`decoderlab.config.recipes.finetune_defaults` for the start and template -- a base's gentle learning
    rate, a preset's recipe from scratch, the lesson's optimizer with the ``lesson`` template -- plus
    ``config_overrides``; ``batch_size``: conversations or pairs per micro-batch per process); Lightning's
    ``devices``, ``strategy``, ``num_nodes``, ``accelerator``. SFT: :mod:`decoderlab.finetuning.sft`; DPO
    (:mod:`decoderlab.finetuning.dpo`) trains against the starting model, frozen, with ``beta`` (default
    ``decoderlab.config.DPO_BETA``) and logs reward margins and accuracy.
    ``lora``: ``{"rank", "alpha", "dropout", "targets"}`` trains LoRA adapters only (PEFT): ``out`` keeps the
    adapter (``out/adapter``), the optimizer's state of the adapters and a pointer to the base (its path and
    sha256, checked on every load and resume; a base with no file of its own is kept once in ``out/base``) -- no
    copy of the base; :func:`decoderlab.chat.load_model` puts the adapter on it. With ``merge`` the merged model
    is written once at the end too, in the base's dtype, in ``out/merged``; the model returned (and evaluated) keeps
    its adapters, as it trained (:func:`decoderlab.lora.merge_lora` folds them in: over GGUF blocks a float32
    copy, 4x the file). ``dtype``: the frozen base of a LoRA run
    from a GGUF file -- ``"auto"`` (default) keeps its block weights in their blocks, QLoRA-style (memory close to
    the file's; :mod:`decoderlab.lora`), ``"float32"`` dequantizes them (a full fine-tune is always float32:
    :func:`~.start.run_base_dtype`). ``out`` becomes the run
    directory (:mod:`decoderlab.training.run`) and a chat checkpoint storing the template; at the end the
    held-out evaluation is printed. ``resume`` (a run directory, a ``.ckpt``, or True for ``out``) continues the
    run with its own model, tokenizer, template, data, method, beta, adapters and settings: train settings
    changed are honoured from the next step, and another seed, accumulate, template, val_fraction, data, method,
    beta, LoRA, starting point or a changed base is refused.

    Raises:
        ValueError: bad data (file, line and what); an unknown template or method; not exactly one starting
            point; a tokenizer that cannot represent the data (naming the characters); nothing left to train
            on; bad config values or LoRA settings; ``merge`` without LoRA; LoRA with ``strategy="fsdp"``; a
            refused resume change; a LoRA run's base changed since (named).
        FileNotFoundError: missing files. FileExistsError: a new run's ``out`` holds files.
    """
    run, chosen, options = _plan(out, resume, template, train_config, config_overrides, checkpoint=checkpoint,
                                 preset=preset, base_model=base_model, method=method, options={"beta": beta},
                                 strategy=strategy, accelerator=accelerator, lora=lora)
    data_info, train_items, val_items = chosen.read_data(run, data, val_data, val_fraction)
    base_dtype = run_base_dtype(run, dtype, bool(lora or run.info.get("lora")))
    model, tok, template, start = starting_point(run, checkpoint, preset, base_model, tokenizer, vocab_size,
                                                 model_overrides, template, chosen.texts(train_items + val_items),
                                                 base_dtype)
    reference = _adapters(run, chosen, model, start, lora, merge)
    run.announce()  # every refusal is behind us
    if start["lora"]:  # (written now: a base without a file is kept in the run directory)
        start.update(base_pointer(run, start["checkpoint"], model, tok))
    start["merged_dtype"] = _merged_dtype(start)
    job = Job(run, tok, template, model.config.max_len, start, options, train_items, val_items, reference,
              dict(max_new_tokens=eval_max_new_tokens, max_prompts=eval_prompts))
    dm, module = chosen.train(job, model)
    launch = dict(devices=devices, strategy=strategy, num_nodes=num_nodes)
    trainer, exporter = _trainer(job, chosen.name, launch, callbacks, accelerator=accelerator,
                                 progress_bar=progress_bar, logger=logger)
    run.record(trainer, model.config, tok, launch, task="chat", method=chosen.name, template=template.name,
               **{CHAT_TEMPLATE_KEY: template.to_dict()}, **options, **data_info, checkpoint=start["checkpoint"],
               preset=start["preset"], added_tokens=start["added_tokens"], lora=start["lora"], merge=start["merge"],
               base_dtype=base_dtype if start["lora"] else None, **_pointer(start))
    model, summary = chosen.summarize(job, trainer, exporter, fit_run(trainer, module, run, datamodule=dm))
    _closing_line(trainer, chosen, summary, progress_bar or logger)
    return model.eval(), tok, summary


def _plan(out, resume, template, train_config, config_overrides, *, checkpoint, preset, base_model, method,
          options: dict, strategy, accelerator, lora) -> tuple:
    """``(run, method, its options)``: the run (:func:`decoderlab.training.plan_run`) with the fine-tuning
    defaults of its start (one of checkpoint, preset, base model unless resuming) and template, after the
    machine's refusals (before the data is read), the method's (:func:`method_of`), an unknown template's and
    LoRA's under FSDP; then the random state seeded for the model about to be built."""
    if sum(x is not None for x in (checkpoint, preset, base_model)) != 1 and resume in (None, False):
        raise ValueError("give exactly one starting point: checkpoint (a base checkpoint directory) or preset "
                         "(train from scratch)")
    name = getattr(template, "name", template) or getattr(base_template(checkpoint), "name", None)
    run = plan_run(out, resume, train_config, config_overrides, TrainConfig(**finetune_defaults(preset, name)),
                   kind="finetune")
    check_run_options(run.cfg, strategy, accelerator)
    chosen, options = method_of(run, method, options)
    if template is not None:
        get_template(template)  # an unknown name lists the known ones, before the data is read
    if (lora or run.info.get("lora")) and str(strategy) == "fsdp":
        raise ValueError("LoRA adapters cannot train under strategy='fsdp' (--strategy fsdp); use ddp")
    L.seed_everything(run.cfg.seed, verbose=False)
    return run, chosen, options


def _adapters(run, chosen: Method, model, start: dict, lora: dict | None, merge: bool | None):
    """The frozen reference of a method that trains against the starting model (taken before any adapter, else
    None); then the run's LoRA adapters on ``model``, recorded in ``start`` with the trainable parameters and
    whether the merged model is written at the end (a resume keeps its own)."""
    reference = frozen_copy(model) if chosen.reference else None
    start.update(lora=run_lora(run, model, lora), trainable_parameters=trainable_parameters(model))
    start["merge"] = run_merge(run, merge, start["lora"])
    return reference


def _pointer(start: dict) -> dict:
    """A LoRA run's base pointer (``"base"``, ``"base_sha256"``) from ``start``; {} for a full fine-tune."""
    return {k: start[k] for k in ("base", "base_sha256") if k in start}


def _merged_dtype(start: dict) -> torch.dtype | None:
    """The dtype of the merged model ``merge`` writes: the base checkpoint's (:func:`decoderlab.chat.weights_dtype`),
    float32 for a base without a file (as trained); None without ``merge``."""
    if not start["merge"]:
        return None
    return weights_dtype(start["checkpoint"]) if start["checkpoint"] is not None else torch.float32


def _closing_line(trainer, chosen: Method, summary, verbose) -> None:
    """The last line of a run on the terminal (the first process, unless the run is silent)."""
    if trainer.is_global_zero and verbose:
        print(chosen.closing(summary))


def method_of(run, method: str | None, given: dict) -> tuple[Method, dict]:
    """The run's method (:data:`METHODS`) and its options: the method given (default "sft"), or on a resume the
    run's own, refusing another; an option of another method (``given``: name -> value, None for not given) is
    refused, naming the method it applies to."""
    if method is not None and method not in METHODS:
        raise ValueError(f"unknown fine-tuning method {method!r}; methods: {', '.join(METHODS)}")
    stored = run.info.get("method", "sft") if run.resumed else None  # (runs before DPO were all SFT)
    if run.resumed and method is not None and method != stored:
        raise ValueError(f"cannot resume {run.run_dir} with method={method!r}: it was trained with "
                         f"method={stored!r}; resume without a method, or start a new run")
    chosen = METHODS[stored or method or "sft"]
    for name, value in given.items():
        if value is not None and name not in chosen.option_names:
            owners = " or ".join(f"method={m.name!r} (--method {m.name})" for m in METHODS.values()
                                 if name in m.option_names)
            raise ValueError(f"{name}={value!r} applies to {owners} only")
    return chosen, chosen.options(run, {name: given.get(name) for name in chosen.option_names})


def _trainer(job: Job, method: str, launch: dict, callbacks, **options) -> tuple:
    """``(Lightning trainer, checkpoint exporter)`` of the run: the chat checkpoint's meta (the template, the
    method, the adapters' settings), the adapter alone when asked, the run plumbing's callbacks."""
    run, start = job.run, job.start
    meta = {"task": "chat", CHAT_TEMPLATE_KEY: job.template.to_dict(), "tokenizer": job.tokenizer.kind,
            "base": start["checkpoint"], "preset": start["preset"], "method": method,
            **({"lora": start["lora"]} if start["lora"] else {}), **_pointer(start)}
    exporter = ExportCheckpoint(run.run_dir, job.tokenizer, meta, merged_dtype=start["merged_dtype"])
    trainer = make_trainer(run.cfg, run.run_dir, **options, **launch,
                           callbacks=[NonFiniteLossGuard(run.run_dir), exporter, ShareRunDirectory(run),
                                      InterruptNotice(run.run_dir, "finetune"), *callbacks])
    return trainer, exporter
