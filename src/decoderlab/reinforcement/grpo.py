"""Reinforcement learning from a reward, GRPO-style: group advantages, the policy-gradient loss normalised per
token over the optimizer step, an optional KL penalty to the starting model, and the Lightning module.

For each prompt G replies are sampled and rewarded (:mod:`.rollouts`, through the generation engine) and
handed in, one optimizer step at a time, as a :class:`Rollout`. Then, with ``m`` the mask of the sampled tokens
(each reply and its end of turn) and N the number of sampled tokens in the whole optimizer step (every
micro-batch)::

    A_i   = r_i - mean(r of i's group)                  [/ (std of the group + 1e-4) with scale_rewards]
    loss  = sum_{i,t} m_it * ( -A_i * log p(y_it) + kl_coef * KL_it ) / N
    KL_it = exp(ref_it - log p(y_it)) - (ref_it - log p(y_it)) - 1     (Schulman's k3 estimator, >= 0)

``log p`` are the current model's log-probabilities of the sampled tokens and ``ref`` the starting model's.
Sampling is on-policy (one update per sample), so ``-A log p`` has the gradient of PPO's clipped ratio
objective at ratio 1, as in nanochat's ``chat_rl``; dividing by N (not by each reply's length) is the
token-level normalisation of DAPO and of TRL's ``loss_type="dapo"``, and matches the fine-tuning loss
(:mod:`decoderlab.finetuning.sft`). With equal rewards in a group its advantages are 0 and so is its gradient.

Sources: Shao et al. 2024 (DeepSeekMath, GRPO); nanochat ``scripts/chat_rl.py``; TRL ``GRPOTrainer``;
Schulman 2020, "Approximating KL divergence" (k3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..data import CountingSampler
from ..training import LitModel, TrainConfig
from ..training.rows import IGNORE_INDEX, token_logprobs

#: added to the group's standard deviation when ``scale_rewards`` divides by it (TRL's 1e-4)
STD_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = False,
                     eps: float = STD_EPS) -> torch.Tensor:
    """Advantages of rewards laid out group after group: (N,) with N = prompts * group_size -> (N,).

    ``A_i = r_i - mean of i's group``; with ``scale`` divided by (the group's standard deviation (Bessel's,
    as ``torch.std`` and TRL) + ``eps``); exactly 0 for a group whose rewards are all equal. Computed in
    float64, returned in the rewards' dtype.

    Raises:
        ValueError: group_size < 2 (every advantage would be 0), or N not a multiple of group_size.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an integer >= 2 (with one reply per prompt every advantage is 0), "
                         f"got {group_size!r}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must have shape (prompts * group_size,) = (k * {group_size},), got "
                         f"{tuple(rewards.shape)}")
    r = rewards.double().view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    # a group of equal rewards teaches nothing: exactly 0 (the float mean of three 0.7s is not exactly 0.7)
    adv = adv.masked_fill((r == r[:, :1]).all(dim=1, keepdim=True), 0.0)
    return adv.reshape(-1).to(rewards.dtype)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(model || reference) estimate from the sampled tokens' log-probabilities (Schulman's k3):
    ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, 0 where equal). Shapes (B, T) -> (B, T)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def policy_gradient_sums(logits: torch.Tensor, labels: torch.Tensor, advantages: torch.Tensor,
                         ref_logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sum of -A_i log p(y_it), sum of KL_it, number of sampled tokens)`` over labels != -100.

    Args:
        logits: (B, T, V) of the model being trained; labels: (B, T) sampled tokens (-100 elsewhere);
        advantages: (B,) one per reply; ref_logits: (B, T, V) of the reference model, or None (KL sum 0).
    The sums are float32 0-d tensors (the first carries the gradient); the count is int64.
    """
    mask = labels != IGNORE_INDEX
    logp = token_logprobs(logits, labels)
    pg = -(advantages.to(logp.dtype).unsqueeze(1) * logp * mask).sum()
    if ref_logits is None:
        kl = logp.new_zeros(())
    else:
        kl = (kl_k3(logp, token_logprobs(ref_logits, labels)) * mask).sum()
    return pg, kl, mask.sum()


def policy_gradient_loss(logits: torch.Tensor, labels: torch.Tensor, advantages: torch.Tensor, num_tokens: int,
                         ref_logits: torch.Tensor | None = None, kl_coef: float = 0.0) -> torch.Tensor:
    """The loss of the module docstring for one batch: ``(sum -A log p + kl_coef * sum KL) / num_tokens``,
    where ``num_tokens`` counts the sampled tokens of the whole optimizer step (every micro-batch)."""
    pg, kl, _ = policy_gradient_sums(logits, labels, advantages, ref_logits)
    return (pg + kl_coef * kl) / max(int(num_tokens), 1)


# ---------------------------------------------------------------------------------------------------------
# One optimizer step's samples
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """The samples of one optimizer step, cut into its micro-batches.

    Attributes:
        micro_batches: ``accumulate`` tuples ``(inputs (B, T) int64, labels (B, T) int64 -- the sampled tokens,
            -100 elsewhere -- advantages (B,) float32)``.
        tokens: N, sampled tokens (labels != -100) of the whole step: the loss's normaliser.
        rewards, lengths, ended: per reply of the step (group after group): reward, reply length in tokens
            (without the end of turn), whether it ended its turn.
        replies: the replies' text (for logs and samples; may be empty).
    """

    micro_batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    tokens: int
    rewards: list[float]
    lengths: list[int]
    ended: list[bool]
    replies: list[str] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """Mean reward, reward standard deviation (population), mean reply length, end-of-turn rate."""
        r = torch.tensor(self.rewards, dtype=torch.float64)
        return {"reward": float(r.mean()), "reward_std": float(r.std(unbiased=False)),
                "reply_length": sum(self.lengths) / len(self.lengths),
                "end_of_turn_rate": sum(self.ended) / len(self.ended)}


class RolloutSteps(torch.utils.data.Dataset):
    """Micro-batch number k -> k. The samples are drawn by the module when the step starts (with the current
    weights), so the data loader only counts; Lightning's one-batch prefetch then never samples with stale
    weights."""

    def __getitem__(self, k: int) -> int:
        return int(k)

    def __len__(self) -> int:
        return 2**62


def rollout_loader() -> torch.utils.data.DataLoader:
    """The training data loader of an RL run (see :class:`RolloutSteps`)."""
    return torch.utils.data.DataLoader(RolloutSteps(), batch_size=None, sampler=CountingSampler(0))


# ---------------------------------------------------------------------------------------------------------
# The Lightning module
# ---------------------------------------------------------------------------------------------------------


class RLModule(LitModel):
    """:class:`~decoderlab.training.LitModel` for the policy-gradient step.

    Args:
        model: the policy (``self.model``, trained in place).
        cfg: the ``TrainConfig`` (optimizer, schedule, ``accumulate``, ``max_steps``).
        sample: ``sample(model, step) -> Rollout``, called once at the start of every optimizer step ``step``
            (0-based) with the current weights; its ``micro_batches`` must number ``cfg.accumulate``. It must
            depend only on the weights and ``step`` (seeded), so a resumed run samples what the uninterrupted
            one would have.
        reference: the frozen starting model for the KL (None: no KL is computed or penalised).
        kl_coef: the KL penalty's weight (> 0 needs ``reference``).

    ``training_step`` returns ``(sum -A log p + kl_coef sum KL) * accumulate / N`` (see the module docstring;
    Lightning divides by ``accumulate``). Each optimizer step appends to ``history`` and logs ``train_loss``,
    ``reward``, ``reward_std``, ``kl`` (nats per sampled token; 0 without a reference), ``reply_length``
    (tokens) and ``end_of_turn_rate``; ``history`` is kept in Lightning checkpoints. One process only.

    Raises:
        ValueError: ``kl_coef > 0`` without a reference; a rollout with the wrong number of micro-batches; a
            run on more than one process.
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, sample: Callable[[torch.nn.Module, int], Rollout],
                 reference: torch.nn.Module | None = None, kl_coef: float = 0.0):
        super().__init__(model, cfg)
        if kl_coef > 0 and reference is None:
            raise ValueError(f"kl_coef={kl_coef} needs a reference model (the starting model, frozen)")
        self.sample = sample
        self.reference = reference
        if reference is not None:  # (put in eval mode at every use: fit sets every submodule to train mode)
            reference.requires_grad_(False)
        self.kl_coef = float(kl_coef)
        self.history: list[dict] = []
        self._shown = 0  # history rows already on a progress line
        self._rollout: Rollout | None = None
        self._rollout_step = -1
        self._micro = 0
        self._sums = torch.zeros(2, dtype=torch.float64)  # pg + kl_coef * kl, kl of the step so far

    def on_train_start(self):
        super().on_train_start()
        if self.trainer.world_size > 1:
            raise ValueError(f"reinforcement learning runs on one process; got world_size "
                             f"{self.trainer.world_size} (use devices=1)")

    def train_dataloader(self):
        return rollout_loader()

    def _next_micro_batch(self):
        step, acc = self.trainer.global_step, self.trainer.accumulate_grad_batches
        if self._rollout is None or self._rollout_step != step:
            rollout = self.sample(self.model, step)
            if len(rollout.micro_batches) != acc:
                raise ValueError(f"the rollout of step {step} has {len(rollout.micro_batches)} micro-batches; "
                                 f"accumulate is {acc}")
            self._rollout, self._rollout_step, self._micro = rollout, step, 0
            self._sums = torch.zeros(2, dtype=torch.float64)
        m = self._micro
        self._micro += 1
        return m, acc, tuple(t.to(self.device) for t in self._rollout.micro_batches[m])

    def training_step(self, batch, batch_idx):
        m, acc, (x, y, adv) = self._next_micro_batch()
        logits = self.model(x)
        ref_logits = None
        if self.reference is not None:
            self.reference.eval()  # Lightning's fit puts every submodule in train mode: no dropout here
            with torch.no_grad():
                ref_logits = self.reference(x)
        pg, kl, _ = policy_gradient_sums(logits, y, adv, ref_logits)
        total = pg + self.kl_coef * kl
        self._sums += torch.stack([total.detach().cpu().double(), kl.detach().cpu().double()])  # (host float64)
        n = max(self._rollout.tokens, 1)
        if m == acc - 1:
            self._record(n, batch_size=x.size(0))
        return total * acc / n

    def _record(self, n: int, batch_size: int) -> None:
        row = {"step": self.trainer.global_step + 1, "loss": float(self._sums[0]) / n,
               "kl": float(self._sums[1]) / n, **self._rollout.metrics()}
        self.history.append(row)
        for name in ("loss", "reward", "reward_std", "kl", "reply_length", "end_of_turn_rate"):
            self.log("train_loss" if name == "loss" else name, row[name], prog_bar=name in ("loss", "reward"),
                     on_step=True, on_epoch=False, batch_size=batch_size)

    def progress_fields(self) -> list[str]:
        """The plain progress line's fields: the means over the steps since the previous line (then the
        line's own lr, speed and times)."""
        rows, self._shown = self.history[self._shown :], len(self.history)
        if not rows:
            return []
        mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("reward", "kl", "reply_length", "end_of_turn_rate")}
        return [f"reward {mean['reward']:.4f}", f"kl {mean['kl']:.4f}", f"reply length {mean['reply_length']:.1f}",
                f"end of turn {mean['end_of_turn_rate']:.0%}"]

    def on_save_checkpoint(self, checkpoint):
        checkpoint["rl_history"] = [dict(h) for h in self.history]

    def on_load_checkpoint(self, checkpoint):
        self.history = [dict(h) for h in checkpoint.get("rl_history", [])]
        self._shown = len(self.history)
