"""Direct preference optimisation (DPO, ``method="dpo"``): TRL's preference rows -> both sides rendered with the
chat template -> pair batches on the step-exact schedule -> the DPO loss against the starting model, frozen ->
held-out reward margin and accuracy. The room of the method: its rows, loss, Lightning module, evaluation,
summary, and its parts for :func:`~decoderlab.finetuning.finetune` (:data:`DPO`).

**The rows.** One row per line of a JSONL file, each field as text or as messages (TRL's "standard" and
"conversational" preference formats; the two may be mixed)::

    {"prompt": "Name a colour.", "chosen": "Red.", "rejected": "Seven."}
    {"prompt": [{"role": "user", "content": "Name a colour."}],
     "chosen": [{"role": "assistant", "content": "Red."}], "rejected": [{"role": "assistant", "content": "7"}]}

A text ``prompt`` is one user turn; a text ``chosen`` / ``rejected`` is one assistant turn. As messages the
prompt is a conversation ending with a user turn and each completion continues it (starting with the
assistant). :func:`render_pair` renders ``prompt + chosen`` and ``prompt + rejected`` with the chat template
-- the one renderer -- with the loss mask on the completion's tokens only (an assistant turn inside the
prompt is context).

**The loss.** For a prompt x with a chosen reply y_w and a rejected one y_l, with log pi(y | x) the sum of the
reply's token log-probabilities under the model being trained and log ref(y | x) under the frozen reference::

    r_w  = beta * (log pi(y_w | x) - log ref(y_w | x))       implicit reward of the chosen reply
    r_l  = beta * (log pi(y_l | x) - log ref(y_l | x))       ... of the rejected one
    loss = -log sigmoid(r_w - r_l)                          averaged over the pairs of the optimizer step

The reward margin is ``r_w - r_l`` and the reward accuracy the share of pairs with ``r_w > r_l``. With
chosen == rejected the loss is log 2 and its gradient 0. Chosen and rejected rows of a micro-batch run
through the model as one batch (as TRL's ``concatenated_forward``). The reference model is the starting model,
frozen (:func:`decoderlab.training.module.frozen_copy`, taken before any LoRA adapter).

Sources: Rafailov et al. 2023, "Direct Preference Optimization"; TRL ``DPOTrainer`` (the preference dataset
formats, the sigmoid loss, the logged rewards/margins/accuracies).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..chat import ChatTemplate, check_messages, get_template
from ..config.defaults import DPO_BETA, FINETUNE_VAL_FRACTION
from ..jsonl import jsonl_rows
from ..tokenizers import Tokenizer
from ..training import LitModel, Run, Summary, TrainConfig, mean_of_last
from ..training.rows import (IGNORE_INDEX, Row, StepBatches, StepDataModule, collate, shift_for_training,
                             token_logprobs)
from ..training.strategy import on_training_device
from ..training.sums import sum_over_ranks
from .method import Job, Method
from .start import held_out_fraction, path_or_none, sha256_of, split_held_out

PREFERENCE_FIELDS = ("prompt", "chosen", "rejected")

# ---------------------------------------------------------------------------------------------------------
# The preference rows, read and rendered
# ---------------------------------------------------------------------------------------------------------


@dataclass
class PreferencePair:
    """One preference: ``prompt`` (messages ending with a user turn), ``chosen`` and ``rejected`` (messages
    continuing it, starting with the assistant), ``line`` (1-based line in the file, or position in a list)."""

    prompt: list[dict]
    chosen: list[dict]
    rejected: list[dict]
    line: int


def _is_empty(value) -> bool:
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, list):
        return not value or all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                and not m["content"].strip() for m in value)
    return False


def _as_messages(value, role: str, name: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return [{"role": m.get("role"), "content": m.get("content")} if isinstance(m, dict) else m for m in value]
    raise ValueError(f"\"{name}\" must be text or a list of messages, got {type(value).__name__}")


def parse_pair(obj, line: int) -> PreferencePair:
    """A :class:`PreferencePair` from one row (a dict with ``prompt``, ``chosen``, ``rejected``).

    Raises:
        ValueError: a missing field (naming it), an empty ``chosen`` or ``rejected``, extra keys, a prompt
            that does not end with a user turn, a completion that does not start with the assistant or breaks
            the turn order.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"a preference row must be a JSON object, got {type(obj).__name__}")
    missing = [f for f in PREFERENCE_FIELDS if f not in obj]
    if missing:
        raise ValueError(f"a preference row needs \"prompt\", \"chosen\" and \"rejected\"; this row lacks "
                         f"{', '.join(repr(m) for m in missing)} (it has {sorted(obj)})")
    extra = sorted(set(obj) - set(PREFERENCE_FIELDS))
    if extra:
        raise ValueError(f"unexpected key(s) {extra} in a preference row; allowed: {', '.join(PREFERENCE_FIELDS)}")
    for name in ("chosen", "rejected"):
        if _is_empty(obj[name]):
            raise ValueError(f"\"{name}\" is empty; a preference needs a non-empty {name} reply")
    prompt = _as_messages(obj["prompt"], "user", "prompt")
    check_messages(prompt, final="user")
    out = {}
    for name in ("chosen", "rejected"):
        completion = _as_messages(obj[name], "assistant", name)
        if completion[0].get("role") != "assistant":
            raise ValueError(f"\"{name}\" must start with an assistant message, got role "
                             f"{completion[0].get('role')!r}")
        try:
            check_messages(prompt + completion, final="assistant")
        except ValueError as e:
            raise ValueError(f"prompt + \"{name}\": {e}") from None
        out[name] = completion
    return PreferencePair(prompt, out["chosen"], out["rejected"], line)


def load_preferences(data: str | os.PathLike | Sequence[dict]) -> list[PreferencePair]:
    """Read preference rows (see the module docstring): a JSONL path, or a list of row dicts.

    Raises:
        FileNotFoundError: no such file.
        ValueError: ``"<path>, line N: <what is wrong>"`` (see :func:`parse_pair`; malformed JSON); an empty
            file or list.
    """
    if isinstance(data, (str, os.PathLike)):
        source, rows, unit = str(data), jsonl_rows(data, "preference file"), "line"
    elif isinstance(data, (list, tuple)) and data:
        source, rows, unit = "preferences", enumerate(data, start=1), "row"
    else:
        raise ValueError("preferences must be a JSONL path or a non-empty list of rows")
    out = []
    for line, obj in rows:
        try:
            out.append(parse_pair(obj, line))
        except ValueError as e:
            raise ValueError(f"{source}, {unit} {line}: {e}") from None
    return out


def render_completion(prompt: list[dict], completion: list[dict], tokenizer: Tokenizer,
                      template: ChatTemplate) -> tuple[list[int], list[bool]]:
    """``(ids, mask)`` of ``prompt + completion`` rendered with ``template``, the mask True only on the
    completion's supervised tokens (its assistant content and ends of turn).

    Raises:
        ValueError: the template does not render the prompt as a prefix of the whole conversation (each
            built-in one does), or the tokenizer lacks the template's tokens.
    """
    ids, mask = template.render(prompt + completion, tokenizer)
    head, _ = template.render(prompt, tokenizer, add_generation_prompt=True)
    if ids[: len(head)] != head:
        raise ValueError(f"the {template.name!r} chat template does not render a prompt as the start of the "
                         f"conversation that continues it; it cannot be used for preference pairs")
    return ids, [False] * len(head) + mask[len(head):]


def render_pair(pair: PreferencePair, tokenizer: Tokenizer, template: str | ChatTemplate | None = None):
    """``((chosen_ids, chosen_mask), (rejected_ids, rejected_mask))`` of a pair (:func:`render_completion`)."""
    template = get_template(template)
    return (render_completion(pair.prompt, pair.chosen, tokenizer, template),
            render_completion(pair.prompt, pair.rejected, tokenizer, template))


def pairs_of(run: Run, data, val_data, val_fraction) -> tuple[dict, list[PreferencePair], list[PreferencePair]]:
    """``(what run.json records, training pairs, held-out pairs)`` from TRL's preference rows
    (:func:`load_preferences`): ``val_data``, or the seeded ``val_fraction`` of ``data``;
    on a resume the run's own rows (refusing others) and fraction."""
    if run.resumed:
        data = run.info.get("data") if data is None else data
        val_data = run.info.get("val_data") if val_data is None else val_data
    if data is None:
        raise ValueError(f"cannot resume {run.run_dir} without data: it was trained on preference rows given as a "
                         f"list, which run.json does not hold; give the same rows as data" if run.resumed
                         else "give the preference rows to train on: data, a JSONL path or a list of rows")
    pairs = load_preferences(data)
    held = None if val_data is None else load_preferences(val_data)
    digest = sha256_of(*([[p.prompt, p.chosen, p.rejected] for p in s] for s in (pairs, held) if s is not None))
    if run.resumed and run.info.get("data_sha256") not in (None, digest):
        raise ValueError(f"cannot resume {run.run_dir}: the preference rows differ from those it was trained on "
                         f"({run.info.get('data')!r}); resume with the same data, or start a new run")
    fraction = held_out_fraction(run, val_fraction, FINETUNE_VAL_FRACTION)
    info = {"data": path_or_none(data), "val_data": path_or_none(val_data), "val_fraction": fraction,
            "data_sha256": digest}
    if held is not None:
        return info, pairs, held
    return (info, *split_held_out(pairs, fraction, run.cfg.seed, what="preference pairs"))


def pair_conversations(pairs) -> list[list[dict]]:
    """Both sides of every pair as conversations (prompt + chosen, prompt + rejected): the text a tokenizer
    must represent, and what a tokenizer built from scratch learns."""
    return [p.prompt + side for p in pairs for side in (p.chosen, p.rejected)]


# ---------------------------------------------------------------------------------------------------------
# The loss, the rows and the batches
# ---------------------------------------------------------------------------------------------------------


def sequence_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the supervised tokens' log-probabilities per row (nats, float32): (B, T, V), (B, T) -> (B,)."""
    return token_logprobs(logits, labels).sum(dim=-1)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float = DPO_BETA) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO's per-pair loss and implicit rewards (see the module docstring) from the four sequence
    log-probabilities, each (B,).

    Returns:
        ``(losses (B,), chosen_rewards (B,), rejected_rewards (B,))``; the rewards are detached.

    Raises:
        ValueError: beta not a finite number > 0.
    """
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0 or beta == float("inf"):
        raise ValueError(f"beta must be a finite number > 0, got {beta!r}")
    chosen = policy_chosen - ref_chosen
    rejected = policy_rejected - ref_rejected
    losses = -F.logsigmoid(beta * (chosen - rejected))
    return losses, beta * chosen.detach(), beta * rejected.detach()


@dataclass
class PreferenceExamples:
    """Training pairs ``rows``: [((chosen inputs, labels), (rejected inputs, labels))], shifted once
    (:func:`~decoderlab.training.rows.shift_for_training`); ``truncated``: pairs with a side longer than
    max_len + 1 tokens (cut); ``dropped``: pairs with a side left without a supervised token (not in rows);
    ``lines``: the source line of each kept pair."""

    rows: list[tuple[Row, Row]]
    lines: list[int]
    truncated: int
    dropped: int


def build_preference_examples(rendered: Sequence, max_len: int, lines: Sequence[int] | None = None
                              ) -> PreferenceExamples:
    """Shift rendered pairs ``[((chosen_ids, chosen_mask), (rejected_ids, rejected_mask))]`` (as
    :func:`render_pair` gives) into training rows, cutting each side to max_len + 1."""
    rows, kept, truncated, dropped = [], [], 0, 0
    for i, ((cids, cmask), (rids, rmask)) in enumerate(rendered):
        truncated += len(cids) > max_len + 1 or len(rids) > max_len + 1
        c, r = shift_for_training(cids, cmask, max_len), shift_for_training(rids, rmask, max_len)
        if all(t == IGNORE_INDEX for t in c[1]) or all(t == IGNORE_INDEX for t in r[1]):
            dropped += 1
            continue
        rows.append((c, r))
        kept.append(lines[i] if lines is not None else i + 1)
    return PreferenceExamples(rows, kept, truncated, dropped)


def collate_pairs(pairs: Sequence[tuple[Row, Row]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of B pairs: the chosen rows, then the rejected rows, right-padded together: two (2B, T)."""
    return collate([c for c, _ in pairs] + [r for _, r in pairs], pad_id)


def preference_examples(train_pairs: list, val_pairs: list, tok, template: ChatTemplate, max_len: int
                        ) -> tuple[PreferenceExamples, PreferenceExamples | None]:
    """``(training pairs, held-out pairs or None)`` rendered with ``template`` (the loss mask on each
    completion) and shifted once; says how many were truncated or dropped.

    Raises:
        ValueError: no training pair keeps a supervised token on both sides within max_len + 1 tokens.
    """
    def build(pairs):
        return build_preference_examples([render_pair(p, tok, template) for p in pairs], max_len,
                                         [p.line for p in pairs])

    train_ex = build(train_pairs)
    val_ex = build(val_pairs) if val_pairs else None
    truncated = train_ex.truncated + (val_ex.truncated if val_ex else 0)
    dropped = train_ex.dropped + (val_ex.dropped if val_ex else 0)
    if not train_ex.rows:
        raise ValueError(f"no preference pair to train on: all {len(train_pairs)} pairs have a completion beyond "
                         f"max_len={max_len} tokens; use shorter pairs or a model with a longer context")
    if truncated or dropped:
        print(f"decoderlab: {truncated} preference pair(s) with a side longer than max_len + 1 = {max_len + 1} tokens "
              f"were truncated; {dropped} with a side left without a completion token were dropped", file=sys.stderr)
    return train_ex, val_ex


class PreferenceBatches(StepBatches):
    """Micro-batch number k -> ``(inputs (2B, T), labels (2B, T), step_pairs)``: the step-exact schedule of
    :class:`~decoderlab.training.rows.StepBatches` (optimizer step s takes a fixed set of ``batch_size *
    accumulate * world_size`` pairs of seeded permutations) over pairs; ``step_pairs`` (0-d int64) is that
    number, the normaliser."""

    @staticmethod
    def length(row) -> int:
        """A pair pads to its longer side."""
        return max(len(row[0][0]), len(row[1][0]))

    def batch(self, mine: list, step: np.ndarray):
        x, y = collate_pairs(mine, self.pad_id)
        return x, y, torch.tensor(len(step), dtype=torch.long)


class DPODataModule(StepDataModule):
    """:class:`~decoderlab.training.rows.StepDataModule` over :class:`PreferenceExamples`: training micro-batches
    from :class:`PreferenceBatches` (resumable: the batches served are saved), validation batches of held-out
    pairs (chosen rows then rejected rows, ``val_batch_size`` rows in all)."""

    batches = PreferenceBatches

    def validation_batches(self, rows: list) -> list:
        half = max(1, self.val_batch_size // 2)
        return [collate_pairs(rows[i : i + half], self.pad_id) for i in range(0, len(rows), half)]


# ---------------------------------------------------------------------------------------------------------
# The Lightning module
# ---------------------------------------------------------------------------------------------------------


_METRICS = ("loss", "reward_margin", "reward_accuracy", "chosen_reward", "rejected_reward")


class DPOModule(LitModel):
    """:class:`~decoderlab.training.LitModel` for DPO: ``self.model`` is trained, ``reference`` (the starting
    model) is frozen (eval mode, no gradients) and kept in Lightning checkpoints with it.

    ``training_step`` takes :class:`PreferenceBatches`' micro-batches and returns ``sum of pair losses *
    accumulate * world_size / step_pairs``, so an optimizer step's gradient is that of the mean loss over
    its pairs. Each optimizer step appends ``{"step", "loss", "reward_margin", "reward_accuracy",
    "chosen_reward", "rejected_reward"}`` (means over its pairs) to ``history`` and logs them (``loss`` as
    ``train_loss``); validation logs the same means over the held-out pairs as ``val_loss``, ``val_reward_margin``,
    ``val_reward_accuracy``. ``history`` and ``val_history`` are kept in Lightning checkpoints.
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, reference: torch.nn.Module,
                 beta: float = DPO_BETA):
        super().__init__(model, cfg)
        dpo_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), beta)  # checks beta
        self.reference = reference.requires_grad_(False)  # (eval mode at every use: fit sets train mode)
        self.beta = float(beta)
        self.history: list[dict] = []
        self.val_history: list[tuple[int, float]] = []
        self._shown = 0  # history rows already on a progress line
        self.last_validation: dict[str, float] = {}
        self._step = torch.zeros(len(_METRICS), dtype=torch.float64)
        self._val = torch.zeros(len(_METRICS) + 1, dtype=torch.float64)

    def _pair_sums(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of pair losses with its gradient, float64 sums of the metrics over the pairs)."""
        b = x.size(0) // 2
        logp = sequence_logprobs(self.model(x), y)
        self.reference.eval()  # Lightning's fit puts every submodule in train mode: no dropout here
        with torch.no_grad():
            ref = sequence_logprobs(self.reference(x), y)
        losses, cr, rr = dpo_loss(logp[:b], logp[b:], ref[:b], ref[b:], self.beta)
        margin = cr - rr
        sums = torch.stack([losses.detach().sum(), margin.sum(), (margin > 0).float().sum(), cr.sum(), rr.sum()])
        return losses.sum(), sums.cpu().double()  # float64 on the host copy only

    def training_step(self, batch, batch_idx):
        x, y, step_pairs = batch
        loss_sum, sums = self._pair_sums(x, y)
        self._step += sums
        acc, world = self.trainer.accumulate_grad_batches, self.trainer.world_size
        if (batch_idx + 1) % acc == 0:
            total = self._step
            if world > 1:
                total = torch.tensor(sum_over_ranks(self.trainer.strategy, total.tolist()), dtype=torch.float64)
            row = {"step": self.trainer.global_step + 1,
                   **{k: float(v) / float(step_pairs) for k, v in zip(_METRICS, total)}}
            self.history.append(row)
            self._step = torch.zeros(len(_METRICS), dtype=torch.float64)
            for k in _METRICS:
                self.log("train_loss" if k == "loss" else k, row[k], prog_bar=k in ("loss", "reward_accuracy"),
                         on_step=True, on_epoch=False, rank_zero_only=True, batch_size=x.size(0) // 2)
        return loss_sum * (acc * world) / step_pairs.to(loss_sum.dtype)

    def on_validation_epoch_start(self):
        self._val = torch.zeros(len(_METRICS) + 1, dtype=torch.float64)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        _, sums = self._pair_sums(x, y)
        self._val += torch.cat([sums, torch.tensor([x.size(0) // 2], dtype=torch.float64)])

    def on_validation_epoch_end(self):
        if self.trainer.sanity_checking:
            return
        total = self._val
        if self.trainer.world_size > 1:
            total = torch.tensor(sum_over_ranks(self.trainer.strategy, total.tolist()), dtype=torch.float64)
        n = float(total[-1]) or float("nan")
        means = {k: float(v) / n for k, v in zip(_METRICS, total)}
        self.log("val_loss", means["loss"], prog_bar=True)
        self.log("val_reward_margin", means["reward_margin"])
        self.log("val_reward_accuracy", means["reward_accuracy"])
        self.val_history.append((self.trainer.global_step, means["loss"]))
        self.last_validation = means

    def validation_fields(self) -> list[str]:
        """The plain progress line of a validation: the held-out DPO loss, reward margin and accuracy."""
        m = self.last_validation
        return [f"val loss {m['loss']:.4f}", f"reward margin {m['reward_margin']:+.4f}",
                f"reward accuracy {m['reward_accuracy']:.0%}"] if m else []

    def progress_fields(self) -> list[str]:
        """The plain progress line's fields: the means over the steps since the previous line."""
        rows, self._shown = self.history[self._shown :], len(self.history)
        if not rows:
            return []
        mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("loss", "reward_margin", "reward_accuracy")}
        return [f"train loss {mean['loss']:.4f}", f"reward margin {mean['reward_margin']:+.4f}",
                f"reward accuracy {mean['reward_accuracy']:.0%}"]

    def on_save_checkpoint(self, checkpoint):
        checkpoint["dpo_history"] = [dict(h) for h in self.history]
        checkpoint["dpo_val_history"] = [list(h) for h in self.val_history]

    def on_load_checkpoint(self, checkpoint):
        self.history = [dict(h) for h in checkpoint.get("dpo_history", [])]
        self._shown = len(self.history)
        self.val_history = [(int(s), float(v)) for s, v in checkpoint.get("dpo_val_history", [])]


# ---------------------------------------------------------------------------------------------------------
# The held-out evaluation and the summary
# ---------------------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_preferences(model, reference, ex: PreferenceExamples, pad_id: int, beta: float,
                         batch_size: int = 16) -> dict:
    """DPO's metrics of ``model`` against ``reference`` over the pairs of ``ex``: the mean ``loss`` (nats per
    pair), ``reward_margin`` (mean of r_chosen - r_rejected), ``reward_accuracy`` (share with r_chosen >
    r_rejected), ``chosen_reward`` and ``rejected_reward`` (means), and ``pairs`` (how many); each None when
    there is no pair. Both models run in eval mode on the first model's device."""
    device = next(model.parameters()).device
    sums = torch.zeros(5, dtype=torch.float64)
    for i in range(0, len(ex.rows), batch_size):
        x, y = (t.to(device) for t in collate_pairs(ex.rows[i : i + batch_size], pad_id))
        b = x.size(0) // 2
        logp, ref = sequence_logprobs(model(x), y), sequence_logprobs(reference.eval()(x), y)
        losses, cr, rr = dpo_loss(logp[:b], logp[b:], ref[:b], ref[b:], beta)
        margin = cr - rr
        sums += torch.stack([losses.sum(), margin.sum(), (margin > 0).float().sum(), cr.sum(), rr.sum()]).cpu().double()
    n = len(ex.rows)
    names = ("loss", "reward_margin", "reward_accuracy", "chosen_reward", "rejected_reward")
    return {**{k: float(v) / n if n else None for k, v in zip(names, sums)}, "pairs": n}


def format_preferences(ev: dict, on: str = "held-out") -> str:
    """One line of :func:`evaluate_preferences`' dict for the terminal."""
    if not ev.get("pairs"):
        return f"{on}: no preference pair to evaluate"
    return (f"{on} ({ev['pairs']} pairs): DPO loss {ev['loss']:.4f} nats/pair, reward margin "
            f"{ev['reward_margin']:+.4f} nats, reward accuracy {ev['reward_accuracy']:.1%}")


@dataclass
class PreferenceSummary(Summary):
    """What :func:`finetune` with ``method="dpo"`` reports, as attributes or as the mapping of ``summary.json``.

    Attributes:
        steps: optimizer steps done; train_loss: mean DPO loss (nats per pair) of the last min(50, steps)
            steps; history: per step ``{"step", "loss", "reward_margin", "reward_accuracy", "chosen_reward",
            "rejected_reward"}`` (means over the step's pairs; rewards are beta times the log-ratio to the
            reference, nats); val_history: [(step, held-out loss)];
        evaluation: :func:`evaluate_preferences` of the final model on the held-out pairs (or the training
            ones when there are none, ``eval_on`` says which);
        train_pairs / val_pairs: pairs trained on / held out (those with a supervised token on both sides
            within max_len + 1 tokens); truncated / dropped: pairs with a side cut / left without a target;
        beta: DPO's beta; template, added_tokens, num_parameters, trainable_parameters, lora, train_seconds,
            run_dir, is_global_zero, device: as :class:`~decoderlab.finetuning.FinetuneSummary`.
    """

    steps: int
    train_loss: float
    history: list[dict]
    val_history: list[tuple[int, float]]
    evaluation: dict
    eval_on: str
    train_pairs: int
    val_pairs: int
    truncated: int
    dropped: int
    beta: float
    template: str
    added_tokens: list[str]
    num_parameters: int
    trainable_parameters: int
    lora: dict | None
    train_seconds: float
    run_dir: str | None
    is_global_zero: bool = True
    device: str | None = None


def summarize(job: Job, trainer, exporter, seconds: float) -> tuple:
    """``(the model to return, the summary)``: the held-out metrics and the final export on the device the
    model trained on (rank 0), then the summary (and ``summary.json``)."""
    module, run, reference = trainer.lightning_module, job.run, job.reference
    train_ex, val_ex = trainer.datamodule.train, trainer.datamodule.val  # (the pairs it trained on)
    eval_ex, eval_on = (val_ex, "held-out") if val_ex is not None and val_ex.rows else (train_ex, "train")
    evaluation: dict = {}
    model, beta = module.model, job.options["beta"]
    with on_training_device(trainer, model) as (whole, device):
        if whole is not None:  # (a LoRA model as it trained: a merged copy over GGUF blocks is float32, 4x the file)
            model = whole.eval()
            evaluation = evaluate_preferences(model, reference.to(device), eval_ex, job.pad_id, beta)
            exporter.meta.update(evaluation=dict(evaluation), eval_on=eval_on)
            exporter.export(trainer, whole, final=True)  # (the merged model too, when asked)
    model, _ = model.cpu(), reference.cpu()  # (as Lightning leaves a trained module)
    summary = PreferenceSummary(
        steps=trainer.global_step, train_loss=mean_of_last([h["loss"] for h in module.history])[0],
        history=[dict(h) for h in module.history], val_history=list(module.val_history), evaluation=evaluation,
        eval_on=eval_on, train_pairs=len(train_ex.rows), val_pairs=len(val_ex.rows) if val_ex else 0,
        truncated=train_ex.truncated + (val_ex.truncated if val_ex else 0),
        dropped=train_ex.dropped + (val_ex.dropped if val_ex else 0), beta=beta, template=job.template.name,
        added_tokens=job.start["added_tokens"], num_parameters=model.num_parameters(),
        trainable_parameters=job.start["trainable_parameters"], lora=job.start["lora"], train_seconds=seconds,
        run_dir=str(run.run_dir), is_global_zero=trainer.is_global_zero, device=str(device))
    run.write_summary(trainer, summary)
    return model, summary


def train(job: Job, model) -> tuple:
    """``(datamodule, DPOModule)`` of the run's pairs (the datamodule holds their rows), against the frozen
    ``job.reference``."""
    examples = preference_examples(job.train_items, job.val_items, job.tokenizer, job.template, job.max_len)
    cfg = job.run.cfg
    dm = DPODataModule(*examples, batch_size=cfg.batch_size, accumulate=cfg.accumulate, seed=cfg.seed,
                       pad_id=job.pad_id, val_batch_size=cfg.val_batch_size, group_by_length=cfg.group_by_length)
    return dm, DPOModule(model, cfg, job.reference, job.options["beta"])


def options(run: Run, given: dict) -> dict:
    """DPO's ``beta``: the one given (default ``DPO_BETA``), or on a resume the run's own, refusing another."""
    return {"beta": run.keep("beta", given.get("beta"), default=DPO_BETA, why="it defines the run's loss")}


#: DPO's parts, for :func:`~decoderlab.finetuning.finetune`
DPO = Method(name="dpo", option_names=("beta",), options=options, read_data=pairs_of, texts=pair_conversations,
             train=train, summarize=summarize, reference=True,
             closing=lambda s: f"fine-tuned (dpo) for {s.steps} steps; {format_preferences(s.evaluation, s.eval_on)}")
