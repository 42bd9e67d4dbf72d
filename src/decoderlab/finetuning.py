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

import dataclasses
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import lightning as L
import numpy as np
import torch

from .chat import (CHAT_TEMPLATE_KEY, ChatTemplate, Conversations, add_chat_tokens, as_conversations,
                   check_representable, get_template, stream_chat_reply, template_from_meta)
from .checkpoint import CONFIG_FILE, TOKENIZER_FILE, check_output_dir, load_checkpoint, read_meta, unwrap_model
from .files import atomic_write_text
from .config.train import FINETUNE_TRAIN
from .model import DecoderOnlyTransformer, ModelConfig
from .model import preset as preset_config
from .tokenizers import Tokenizer, build_tokenizer
from .training import (RUN_FILE, SUMMARY_FILE, ExportCheckpoint, InterruptNotice, NonFiniteLossGuard, TrainConfig,
                       fit, make_trainer, resolve_resume)
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

    Teacher-forced over every conversation (truncated to max_len + 1 tokens): ``loss`` (mean nats per
    supervised token: assistant content + end of turn), ``bpb`` (the summed loss / ln 2 / UTF-8 bytes of the
    supervised assistant text), ``token_accuracy`` (argmax == target over supervised tokens). Greedy replies to
    the first ``max_prompts`` conversations' last user turn (with the history before it), through
    :func:`decoderlab.chat.stream_chat_reply`: ``end_of_turn_rate`` (share whose reply ends with the end of
    turn within ``max_new_tokens``) and ``exact_match`` (reply == reference after stripping whitespace).
    Returns a dict of these plus the counts ``conversations``, ``tokens``, ``prompts``.
    """
    model = unwrap_model(model)
    was_training = model.training
    model.eval()
    try:
        ex = build_examples(conversations, tokenizer, template, model.config.max_len)
        pad = pad_id_for(tokenizer, template)
        ce_sum, count, correct = 0.0, 0, 0
        for i in range(0, len(ex.rows), batch_size):
            x, y = collate(ex.rows[i : i + batch_size], pad)
            logits = model(x)
            ce, n = masked_ce_sum(logits, y)
            ce_sum += float(ce)
            count += int(n)
            sel = y != IGNORE_INDEX
            correct += int((logits.argmax(-1)[sel] == y[sel]).sum())
        prompts = conversations if max_prompts is None else conversations[:max_prompts]
        ended = exact = 0
        for conv in prompts:
            info: dict = {}
            reply = "".join(stream_chat_reply(model, tokenizer, conv[:-1], template, max_new_tokens=max_new_tokens,
                                              temperature=0.0, info=info))
            ended += bool(info["ended_with_end_of_turn"])
            exact += reply.strip() == conv[-1]["content"].strip()
    finally:
        model.train(was_training)
    loss = ce_sum / count if count else float("nan")
    return {
        "loss": loss,
        "bpb": ce_sum / (math.log(2) * ex.bytes) if ex.bytes else None,
        "token_accuracy": correct / count if count else float("nan"),
        "end_of_turn_rate": ended / len(prompts) if prompts else float("nan"),
        "exact_match": exact / len(prompts) if prompts else float("nan"),
        "conversations": len(conversations), "tokens": count, "prompts": len(prompts),
    }


def format_evaluation(ev: dict, on: str = "held-out") -> str:
    """One line of the evaluation dict for the terminal (``on``: which conversations it is about)."""
    bpb = f"{ev['bpb']:.3f}" if ev.get("bpb") is not None else "n/a"
    return (f"{on} ({ev['conversations']} conversations, {ev['tokens']} assistant tokens): loss "
            f"{ev['loss']:.4f} nats/token, {bpb} bits per byte, token accuracy {ev['token_accuracy']:.1%}; "
            f"greedy replies to {ev['prompts']} prompts: end of turn {ev['end_of_turn_rate']:.1%}, exact match "
            f"{ev['exact_match']:.1%}")


# ---------------------------------------------------------------------------------------------------------
# finetune
# ---------------------------------------------------------------------------------------------------------


@dataclass
class FinetuneSummary:
    """What :func:`finetune` reports (losses in nats per supervised token).

    Attributes:
        steps: optimizer steps done; train_loss: mean step loss of the last min(50, steps) steps;
        train_losses: every step's loss; val_history: [(step, val_loss)];
        evaluation: :func:`evaluate_chat`'s dict on the held-out conversations (or the training ones when
            there are none, ``eval_on`` says which);
        train_conversations / val_conversations: counts; truncated / dropped: conversations cut to max_len + 1
            tokens / dropped for having no supervised token left (training and validation together);
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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _split(convs: Conversations, fraction: float, seed: int) -> tuple[list, list]:
    n = len(convs)
    if fraction <= 0 or n < 2:
        return list(convs), []
    k = max(1, int(round(fraction * n)))
    order = np.random.default_rng(seed).permutation(n)
    held = set(order[:k].tolist())
    return [c for i, c in enumerate(convs) if i not in held], [c for i, c in enumerate(convs) if i in held]


def finetune(
    data,
    *,
    out: str | os.PathLike,
    checkpoint: str | os.PathLike | None = None,
    preset: str | None = None,
    template: str | ChatTemplate = "decoderlab",
    val_data=None,
    val_fraction: float = 0.1,
    tokenizer: str | Tokenizer = "char",
    vocab_size: int | None = None,
    model_overrides: dict | None = None,
    train_config: TrainConfig | None = None,
    config_overrides: dict | None = None,
    resume: str | os.PathLike | bool | None = None,
    devices: int | str = 1,
    strategy: str = "auto",
    num_nodes: int = 1,
    accelerator: str = "auto",
    eval_max_new_tokens: int = 64,
    eval_prompts: int | None = 100,
    callbacks: Sequence[L.Callback] = (),
    progress_bar: bool = True,
    logger: bool = True,
    base_model=None,
):
    """Fine-tune a model on conversations; return ``(model, tokenizer, summary)``.

    Start from a base checkpoint (``checkpoint``, or an in-memory ``base_model=(model, tokenizer)``) or from
    scratch (``preset``, with a ``tokenizer`` kind built from the data's text). The template's special tokens
    are added to the tokenizer and the embedding (and untied head) resized (:func:`decoderlab.chat.
    add_chat_tokens`). Training follows the module docstring (masked loss, shift in
    :func:`shift_for_training`, exact per-step normalisation over accumulation and processes), with
    ``train_config`` (default ``TrainConfig(**FINETUNE_DEFAULTS)``; + ``config_overrides``) as
    ``decoderlab.training.TrainConfig`` (``batch_size`` counts
    conversations per micro-batch per process; ``val_fraction`` / ``val_batches`` of it are unused: the
    held-out split is ``val_fraction`` here, or ``val_data``).

    ``out`` becomes a run directory and a chat checkpoint: ``model.safetensors``, ``config.json``,
    ``tokenizer.json`` (with the special tokens), ``meta.json`` (``"task": "chat"``, ``"chat_template"``),
    ``run.json``, ``summary.json`` (:class:`FinetuneSummary`, with the evaluation), ``lightning/`` (for
    ``resume``) and ``logs/``. The evaluation (:func:`evaluate_chat`) is printed at the end.

    Args:
        data, val_data: JSONL paths (or lists of conversations). val_fraction: share of ``data`` held out
            (seeded) when ``val_data`` is None; 0 holds nothing out and evaluates on the training data.

    Raises:
        ValueError: bad data (file, line and what); an unknown template (listing the known ones); both or
            neither of checkpoint/preset; a tokenizer that cannot represent the data (naming the characters);
            no supervised token in the data after truncation; bad config values.
        FileNotFoundError: missing files.
    """
    template = get_template(template)
    if sum(x is not None for x in (checkpoint, preset, base_model)) != 1 and resume is None:
        raise ValueError("give exactly one starting point: checkpoint (a base checkpoint directory) or preset "
                         "(train from scratch)")
    if not (isinstance(val_fraction, (int, float)) and 0 <= val_fraction < 1):
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    cfg = train_config if train_config is not None else TrainConfig(**FINETUNE_DEFAULTS)
    if config_overrides:
        cfg = cfg.replace(**config_overrides)
    cfg.validate()
    check_run_options(cfg, strategy, accelerator)  # the machine's refusals before the data is read
    run_dir = Path(out)
    resumed = resolve_resume(resume, run_dir)
    convs = as_conversations(data)
    if val_data is not None:
        train_convs, val_convs = list(convs), list(as_conversations(val_data))
    else:
        train_convs, val_convs = _split(convs, val_fraction, cfg.seed)

    # model and tokenizer
    L.seed_everything(cfg.seed, verbose=False)
    added: list[str] = []
    if resumed is not None:
        run_dir, ckpt_path = resumed
        tok = Tokenizer.load(run_dir / TOKENIZER_FILE)
        model = DecoderOnlyTransformer(ModelConfig.from_json((run_dir / CONFIG_FILE).read_text(encoding="utf-8")))
        stored = template_from_meta(read_meta(run_dir))
        if stored is not None and stored != template:
            raise ValueError(f"cannot resume {run_dir} with template {template.name!r}: it was fine-tuned with "
                             f"{stored.name!r}")
    else:
        ckpt_path = None
        if not os.environ.get("LOCAL_RANK"):  # a new run never overwrites a checkpoint or any other file
            check_output_dir(run_dir, new_run=True)
        if base_model is not None:
            model, tok = base_model
        elif checkpoint is not None:
            model, tok = load_checkpoint(checkpoint)
        else:
            text = "\n".join(m["content"] for c in convs for m in c)
            if val_data is not None:
                text += "\n" + "\n".join(m["content"] for c in val_convs for m in c)
            tok = tokenizer if isinstance(tokenizer, Tokenizer) else build_tokenizer(tokenizer, text, vocab_size)
            model = DecoderOnlyTransformer(preset_config(preset, **{**(model_overrides or {}),
                                                                     "num_tokens": tok.vocab_size}))
        check_representable(convs, tok)
        if val_data is not None:
            check_representable(as_conversations(val_data), tok)
        model, tok, added = add_chat_tokens(model, tok, template)
    model.train()
    max_len = model.config.max_len
    train_ex = build_examples(train_convs, tok, template, max_len)
    val_ex = build_examples(val_convs, tok, template, max_len) if val_convs else None
    truncated = train_ex.truncated + (val_ex.truncated if val_ex else 0)
    dropped = train_ex.dropped + (val_ex.dropped if val_ex else 0)
    if not train_ex.rows:
        raise ValueError(f"no supervised token in the training data: all {len(train_convs)} conversations have "
                         f"their assistant turns beyond max_len={max_len} tokens (or none); use shorter "
                         f"conversations or a model with a longer context")
    if truncated or dropped:
        print(f"decoderlab: {truncated} conversation(s) longer than max_len + 1 = {max_len + 1} tokens were "
              f"truncated; {dropped} with no assistant token left were dropped", file=sys.stderr)

    pad = pad_id_for(tok, template)
    dm = SFTDataModule(train_ex, val_ex, batch_size=cfg.batch_size, accumulate=cfg.accumulate, seed=cfg.seed,
                       pad_id=pad, val_batch_size=cfg.val_batch_size)
    module = SFTModule(model, cfg)
    meta = {"task": "chat", CHAT_TEMPLATE_KEY: template.to_dict(), "tokenizer": tok.kind,
            "base": None if checkpoint is None else str(Path(checkpoint).resolve()), "preset": preset}
    exporter = ExportCheckpoint(run_dir, tok, meta)
    trainer = make_trainer(cfg, run_dir, devices=devices, strategy=strategy, num_nodes=num_nodes,
                           accelerator=accelerator,
                           callbacks=[NonFiniteLossGuard(run_dir), exporter, InterruptNotice(run_dir, "finetune"), *callbacks],
                           progress_bar=progress_bar, logger=logger)
    if trainer.is_global_zero and resumed is None:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / CONFIG_FILE, model.config.to_json())
        tok.save(run_dir / TOKENIZER_FILE)
        atomic_write_text(run_dir / RUN_FILE, json.dumps({
            "task": "chat", "data": str(data) if isinstance(data, (str, os.PathLike)) else None,
            "val_data": str(val_data) if isinstance(val_data, (str, os.PathLike)) else None,
            "template": template.name, "checkpoint": meta["base"], "preset": preset,
            "val_fraction": val_fraction, "train_config": cfg.to_dict(), "devices": devices,
            "strategy": strategy}, indent=2))
    env_set = "DECODERLAB_RUN_DIR" not in os.environ
    if env_set:
        os.environ["DECODERLAB_RUN_DIR"] = str(run_dir)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*(does not have many workers|exists and is not empty|"
                                                      r"LeafSpec|resuming from a checkpoint that ended).*")
            fit(trainer, module, datamodule=dm, ckpt_path=str(ckpt_path) if ckpt_path else None, weights_only=False)
    finally:
        if env_set:
            os.environ.pop("DECODERLAB_RUN_DIR", None)
    seconds = time.perf_counter() - t0
    model = module.model
    eval_convs, eval_on = (val_convs, "held-out") if val_convs else (train_convs, "train")
    evaluation: dict = {}
    with on_training_device(trainer, model) as (final, device):  # (whole weights on rank 0 under FSDP)
        if final is not None:
            final.eval()
            evaluation = evaluate_chat(final, tok, template, eval_convs, max_new_tokens=eval_max_new_tokens,
                                       max_prompts=eval_prompts)
            exporter.meta.update(evaluation={k: v for k, v in evaluation.items()}, eval_on=eval_on)
            exporter.export(trainer, final)
            model = final
    model.eval()
    last = module.losses[-50:]
    summary = FinetuneSummary(
        steps=trainer.global_step, train_loss=sum(last) / len(last) if last else float("nan"),
        train_losses=list(module.losses), val_history=list(module.val_history), evaluation=evaluation,
        eval_on=eval_on, train_conversations=len(train_ex.rows), val_conversations=len(val_convs),
        truncated=truncated, dropped=dropped, template=template.name, added_tokens=added,
        num_parameters=model.num_parameters(), train_seconds=seconds, run_dir=str(run_dir),
        is_global_zero=trainer.is_global_zero, device=str(device))
    if trainer.is_global_zero:
        atomic_write_text(run_dir / SUMMARY_FILE, json.dumps(summary.to_dict(), indent=2))
        if progress_bar or logger:
            print(f"fine-tuned for {summary.steps} steps; {format_evaluation(evaluation, eval_on)}")
    return model, tok, summary
