"""Direct preference optimisation (DPO): the loss against a frozen reference model, its implicit rewards,
step-exact pair batches and the Lightning module.

For a prompt x with a chosen reply y_w and a rejected one y_l, with log pi(y | x) the sum of the reply's
token log-probabilities under the model being trained and log ref(y | x) under the frozen reference::

    r_w  = beta * (log pi(y_w | x) - log ref(y_w | x))       implicit reward of the chosen reply
    r_l  = beta * (log pi(y_l | x) - log ref(y_l | x))       ... of the rejected one
    loss = -log sigmoid(r_w - r_l)                          averaged over the pairs of the optimizer step

The reward margin is ``r_w - r_l`` and the reward accuracy the share of pairs with ``r_w > r_l``. With
chosen == rejected the loss is log 2 and its gradient 0. Chosen and rejected rows of a micro-batch run
through the model as one batch (as TRL's ``concatenated_forward``).

Sources: Rafailov et al. 2023, "Direct Preference Optimization"; TRL ``DPOTrainer`` (sigmoid loss, the
logged rewards/margins/accuracies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from ..config.defaults import DPO_BETA
from ..data import CountingSampler
from .config import TrainConfig
from .grpo import token_logprobs
from .module import LitModel
from .sums import sum_over_ranks
from .sft import IGNORE_INDEX, SFTBatches, SFTDataModule, collate, shift_for_training


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


# ---------------------------------------------------------------------------------------------------------
# Rows and batches
# ---------------------------------------------------------------------------------------------------------


Row = tuple[list[int], list[int]]


@dataclass
class PreferenceExamples:
    """Training pairs ``rows``: [((chosen inputs, labels), (rejected inputs, labels))], shifted once
    (:func:`~decoderlab.training.sft.shift_for_training`); ``truncated``: pairs with a side longer than
    max_len + 1 tokens (cut); ``dropped``: pairs with a side left without a supervised token (not in rows);
    ``lines``: the source line of each kept pair."""

    rows: list[tuple[Row, Row]]
    lines: list[int]
    truncated: int
    dropped: int


def build_preference_examples(rendered: Sequence, max_len: int, lines: Sequence[int] | None = None
                              ) -> PreferenceExamples:
    """Shift rendered pairs ``[((chosen_ids, chosen_mask), (rejected_ids, rejected_mask))]`` (as
    :func:`decoderlab.feedback.render_pair` gives) into training rows, cutting each side to max_len + 1."""
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


class PreferenceBatches(SFTBatches):
    """Micro-batch number k -> ``(inputs (2B, T), labels (2B, T), step_pairs)``: :class:`SFTBatches`'
    step-exact schedule (optimizer step s takes a fixed set of ``batch_size * accumulate * world_size``
    pairs of seeded permutations) over pairs; ``step_pairs`` (0-d int64) is that number, the normaliser."""

    def __init__(self, pairs, batch_size: int, accumulate: int, seed: int, pad_id: int, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True):
        super().__init__([], batch_size, accumulate, seed, pad_id, rank, world_size, shuffle)
        self.rows = pairs  # the schedule only needs len(rows); SFT's token counts do not apply

    def __getitem__(self, k: int):
        step, m = divmod(int(k), self.acc)
        rows = self.step_rows(step)
        start = (m * self.world + self.rank) * self.b
        x, y = collate_pairs([self.rows[i] for i in rows[start : start + self.b]], self.pad_id)
        return x, y, torch.tensor(len(rows), dtype=torch.long)


class DPODataModule(SFTDataModule):
    """:class:`SFTDataModule` over :class:`PreferenceExamples`: training micro-batches from
    :class:`PreferenceBatches` (resumable: the batches served are saved), validation batches of held-out
    pairs (chosen rows then rejected rows)."""

    def train_dataloader(self):
        rank, world = self._rank_world()
        ds = PreferenceBatches(self.train.rows, self.batch_size, self.accumulate, self.seed, self.pad_id, rank,
                               world)
        return torch.utils.data.DataLoader(ds, batch_size=None, sampler=CountingSampler(self.batches_served))

    def val_dataloader(self):
        rank, world = self._rank_world()
        rows = self.val.rows if self.val is not None and self.val.rows else self.train.rows
        mine = rows[rank::world]
        half = max(1, self.val_batch_size // 2)
        batches = [collate_pairs(mine[i : i + half], self.pad_id) for i in range(0, len(mine), half)]
        return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)


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
