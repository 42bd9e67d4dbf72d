"""Supervised fine-tuning (SFT, ``method="sft"``): conversations -> masked rows -> the step-normalised
cross-entropy -> a chat checkpoint with its held-out evaluation. The room of the method: its data, rows,
batches, Lightning module, evaluation, summary, and its parts for :func:`~decoderlab.finetuning.finetune`
(:data:`SFT`).

1. conversations (:func:`decoderlab.chat.as_conversations`) and their held-out split (:func:`conversations_of`);
2. :func:`build_examples` -- each rendered with the chat template, ``(ids, mask)``, and shifted once
   (:func:`decoderlab.training.rows.shift_for_training`: only assistant tokens and the end of turn after them are
   targets), cut to max_len + 1 tokens; rows left with no target are dropped and counted;
3. :class:`SFTBatches` -- the step-exact schedule (:class:`~decoderlab.training.rows.StepBatches`); every
   micro-batch carries the number of supervised tokens of its whole step (all micro-batches, all processes),
   padded with a pad id that is never the end of turn (labels -100 there);
4. :class:`SFTModule` -- ``sum of per-token cross-entropy / supervised tokens of the step``, so the loss (and
   gradient) of an optimizer step is the mean over every supervised token of the step, not a mean of
   per-batch means (scaled by accumulate * world_size only to undo Lightning's division by accumulate and DDP's
   gradient averaging);
5. :func:`evaluate_chat` on held-out conversations: loss and bits per byte over assistant tokens, token
   accuracy, end-of-turn rate and exact match of greedy replies; :class:`FinetuneSummary`.

Sources: the masked-loss SFT recipe as in nanochat ``chat_sft``, litgpt ``finetune`` and TRL ``SFTTrainer``
(prompt tokens at -100); per-token normalisation across accumulation as discussed in Hugging Face
transformers' gradient-accumulation fix (2024).
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..chat import ChatTemplate, as_conversations, fit_messages, stream_chat_reply
from ..checkpoint import unwrap_model
from ..config.defaults import FINETUNE_VAL_FRACTION
from ..tokenizers import Tokenizer
from ..training import LitModel, Run, Summary, TrainConfig, mean_of_last
from ..training.rows import (IGNORE_INDEX, StepBatches, StepDataModule, chunked_ce_sum, collate, head_chunk_rows,
                             pack_rows, segment_mask, shift_for_training, supervised_count)
from ..training.strategy import on_training_device
from ..training.sums import host_column_sums, sum_over_ranks
from .method import Job, Method
from .start import held_out_fraction, pad_id_for, path_or_none, sha256_of, split_held_out

# ---------------------------------------------------------------------------------------------------------
# The data and its rows
# ---------------------------------------------------------------------------------------------------------


def conversations_of(run: Run, data, val_data, val_fraction) -> tuple[dict, list, list]:
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
    digest = sha256_of(convs, held)
    if run.resumed and run.info.get("data_sha256") not in (None, digest):
        raise ValueError(f"cannot resume {run.run_dir}: the conversations differ from those it was fine-tuned on "
                         f"({run.info.get('data')!r}); resume with the same data, or start a new run")
    fraction = held_out_fraction(run, val_fraction, FINETUNE_VAL_FRACTION)
    info = {"data": path_or_none(data), "val_data": path_or_none(val_data), "val_fraction": fraction,
            "data_sha256": digest}
    if held is not None:
        return info, list(convs), list(held)
    return (info, *split_held_out(convs, fraction, run.cfg.seed))


@dataclass
class Examples:
    """Training rows of a set of conversations. ``rows``: [(inputs, labels)]; ``truncated``: conversations
    longer than max_len + 1 tokens (cut); ``dropped``: conversations with no supervised token left after
    the cut (not in ``rows``); ``bytes``: UTF-8 bytes of the assistant text the supervised targets stand for
    (end-of-turn tokens count 0)."""

    rows: list[tuple[list[int], list[int]]]
    conversations: list[int]
    truncated: int
    dropped: int
    bytes: int

    @property
    def supervised(self) -> int:
        return sum(supervised_count(y) for _, y in self.rows)


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


def sft_examples(train_convs: list, val_convs: list, tok, template: ChatTemplate, max_len: int):
    """``(training Examples, held-out Examples or None)``; says how many were truncated or dropped."""
    train_ex = build_examples(train_convs, tok, template, max_len)
    val_ex = build_examples(val_convs, tok, template, max_len) if val_convs else None
    truncated = train_ex.truncated + (val_ex.truncated if val_ex else 0)
    dropped = train_ex.dropped + (val_ex.dropped if val_ex else 0)
    if not train_ex.rows:
        raise ValueError(f"no supervised token in the training data: all {len(train_convs)} conversations have "
                         f"their assistant turns beyond max_len={max_len} tokens; use shorter conversations or a "
                         f"model with a longer context")
    ex, convs = (val_ex, val_convs) if val_ex else (train_ex, train_convs)  # what the evaluation will answer
    check_eval_prompts(tok, template, [convs[i] for i in ex.conversations], max_len, None)  # before any step
    if truncated or dropped:
        print(f"decoderlab: {truncated} conversation(s) longer than max_len + 1 = {max_len + 1} tokens were "
              f"truncated; {dropped} with no assistant token left were dropped", file=sys.stderr)
    total = len(train_convs) + len(val_convs or ())
    if 2 * truncated > total:
        warnings.warn(f"MOST CONVERSATIONS DO NOT FIT: {truncated} of {total} are longer than the model's context "
                      f"(max_len={max_len} tokens) and are cut, so the model learns answers without their ends "
                      f"and chat drops old turns; fine-tune a base with a longer context (the recipe's chat base "
                      f"has 256, docs/finetuning.md) or use shorter conversations", UserWarning, stacklevel=2)
    return train_ex, val_ex


class SFTBatches(StepBatches):
    """Micro-batch number k -> ``(inputs, labels, step_supervised)`` for one process, on the step-exact schedule
    of :class:`~decoderlab.training.rows.StepBatches`. ``step_supervised`` (a 0-d int64 tensor) counts the
    supervised labels of all the step's rows, so each process knows the normaliser of the whole step without
    communicating."""

    def __init__(self, rows, batch_size: int, accumulate: int, seed: int, pad_id: int, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True, group_by_length: bool = False):
        super().__init__(rows, batch_size, accumulate, seed, pad_id, rank, world_size, shuffle, group_by_length)
        self.counts = np.array([supervised_count(y) for _, y in rows], dtype=np.int64)

    #: the length of a packed row (:func:`~decoderlab.training.rows.pack_rows`; a longer conversation sets its own)
    PACK_ROW = 256

    def batch(self, mine: list, step: np.ndarray):
        """``(inputs, labels, step_supervised, positions, segments, targets)``: the rows packed
        (:func:`~decoderlab.training.rows.pack_rows`: (R, L) tensors and the flat indices of the supervised
        labels)."""
        count = torch.tensor(int(self.counts[step].sum()), dtype=torch.long)
        x, y, positions, segments, targets = pack_rows(mine, self.pad_id, self.PACK_ROW)
        return x, y, count, positions, segments, targets


class SFTDataModule(StepDataModule):
    """Training micro-batches (:class:`SFTBatches`) and validation batches (held-out rows, shared out across
    processes) of :class:`Examples`; resumable (:class:`~decoderlab.training.rows.StepDataModule`)."""

    batches = SFTBatches


# ---------------------------------------------------------------------------------------------------------
# The Lightning module
# ---------------------------------------------------------------------------------------------------------


class SFTModule(LitModel):
    """:class:`~decoderlab.training.LitModel` for supervised fine-tuning: the model is ``self.model`` (no copy),
    the optimizer AdamW + warm-up/cosine from ``cfg`` (``LitModel.configure_optimizers``); the steps below
    replace the language-model loss with the masked, step-normalised one.

    ``training_step`` returns ``sum_ce * accumulate * world_size / max(step_supervised, 1)``: after Lightning's
    division by ``accumulate`` and DDP's averaging over processes, the gradient of an optimizer step is that of
    ``(sum of CE over all supervised tokens of the step) / (their count)``. ``losses`` records that exact
    step loss (summed over micro-batches and processes) for every optimizer step; validation logs the exact
    mean ``val_loss`` over all held-out supervised tokens.
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig):
        super().__init__(model, cfg)
        self.losses: list[float] = []
        self.val_history: list[tuple[int, float]] = []
        self._step_ce: list[torch.Tensor] = []  # the micro-batch sums of this step, on the device
        self._val: list[list[torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x, y, step_count, positions, segments, targets = batch
        # the logits of the supervised positions alone, a slice of rows at a time (the ids and positions come from
        # the tokenizer and packer)
        ce, _ = supervised_ce(self.model, x, y, select=targets, positions=positions,
                              attn_mask=None if segments is None else segment_mask(segments))
        # a step whose every target is masked has a loss of 0 (and no gradient), not 0 / 0
        n = step_count.clamp(min=1).to(ce.dtype)
        self._step_ce.append(ce.detach())
        acc, world = self.trainer.accumulate_grad_batches, self.trainer.world_size
        if (batch_idx + 1) % acc == 0:
            # the exact step loss, summed in float64 on the host (over micro-batches, then processes)
            (total,) = sum_over_ranks(self.trainer.strategy, host_column_sums([[c] for c in self._step_ce]))
            step_loss = total / max(int(step_count), 1)
            self.losses.append(step_loss)
            self._step_ce = []
            self.log("train_loss", step_loss, prog_bar=True, on_step=True, on_epoch=False, rank_zero_only=True,
                     batch_size=x.size(0))
        return ce * (acc * world) / n

    def on_validation_epoch_start(self):
        self._val = []

    def validation_step(self, batch, batch_idx):
        x, y = batch
        ce, _ = supervised_ce(self.model, x, y)
        self._val.append([ce.detach(), (y != IGNORE_INDEX).sum()])

    def on_validation_epoch_end(self):
        if self.trainer.sanity_checking:
            return
        nats, count = sum_over_ranks(self.trainer.strategy, (host_column_sums(self._val) + [0.0, 0.0])[:2])
        loss = nats / count if count else float("nan")
        self.log("val_loss", loss, prog_bar=True, sync_dist=False)
        self.val_history.append((self.trainer.global_step, loss))

    def on_save_checkpoint(self, checkpoint):
        checkpoint["sft_losses"] = list(self.losses)
        checkpoint["sft_val_history"] = [list(h) for h in self.val_history]

    def on_load_checkpoint(self, checkpoint):
        self.losses = list(checkpoint.get("sft_losses", []))
        self.val_history = [(int(s), float(v)) for s, v in checkpoint.get("sft_val_history", [])]


# ---------------------------------------------------------------------------------------------------------
# The held-out evaluation and the summary
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
            reply = "".join(stream_chat_reply(model, conv[:-1], tokenizer, template, max_new_tokens=max_new_tokens,
                                              temperature=0.0, info=info))
            ended += bool(info["ended_with_end_of_turn"])
            exact += reply.strip() == (conv[-1].get("content") or "").strip()
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


def check_eval_prompts(tokenizer: Tokenizer, template: ChatTemplate, conversations: Sequence, max_len: int,
                       max_prompts: int | None = 100) -> None:
    """Before training: each prompt :func:`evaluate_chat` will answer (the first ``max_prompts``
    conversations' history before their last reply) renders and fits ``max_len`` after the oldest exchanges
    are dropped (:func:`decoderlab.chat.fit_messages`), so that no data error waits for the end of the run.

    Raises:
        ValueError: naming the conversation (its index) and what is wrong with its prompt.
    """
    chosen = conversations if max_prompts is None else conversations[:max_prompts]
    for k, conv in enumerate(chosen):
        try:
            fit_messages(conv[:-1], tokenizer, template, max_len, 1)
        except ValueError as e:
            raise ValueError(f"evaluation prompt of conversation {k} (the history before its last reply): {e}") \
                from None


def _teacher_forced(model, ex: Examples, pad: int, batch_size: int) -> tuple[float, int, int]:
    """``(summed cross-entropy, supervised tokens, correct argmax predictions)`` over the rows of ``ex``."""
    ce_sum, count, correct = 0.0, 0, 0
    for i in range(0, len(ex.rows), batch_size):
        x, y = collate(ex.rows[i : i + batch_size], pad)
        ce, right = supervised_ce(model, x, y, accuracy=True)
        ce_sum += float(ce)
        count += int((y != IGNORE_INDEX).sum())
        correct += int(right)
    return ce_sum, count, correct


def supervised_ce(model, x: torch.Tensor, y: torch.Tensor, *, select: torch.Tensor | None = None,
                  accuracy: bool = False, **forward) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(summed cross-entropy, correct argmax predictions or None)`` of ``model`` over the supervised labels of
    (B, T) inputs ``x`` and shifted labels ``y`` (-100 elsewhere): the final norm and the output layer run on
    the supervised positions alone (``select``: their flat indices into B * T, found from ``y`` when None), their
    float32 logits and log-softmax a slice of rows at a time (:func:`~decoderlab.training.rows.chunked_ce_sum`),
    so no (B, T, V) or (K, V) logits tensor lives -- 1 GB at 1,024 positions of Gemma 3's 262,144-token
    vocabulary. ``forward``: more keywords of the model's forward (``positions``, ``attn_mask``)."""
    flat = y.reshape(-1)
    if select is None:
        select = (flat != IGNORE_INDEX).nonzero().squeeze(1)
    inner = unwrap_model(model)
    labels, rows = flat.index_select(0, select), head_chunk_rows(inner.config.num_tokens)
    frozen = not any(p.requires_grad for p in inner.fc_layer.parameters())  # (LoRA's; a block layer's)
    return model(x, select=select, check_ids=False, **forward, head=lambda project, hidden: chunked_ce_sum(
        project, hidden, labels, rows=rows, accuracy=accuracy, frozen=frozen))


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
        replies = (f"greedy replies to {_count(ev['prompts'], 'prompt')}: end of turn {ev['end_of_turn_rate']:.1%}, "
                   f"exact match {ev['exact_match']:.1%}")
    else:
        replies = "no greedy replies (" + ("eval_prompts 0)" if ev["conversations"] else "no conversation to answer)")
    counted = f"{_count(ev['conversations'], 'conversation')}{dropped}, {_count(ev['tokens'], 'assistant token')}"
    return f"{on} ({counted}): {scores}; {replies}"


def _count(n: int, noun: str) -> str:
    """"1 conversation", "7 conversations"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


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
        device: where the model trained and the evaluation ran ("cpu", "cuda:0", ...);
        trainable_parameters: the parameters that trained (all, or the LoRA adapters'); lora: the adapters'
            settings (None: none).
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
    trainable_parameters: int | None = None
    lora: dict | None = None


def summarize(job: Job, trainer, exporter, seconds: float) -> tuple:
    """``(the model to return, the summary)``: the evaluation and the final export on the device the model
    trained on (rank 0, the whole weights under FSDP; on the held-out conversations, else the training ones),
    then the summary (and ``summary.json``)."""
    module, run = trainer.lightning_module, job.run
    train_ex, val_ex = trainer.datamodule.train, trainer.datamodule.val  # (the rows it trained on)
    eval_convs, eval_on = (job.val_items, "held-out") if job.val_items else (job.train_items, "train")
    evaluation: dict = {}
    model = module.model
    with on_training_device(trainer, model) as (whole, device):  # every process enters (a collective under FSDP)
        if whole is not None:  # (a LoRA model as it trained: a merged copy over GGUF blocks is float32, 4x the file)
            model = whole.eval()
            evaluation = evaluate_chat(model, job.tokenizer, job.template, eval_convs, **job.eval_options)
            exporter.meta.update(evaluation=dict(evaluation), eval_on=eval_on)
            exporter.export(trainer, whole, final=True)  # (the merged model too, when asked)
    model = model.cpu()  # (as Lightning leaves a trained module)
    summary = FinetuneSummary(
        steps=trainer.global_step, train_loss=mean_of_last(module.losses)[0], train_losses=list(module.losses),
        val_history=list(module.val_history), evaluation=evaluation, eval_on=eval_on,
        train_conversations=len(train_ex.rows), val_conversations=len(val_ex.rows) if val_ex else 0,
        truncated=train_ex.truncated + (val_ex.truncated if val_ex else 0),
        dropped=train_ex.dropped + (val_ex.dropped if val_ex else 0), template=job.template.name,
        added_tokens=job.start["added_tokens"], num_parameters=model.num_parameters(), train_seconds=seconds,
        run_dir=str(run.run_dir), is_global_zero=trainer.is_global_zero, device=str(device),
        trainable_parameters=job.start["trainable_parameters"], lora=job.start["lora"])
    run.write_summary(trainer, summary)
    return model, summary


def train(job: Job, model) -> tuple:
    """``(datamodule, SFTModule)`` of the run's conversations (the datamodule holds their rows)."""
    examples = sft_examples(job.train_items, job.val_items, job.tokenizer, job.template, job.max_len)
    cfg = job.run.cfg
    dm = SFTDataModule(*examples, batch_size=cfg.batch_size, accumulate=cfg.accumulate, seed=cfg.seed,
                       pad_id=job.pad_id, val_batch_size=cfg.val_batch_size, group_by_length=cfg.group_by_length)
    return dm, SFTModule(model, cfg)


#: supervised fine-tuning's parts, for :func:`~decoderlab.finetuning.finetune`
SFT = Method(name="sft", option_names=(), options=lambda run, given: {}, read_data=conversations_of,
             texts=lambda convs: list(convs), train=train, summarize=summarize,
             closing=lambda s: f"fine-tuned for {_count(s.steps, 'step')}; "
                               f"{format_evaluation(s.evaluation, s.eval_on)}")
