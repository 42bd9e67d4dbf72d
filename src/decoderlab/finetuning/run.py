""":func:`finetune`: one run of supervised fine-tuning (``method="sft"``) or of preference tuning (``"dpo"``), on
the run plumbing (:mod:`decoderlab.training.run`), optionally through LoRA adapters."""

from __future__ import annotations

import os
from typing import Sequence

import lightning as L

from ..chat import CHAT_TEMPLATE_KEY, ChatTemplate
from ..config.names import FINETUNE_METHODS
from ..config.recipes import finetune_defaults
from ..config.defaults import DPO_BETA
from ..lora import trainable_parameters
from ..tokenizers import Tokenizer
from ..training import (ExportCheckpoint, InterruptNotice, NonFiniteLossGuard, ShareRunDirectory, TrainConfig,
                        fit_run, make_trainer, plan_run)
from ..training.adapters import ADAPTER_DIR, run_lora
from ..training.dpo import DPODataModule, DPOModule
from ..training.module import frozen_copy
from ..training.sft import SFTDataModule, SFTModule
from ..training.trainer import check_run_options
from .evaluation import format_evaluation, pad_id_for
from .preference import format_preferences, pair_conversations, pairs_of, preference_examples, summarize_dpo
from .start import base_template, run_template, starting_point
from .supervised import conversations_of, sft_examples, summarize_sft

#: the fine-tuning methods: supervised (masked cross-entropy on conversations), DPO (preference pairs)
METHODS = FINETUNE_METHODS


def finetune(data=None, *, out: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
             preset: str | None = None, template: str | ChatTemplate | None = None, val_data=None,
             val_fraction: float | None = None, tokenizer: str | Tokenizer | None = None, vocab_size: int | None = None,
             model_overrides: dict | None = None, train_config: TrainConfig | None = None,
             config_overrides: dict | None = None, resume: str | os.PathLike | bool | None = None,
             devices: int | str = 1, strategy: str = "auto", num_nodes: int = 1, accelerator: str = "auto",
             eval_max_new_tokens: int = 64, eval_prompts: int | None = 100, callbacks: Sequence[L.Callback] = (),
             progress_bar: bool | str = True, logger: bool = True, base_model=None, method: str | None = None,
             beta: float | None = None, lora: dict | None = None, save_adapter: bool | None = None):
    """Fine-tune a model on conversations (``method="sft"``, the default) or on preference pairs (``"dpo"``);
    return ``(model, tokenizer, summary)`` (:class:`FinetuneSummary` / :class:`PreferenceSummary`).

    Start from a base ``checkpoint`` (a decoderlab checkpoint or a Hugging Face GPT-2 directory), an in-memory
    ``base_model=(model, tokenizer)``, or a ``preset`` from scratch (a ``tokenizer`` kind, default "char", built
    from the data's text); the ``template``'s special tokens are added (:func:`decoderlab.chat.add_chat_tokens`;
    default: the base checkpoint's own template, else "decoderlab"). ``data``, ``val_data``: JSONL paths or
    lists -- of conversations for SFT, of TRL's ``prompt``/``chosen``/``rejected`` rows for DPO
    (:func:`decoderlab.feedback.load_preferences`); ``val_fraction`` (default 0.1; 0: evaluate on the training
    data) of ``data`` is held out, seeded, without ``val_data``. Training: ``train_config`` (default
    :func:`decoderlab.config.recipes.finetune_defaults` for the start and template -- a base's gentle learning
    rate, a preset's recipe from scratch, the lesson's optimizer with the ``lesson`` template -- plus
    ``config_overrides``; ``batch_size``: conversations or pairs per micro-batch per process); Lightning's
    ``devices``, ``strategy``, ``num_nodes``, ``accelerator``.

    SFT follows :mod:`decoderlab.finetuning`; DPO (:mod:`decoderlab.training.dpo`) trains against the starting
    model, frozen, with ``beta`` (default ``decoderlab.config.DPO_BETA``) and logs reward margins and accuracy.
    ``lora``: ``{"rank", "alpha", "dropout", "targets"}`` trains LoRA adapters only (PEFT); the checkpoint is
    written merged, and with ``save_adapter`` the adapter alone in ``out/adapter`` too. ``out`` becomes the run
    directory (:mod:`decoderlab.training.run`) and a chat checkpoint storing the template; at the end the
    held-out evaluation is printed. ``resume`` (a run directory, a ``.ckpt``, or True for ``out``) continues the
    run with its own model, tokenizer, template, data, method, beta, adapters and settings: train settings
    changed are honoured from the next step, and another seed, accumulate, template, val_fraction, data, method,
    beta, LoRA or starting point is refused.

    Raises:
        ValueError: bad data (file, line and what); an unknown template or method; not exactly one starting
            point; a tokenizer that cannot represent the data (naming the characters); nothing left to train
            on; bad config values or LoRA settings; LoRA with ``strategy="fsdp"``; a refused resume change.
        FileNotFoundError: missing files. FileExistsError: a new run's ``out`` holds files.
    """
    if sum(x is not None for x in (checkpoint, preset, base_model)) != 1 and resume in (None, False):
        raise ValueError("give exactly one starting point: checkpoint (a base checkpoint directory) or preset "
                         "(train from scratch)")
    name = getattr(template, "name", template) or getattr(base_template(checkpoint), "name", None)
    run = plan_run(out, resume, train_config, config_overrides, TrainConfig(**finetune_defaults(preset, name)))
    check_run_options(run.cfg, strategy, accelerator)  # the machine's refusals before the data is read
    method, beta = _method(run, method, beta)
    if (lora or run.info.get("lora")) and str(strategy) == "fsdp":
        raise ValueError("LoRA adapters cannot train under strategy='fsdp' (--strategy fsdp); use ddp")
    template = run_template(run, template, checkpoint)
    if method == "dpo":
        data_info, train_items, val_items = pairs_of(run, data, val_data, val_fraction)
        texts = pair_conversations(train_items + val_items)
    else:
        data_info, train_items, val_items = conversations_of(run, data, val_data, val_fraction)
        texts = train_items + val_items
    L.seed_everything(run.cfg.seed, verbose=False)
    model, tok, start = starting_point(run, checkpoint, preset, base_model, tokenizer, vocab_size, model_overrides,
                                       template, texts)
    reference = frozen_copy(model) if method == "dpo" else None  # the starting model, before any adapter
    start["lora"] = run_lora(run, model, lora)
    start["trainable_parameters"] = trainable_parameters(model)
    run.announce()  # every refusal is behind us
    save_adapter = bool(save_adapter if save_adapter is not None else run.info.get("save_adapter", False))
    pad = pad_id_for(tok, template)
    examples, dm, module = _training(method, run, model, reference, beta, (train_items, val_items), tok, template,
                                     pad)
    launch = dict(devices=devices, strategy=strategy, num_nodes=num_nodes)
    trainer, exporter = _trainer(run, tok, template, start, method, save_adapter, launch,
                                 dict(accelerator=accelerator, progress_bar=progress_bar, logger=logger), callbacks)
    run.record(trainer, model.config, tok, launch, task="chat", method=method, template=template.name,
               **({"beta": beta} if method == "dpo" else {}), **data_info, checkpoint=start["checkpoint"],
               preset=start["preset"], added_tokens=start["added_tokens"], lora=start["lora"],
               save_adapter=save_adapter)
    seconds = fit_run(trainer, module, run, datamodule=dm)
    model, summary = _summarize(method, trainer, run, module, reference, (tok, template, pad), exporter,
                                (train_items, val_items), examples, start, beta, seconds,
                                dict(max_new_tokens=eval_max_new_tokens, max_prompts=eval_prompts))
    _closing_line(trainer, method, summary, progress_bar or logger)
    return model.eval(), tok, summary


def _summarize(method, trainer, run, module, reference, chat: tuple, exporter, items, examples, start, beta, seconds,
               eval_options) -> tuple:
    """``(the model, the summary)`` of the method (:func:`summarize_dpo` or :func:`summarize_sft`)."""
    tok, template, pad = chat
    if method == "dpo":
        return summarize_dpo(trainer, run, module.model, reference, tok, template, exporter, examples, start, beta,
                             seconds, pad)
    return summarize_sft(trainer, run, module.model, tok, template, exporter, items, examples, start, seconds,
                         eval_options)


def _trainer(run, tok, template, start: dict, method: str, save_adapter: bool, launch: dict, options: dict,
             callbacks) -> tuple:
    """``(Lightning trainer, checkpoint exporter)`` of the run: the chat checkpoint's meta (the template, the
    method, the adapters' settings), the adapter alone when asked, the run plumbing's callbacks."""
    meta = {"task": "chat", CHAT_TEMPLATE_KEY: template.to_dict(), "tokenizer": tok.kind, "base": start["checkpoint"],
            "preset": start["preset"], "method": method, **({"lora": start["lora"]} if start["lora"] else {})}
    exporter = ExportCheckpoint(run.run_dir, tok, meta, adapter_dir=run.run_dir / ADAPTER_DIR if save_adapter else None)
    trainer = make_trainer(run.cfg, run.run_dir, **options, **launch,
                           callbacks=[NonFiniteLossGuard(run.run_dir), exporter, ShareRunDirectory(run),
                                      InterruptNotice(run.run_dir, "finetune"), *callbacks])
    return trainer, exporter


def _training(method: str, run, model, reference, beta, items: tuple, tok, template, pad: int) -> tuple:
    """``(examples, datamodule, Lightning module)`` of the method: DPO's pairs against the frozen ``reference``,
    or SFT's conversations."""
    train_items, val_items = items
    batches = dict(batch_size=run.cfg.batch_size, accumulate=run.cfg.accumulate, seed=run.cfg.seed, pad_id=pad,
                   val_batch_size=run.cfg.val_batch_size)
    if method == "dpo":
        examples = preference_examples(train_items, val_items, tok, template, model.config.max_len)
        return examples, DPODataModule(*examples, **batches), DPOModule(model, run.cfg, reference, beta)
    examples = sft_examples(train_items, val_items, tok, template, model.config.max_len)
    return examples, SFTDataModule(*examples, **batches), SFTModule(model, run.cfg)


def _closing_line(trainer, method: str, summary, verbose) -> None:
    """The last line of a run on the terminal (the first process, unless the run is silent)."""
    if trainer.is_global_zero and verbose:
        line = (format_preferences if method == "dpo" else format_evaluation)(summary.evaluation, summary.eval_on)
        how = "" if method == "sft" else f" ({method})"
        print(f"fine-tuned{how} for {summary.steps} steps; {line}")


def _method(run, method: str | None, beta: float | None) -> tuple[str, float | None]:
    """The run's method and DPO beta: the ones given (defaults "sft" and ``DPO_BETA``), or on a resume the
    run's own, refusing others."""
    if method is not None and method not in METHODS:
        raise ValueError(f"unknown fine-tuning method {method!r}; methods: {', '.join(METHODS)}")
    stored = run.info.get("method", "sft") if run.resumed else None  # (runs before DPO were all SFT)
    if run.resumed and method is not None and method != stored:
        raise ValueError(f"cannot resume {run.run_dir} with method={method!r}: it was trained with "
                         f"method={stored!r}; resume without a method, or start a new run")
    method = stored or method or "sft"
    if method != "dpo":
        if beta is not None:
            raise ValueError(f"beta={beta!r} applies to method='dpo' (--method dpo) only")
        return method, None
    return method, run.keep("beta", beta, default=DPO_BETA, why="it defines the run's loss")
