"""Supervised fine-tuning on conversations (:func:`finetune`): masked loss, exact per-step normalisation,
evaluation, and a chat checkpoint that stores its template. (The module is not named ``finetune``: importing
a submodule sets the package attribute of its name, so ``decoderlab.finetune`` could not stay the function.)

It sits above :mod:`decoderlab.chat` (templates, rendering, replies) and :mod:`decoderlab.training` (the
Lightning pieces, ``training.sft``), which do not know each other. The pipeline, in order:

1. conversations (``decoderlab.chat.load_conversations``) -> ``template.render`` -> ``(ids, mask)``;
2. :func:`~decoderlab.training.sft.shift_for_training` -- the only place where the label shift happens:
   inputs = ids[:-1], labels = ids[1:] where the mask of ids[1:] is True, else -100 (so only assistant tokens
   and the end of turn after them are targets), after truncating to max_len + 1 tokens; rows left with no
   target are dropped and counted;
3. :class:`~decoderlab.training.sft.SFTBatches` -- optimizer step s uses a fixed set of ``batch_size *
   accumulate * world_size`` rows (seeded shuffles, epoch after epoch); every micro-batch carries the number
   of supervised tokens of its whole step (all micro-batches, all processes), padded with a pad id that is
   never the end of turn (labels -100 there);
4. :class:`~decoderlab.training.sft.SFTModule` (a ``LitModel``) -- ``sum of per-token cross-entropy /
   supervised tokens of the step``, so the loss (and gradient) of an optimizer step is the mean over every
   supervised token of the step, not a mean of per-batch means (scaled by accumulate * world_size only to undo
   Lightning's division by accumulate and DDP's gradient averaging);
5. evaluation on held-out conversations (:func:`evaluate_chat`): loss and bits per byte over assistant
   tokens, token accuracy, end-of-turn rate and exact match of greedy replies.

Sources: the masked-loss SFT recipe as in nanochat ``chat_sft``, litgpt ``finetune`` and TRL ``SFTTrainer``
(prompt tokens at -100); per-token normalisation across accumulation as discussed in Hugging Face
transformers' gradient-accumulation fix (2024).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import lightning as L
import numpy as np
import torch

from .chat import (CHAT_TEMPLATE_KEY, ChatTemplate, Conversations, add_chat_tokens, as_conversations,
                   check_representable, get_template, message_text, stream_chat_reply, template_from_meta)
from .checkpoint import TOKENIZER_FILE, load_checkpoint, read_config, read_meta, unwrap_model
from .config.names import DEFAULT_TEMPLATE, DEFAULT_TOKENIZER
from .config.defaults import FINETUNE_TRAIN, FINETUNE_VAL_FRACTION
from .model import DecoderOnlyTransformer
from .model import preset as preset_config
from .tokenizers import Tokenizer, build_tokenizer
from .training import (ExportCheckpoint, InterruptNotice, NonFiniteLossGuard, Run, ShareRunDirectory, Summary,
                       TrainConfig, fit_run, make_trainer, mean_of_last, plan_run)
from .training.strategy import on_training_device
from .training.trainer import check_run_options
from .training.sft import (IGNORE_INDEX, Examples, SFTBatches, SFTDataModule, SFTModule, collate, masked_ce_sum,
                           shift_for_training)

#: the ``TrainConfig`` fields :func:`finetune` sets when no ``train_config`` is given
FINETUNE_DEFAULTS = FINETUNE_TRAIN

__all__ = ["FINETUNE_DEFAULTS", "IGNORE_INDEX", "Examples", "SFTBatches", "SFTDataModule", "SFTModule", "collate",
           "masked_ce_sum", "shift_for_training", "build_examples", "pad_id_for", "evaluate_chat", "format_evaluation",
           "FinetuneSummary", "finetune"]


def build_examples(conversations: Sequence, tokenizer: Tokenizer, template: ChatTemplate,
                   max_len: int) -> Examples:
    """Render every conversation with ``template`` and shift it (:func:`shift_for_training`)."""
    eot = template.end_of_turn_id(tokenizer)
    specials = {tokenizer.token_to_id[t] for t in template.special_tokens if t in tokenizer.token_to_id}
    rows, kept, truncated, dropped, nbytes = [], [], 0, 0, 0
    for i, conv in enumerate(conversations):
        ids, mask = template.render(conv, tokenizer)
        if len(ids) > max_len + 1:
            truncated += 1
        x, y = shift_for_training(ids, mask, max_len)
        if all(t == IGNORE_INDEX for t in y):
            dropped += 1
            continue
        rows.append((x, y))
        kept.append(i)
        nbytes += sum(len(tokenizer.token_bytes(t)) for t in y if t != IGNORE_INDEX and t != eot
                      and t not in specials)
    return Examples(rows, kept, truncated, dropped, nbytes)


def pad_id_for(tokenizer: Tokenizer, template: ChatTemplate) -> int:
    """The padding id: ``<PAD>`` when the tokenizer has one, else 0 -- never the end-of-turn id (its label is
    -100 anyway, but the input must not read as an end of turn)."""
    eot = template.end_of_turn_id(tokenizer)
    pad = tokenizer.pad_id
    if pad is None or pad == eot:
        pad = next(i for i in range(tokenizer.vocab_size) if i != eot)
    return pad


# ---------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_chat(model, tokenizer: Tokenizer, template: ChatTemplate, conversations: Sequence,
                  *, max_new_tokens: int = 64, max_prompts: int | None = 100, batch_size: int = 32) -> dict:
    """Held-out metrics of a chat model on ``conversations`` (each ending with an assistant turn).

    Teacher-forced over every conversation with a supervised token within max_len + 1 tokens (the others are
    counted as ``dropped``): ``loss`` (mean nats per supervised token: assistant content + end of turn),
    ``bpb`` (the summed loss / ln 2 / UTF-8 bytes of the supervised assistant text), ``token_accuracy``
    (argmax == target over supervised tokens). Greedy replies to the first ``max_prompts`` of those
    conversations' last user turn (with the history before it), through
    :func:`decoderlab.chat.stream_chat_reply`: ``end_of_turn_rate`` (share whose reply ends with the end of
    turn within ``max_new_tokens``) and ``exact_match`` (reply == reference after stripping whitespace). A
    measure of nothing (no supervised token; no prompt answered, e.g. ``max_prompts`` 0) is None, never NaN.
    Returns a dict of these plus the counts ``conversations`` (evaluated), ``dropped``, ``tokens``, ``prompts``.
    """
    model = unwrap_model(model)
    was_training = model.training
    model.eval()
    try:
        ex = build_examples(conversations, tokenizer, template, model.config.max_len)
        ce_sum, count, correct = _teacher_forced(model, ex, pad_id_for(tokenizer, template), batch_size)
        kept = [conversations[i] for i in ex.conversations]
        prompts = kept if max_prompts is None else kept[:max_prompts]
        ended = exact = 0
        for conv in prompts:
            info: dict = {}
            reply = "".join(stream_chat_reply(model, tokenizer, conv[:-1], template, max_new_tokens=max_new_tokens,
                                              temperature=0.0, info=info))
            ended += bool(info["ended_with_end_of_turn"])
            exact += reply.strip() == conv[-1]["content"].strip()
    finally:
        model.train(was_training)
    return {
        "loss": ce_sum / count if count else None,
        "bpb": ce_sum / (math.log(2) * ex.bytes) if ex.bytes else None,
        "token_accuracy": correct / count if count else None,
        "end_of_turn_rate": ended / len(prompts) if prompts else None,
        "exact_match": exact / len(prompts) if prompts else None,
        "conversations": len(ex.rows), "dropped": ex.dropped, "tokens": count, "prompts": len(prompts),
    }


def _teacher_forced(model, ex: Examples, pad: int, batch_size: int) -> tuple[float, int, int]:
    """``(summed cross-entropy, supervised tokens, correct argmax predictions)`` over the rows of ``ex``."""
    ce_sum, count, correct = 0.0, 0, 0
    for i in range(0, len(ex.rows), batch_size):
        x, y = collate(ex.rows[i : i + batch_size], pad)
        logits = model(x)
        ce, n = masked_ce_sum(logits, y)
        ce_sum += float(ce)
        count += int(n)
        sel = y != IGNORE_INDEX
        correct += int((logits.argmax(-1)[sel] == y[sel]).sum())
    return ce_sum, count, correct


def format_evaluation(ev: dict, on: str = "held-out") -> str:
    """One line of the evaluation dict for the terminal (``on``: which conversations it is about); what was not
    measured says why instead of a NaN."""
    dropped = f", {ev['dropped']} dropped: no assistant token within max_len" if ev.get("dropped") else ""
    if ev["tokens"]:
        bpb = f"{ev['bpb']:.3f}" if ev.get("bpb") is not None else "n/a"
        scores = (f"loss {ev['loss']:.4f} nats/token, {bpb} bits per byte, token accuracy "
                  f"{ev['token_accuracy']:.1%}")
    else:
        scores = "no loss: no assistant token to score"
    if ev["prompts"]:
        replies = (f"greedy replies to {ev['prompts']} prompts: end of turn {ev['end_of_turn_rate']:.1%}, exact "
                   f"match {ev['exact_match']:.1%}")
    else:
        replies = "no greedy replies (" + ("eval_prompts 0)" if ev["conversations"] else "no conversation to answer)")
    return f"{on} ({ev['conversations']} conversations{dropped}, {ev['tokens']} assistant tokens): {scores}; {replies}"


# ---------------------------------------------------------------------------------------------------------
# finetune
# ---------------------------------------------------------------------------------------------------------


@dataclass
class FinetuneSummary(Summary):
    """What :func:`finetune` reports (losses in nats per supervised token), as attributes or as the mapping of
    ``summary.json`` (``summary["steps"]``).

    Attributes:
        steps: optimizer steps done; train_loss: mean step loss of the last min(50, steps) steps;
        train_losses: every step's loss; val_history: [(step, val_loss)];
        evaluation: :func:`evaluate_chat`'s dict on the held-out conversations (or the training ones when
            there are none, ``eval_on`` says which);
        train_conversations / val_conversations: conversations trained on (those with a supervised token
            within max_len + 1 tokens) / held out; truncated / dropped: conversations cut to max_len + 1 tokens
            / dropped for having no supervised token left (training and validation together);
        template: the chat template's name; added_tokens: special tokens added to the base vocabulary;
        device: where the model trained and the evaluation ran ("cpu", "cuda:0", ...).
    """

    steps: int
    train_loss: float
    train_losses: list[float]
    val_history: list[tuple[int, float]]
    evaluation: dict
    eval_on: str
    train_conversations: int
    val_conversations: int
    truncated: int
    dropped: int
    template: str
    added_tokens: list[str]
    num_parameters: int
    train_seconds: float
    run_dir: str | None
    is_global_zero: bool = True
    device: str | None = None


def finetune(data=None, *, out: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
             preset: str | None = None, template: str | ChatTemplate | None = None, val_data=None,
             val_fraction: float | None = None, tokenizer: str | Tokenizer | None = None, vocab_size: int | None = None,
             model_overrides: dict | None = None, train_config: TrainConfig | None = None,
             config_overrides: dict | None = None, resume: str | os.PathLike | bool | None = None,
             devices: int | str = 1, strategy: str = "auto", num_nodes: int = 1, accelerator: str = "auto",
             eval_max_new_tokens: int = 64, eval_prompts: int | None = 100, callbacks: Sequence[L.Callback] = (),
             progress_bar: bool | str = True, logger: bool = True, base_model=None):
    """Fine-tune a model on conversations; return ``(model, tokenizer, summary)`` (:class:`FinetuneSummary`).

    Start from a base ``checkpoint``, an in-memory ``base_model=(model, tokenizer)``, or a ``preset`` from
    scratch (a ``tokenizer`` kind, default "char", built from the data's text); the ``template``'s (default
    "decoderlab") special tokens are added (:func:`decoderlab.chat.add_chat_tokens`). ``data``, ``val_data``:
    JSONL paths or lists of conversations; ``val_fraction`` (default 0.1; 0: evaluate on the training data) of
    ``data`` is held out, seeded, without ``val_data``. Training follows the module docstring with
    ``train_config`` (default ``TrainConfig(**FINETUNE_DEFAULTS)``, + ``config_overrides``; ``batch_size``:
    conversations per micro-batch per process); Lightning's ``devices``, ``strategy``, ``num_nodes``,
    ``accelerator``. ``out`` becomes the run directory (:mod:`decoderlab.training.run`) and a chat checkpoint
    storing the template; at the end :func:`evaluate_chat` is printed (``eval_prompts`` greedy replies).
    ``resume`` (a run directory, a ``.ckpt``, or True for ``out``) continues the run with its own model,
    tokenizer, template, data and settings as ``train_lm`` does: train settings changed are honoured from the
    next step, and another seed, accumulate, template, val_fraction, data or starting point is refused.

    Raises:
        ValueError: bad data (file, line and what); an unknown template; not exactly one starting point; a
            tokenizer that cannot represent the data (naming the characters); no conversation left to train
            on, or none with a supervised token within max_len; bad config values; a refused resume change.
        FileNotFoundError: missing files. FileExistsError: a new run's ``out`` holds files.
    """
    if sum(x is not None for x in (checkpoint, preset, base_model)) != 1 and resume in (None, False):
        raise ValueError("give exactly one starting point: checkpoint (a base checkpoint directory) or preset "
                         "(train from scratch)")
    run = plan_run(out, resume, train_config, config_overrides, TrainConfig(**FINETUNE_DEFAULTS))
    check_run_options(run.cfg, strategy, accelerator)  # the machine's refusals before the data is read
    template = _template(run, template)
    data_info, train_convs, val_convs = _conversations(run, data, val_data, val_fraction)
    L.seed_everything(run.cfg.seed, verbose=False)
    model, tok, start = _starting_point(run, checkpoint, preset, base_model, tokenizer, vocab_size,
                                        model_overrides, template, train_convs + val_convs)
    run.announce()  # every refusal is behind us
    train_ex, val_ex = _examples(train_convs, val_convs, tok, template, model.config.max_len)
    dm = SFTDataModule(train_ex, val_ex, batch_size=run.cfg.batch_size, accumulate=run.cfg.accumulate,
                       seed=run.cfg.seed, pad_id=pad_id_for(tok, template), val_batch_size=run.cfg.val_batch_size)
    exporter = ExportCheckpoint(run.run_dir, tok, {"task": "chat", CHAT_TEMPLATE_KEY: template.to_dict(),
                                                   "tokenizer": tok.kind, "base": start["checkpoint"],
                                                   "preset": start["preset"]})
    launch = dict(devices=devices, strategy=strategy, num_nodes=num_nodes)
    trainer = make_trainer(run.cfg, run.run_dir, accelerator=accelerator, progress_bar=progress_bar, logger=logger,
                           callbacks=[NonFiniteLossGuard(run.run_dir), exporter, ShareRunDirectory(run),
                                      InterruptNotice(run.run_dir, "finetune"), *callbacks], **launch)
    run.record(trainer, model.config, tok, launch, task="chat", template=template.name, **data_info, **start)
    module = SFTModule(model, run.cfg)
    seconds = fit_run(trainer, module, run, datamodule=dm)
    model, summary = _summarize(trainer, run, module.model, tok, template, exporter, (train_convs, val_convs),
                                (train_ex, val_ex), start["added_tokens"], seconds,
                                dict(max_new_tokens=eval_max_new_tokens, max_prompts=eval_prompts))
    if trainer.is_global_zero and (progress_bar or logger):
        print(f"fine-tuned for {summary.steps} steps; {format_evaluation(summary.evaluation, summary.eval_on)}")
    return model.eval(), tok, summary


def _sha256(*conversation_sets) -> str:
    """A digest of the conversations (and held-out ones) a run was fine-tuned on."""
    sets = [list(c) for c in conversation_sets if c is not None]
    return hashlib.sha256(json.dumps(sets).encode("utf-8")).hexdigest()


def _path_or_none(data) -> str | None:
    return str(Path(data).resolve()) if isinstance(data, (str, os.PathLike)) else None


def _template(run: Run, template) -> ChatTemplate:
    """The run's chat template: the one given (default "decoderlab"); on a resume the stored one, refusing
    another."""
    given = None if template is None else get_template(template)  # an unknown name lists the known ones
    if not run.resumed:
        return given or get_template(DEFAULT_TEMPLATE)
    stored = template_from_meta(read_meta(run.run_dir)) or get_template(run.info.get("template"))
    run.keep("template", None if given is None else given.name, why="the model learned its tokens and layout")
    if given is not None and given != stored:
        raise ValueError(f"cannot resume {run.run_dir} with another {given.name!r} template than the one it was "
                         f"trained with; resume without a template, or start a new run")
    return stored


def _conversations(run: Run, data, val_data, val_fraction) -> tuple[dict, list, list]:
    """``(what run.json records of the data, training conversations, held-out conversations)``: ``val_data``,
    or the seeded ``val_fraction`` of ``data``; on a resume the run's own data (refusing other conversations)
    and fraction."""
    if run.resumed:
        data = run.info.get("data") if data is None else data
        val_data = run.info.get("val_data") if val_data is None else val_data
    if data is None:
        raise ValueError(f"cannot resume {run.run_dir} without data: it was fine-tuned on conversations given as a "
                         f"list, which run.json does not hold; give the same conversations as data" if run.resumed
                         else "give the conversations to fine-tune on: data, a JSONL path or a list of conversations")
    convs = as_conversations(data)
    held = None if val_data is None else as_conversations(val_data)
    digest = _sha256(convs, held)
    if run.resumed and run.info.get("data_sha256") not in (None, digest):
        raise ValueError(f"cannot resume {run.run_dir}: the conversations differ from those it was fine-tuned on "
                         f"({run.info.get('data')!r}); resume with the same data, or start a new run")
    fraction = run.keep("val_fraction", val_fraction, default=FINETUNE_VAL_FRACTION,
                        why="it defines the held-out conversations")
    if isinstance(fraction, bool) or not (isinstance(fraction, (int, float)) and 0 <= fraction < 1):
        raise ValueError(f"val_fraction must be in [0, 1), got {fraction!r}")
    info = {"data": _path_or_none(data), "val_data": _path_or_none(val_data), "val_fraction": fraction,
            "data_sha256": digest}
    if held is not None:
        return info, list(convs), list(held)
    return (info, *_split(convs, fraction, run.cfg.seed))


def _split(convs: Conversations, fraction: float, seed: int) -> tuple[list, list]:
    """``(training, held out)``: a seeded ``fraction`` of the conversations held out (at least one, and never
    all). Raises ``ValueError`` when the fraction would leave none to train on."""
    n = len(convs)
    if fraction <= 0 or n < 2:
        return list(convs), []
    k = max(1, int(round(fraction * n)))
    if k >= n:
        raise ValueError(f"val_fraction={fraction:g} holds out {k} of the {n} conversations and leaves none to train "
                         f"on; use a smaller val_fraction, or give the held-out conversations as val_data")
    order = np.random.default_rng(seed).permutation(n)
    held = set(order[:k].tolist())
    return [c for i, c in enumerate(convs) if i not in held], [c for i, c in enumerate(convs) if i in held]


def _starting_point(run: Run, checkpoint, preset, base_model, tokenizer, vocab_size, model_overrides,
                    template: ChatTemplate, convs: list) -> tuple:
    """``(model, tokenizer, start)`` with the template's tokens added; ``start`` is what run.json records:
    the base ``checkpoint`` (resolved), the ``preset`` and the ``added_tokens``. A resume builds the run's own
    model (its config.json; the weights come with the Lightning checkpoint) and tokenizer, refusing another
    starting point, tokenizer or shape."""
    checkpoint = None if checkpoint is None else str(Path(checkpoint).resolve())
    if run.resumed:
        keep = "a resumed run keeps its model and tokenizer"
        given = {"base_model": base_model, "tokenizer": tokenizer, "vocab_size": vocab_size,
                 "model_overrides": model_overrides}
        if any(v is not None for v in given.values()):
            named = ", ".join(k for k, v in given.items() if v is not None)
            raise ValueError(f"cannot resume {run.run_dir} with {named}: {keep}; resume without it, or start a new run")
        start = {"checkpoint": run.keep("checkpoint", checkpoint, why=keep),
                 "preset": run.keep("preset", preset, why=keep), "added_tokens": run.info.get("added_tokens", [])}
        return DecoderOnlyTransformer(read_config(run.run_dir)), Tokenizer.load(run.run_dir / TOKENIZER_FILE), start
    if base_model is not None:
        model, tok = base_model
    elif checkpoint is not None:
        model, tok = load_checkpoint(checkpoint)
    else:
        text = "\n".join(message_text(m) for c in convs for m in c)
        tok = tokenizer if isinstance(tokenizer, Tokenizer) else build_tokenizer(tokenizer or DEFAULT_TOKENIZER,
                                                                                 text, vocab_size)
        shape = {**(model_overrides or {}), "num_tokens": tok.vocab_size}
        model = DecoderOnlyTransformer(preset_config(preset, **shape))
    check_representable(as_conversations(convs), tok)
    model, tok, added = add_chat_tokens(model, tok, template)
    return model.train(), tok, {"checkpoint": checkpoint, "preset": preset, "added_tokens": added}


def _examples(train_convs: list, val_convs: list, tok, template: ChatTemplate, max_len: int):
    """``(training Examples, held-out Examples or None)``; says how many were truncated or dropped."""
    train_ex = build_examples(train_convs, tok, template, max_len)
    val_ex = build_examples(val_convs, tok, template, max_len) if val_convs else None
    truncated = train_ex.truncated + (val_ex.truncated if val_ex else 0)
    dropped = train_ex.dropped + (val_ex.dropped if val_ex else 0)
    if not train_ex.rows:
        raise ValueError(f"no supervised token in the training data: all {len(train_convs)} conversations have "
                         f"their assistant turns beyond max_len={max_len} tokens; use shorter conversations or a "
                         f"model with a longer context")
    if truncated or dropped:
        print(f"decoderlab: {truncated} conversation(s) longer than max_len + 1 = {max_len + 1} tokens were "
              f"truncated; {dropped} with no assistant token left were dropped", file=sys.stderr)
    return train_ex, val_ex


def _summarize(trainer, run: Run, model, tok, template: ChatTemplate, exporter, convs: tuple, examples: tuple,
               added: list, seconds: float, eval_options: dict) -> tuple:
    """``(the model to return, the summary)``: the evaluation and the final export on the device the model
    trained on (rank 0, the whole weights under FSDP; on the held-out conversations, else the training ones),
    then the summary (and ``summary.json``)."""
    (train_convs, val_convs), (train_ex, val_ex) = convs, examples
    eval_convs, eval_on = (val_convs, "held-out") if val_convs else (train_convs, "train")
    evaluation: dict = {}
    with on_training_device(trainer, model) as (whole, device):  # every process enters (a collective under FSDP)
        if whole is not None:
            model = whole.eval()
            evaluation = evaluate_chat(model, tok, template, eval_convs, **eval_options)
            exporter.meta.update(evaluation=dict(evaluation), eval_on=eval_on)
            exporter.export(trainer, model)
    module = trainer.lightning_module
    summary = FinetuneSummary(
        steps=trainer.global_step, train_loss=mean_of_last(module.losses)[0], train_losses=list(module.losses),
        val_history=list(module.val_history), evaluation=evaluation, eval_on=eval_on,
        train_conversations=len(train_ex.rows), val_conversations=len(val_ex.rows) if val_ex else 0,
        truncated=train_ex.truncated + (val_ex.truncated if val_ex else 0),
        dropped=train_ex.dropped + (val_ex.dropped if val_ex else 0), template=template.name, added_tokens=added,
        num_parameters=model.num_parameters(), train_seconds=seconds, run_dir=str(run.run_dir),
        is_global_zero=trainer.is_global_zero, device=str(device))
    run.write_summary(trainer, summary)
    return model, summary
