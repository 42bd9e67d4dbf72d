"""Masked rows, the shared base of every method that trains on chosen tokens of a row (SFT, DPO, GRPO): the one
label shift, right-padded batches, the masked sums, and step-exact batches.

1. :func:`shift_for_training` -- the only place where the label shift happens: inputs = ids[:-1], labels =
   ids[1:] where the mask of ids[1:] is True, else :data:`IGNORE_INDEX` (-100), after truncating to max_len + 1
   tokens;
2. :func:`collate` -- rows right-padded into (B, T) inputs and labels;
3. :func:`masked_ce_sum` and :func:`token_logprobs` -- the sum of cross-entropy and the log-probabilities of the
   supervised labels (the others ignored);
4. :class:`StepBatches` and :class:`StepDataModule` -- optimizer step s uses a fixed set of ``batch_size *
   accumulate * world_size`` rows (seeded shuffles, epoch after epoch), whatever the split into micro-batches
   and processes, and a resumed run serves the batches the uninterrupted one would have. A method says what a
   micro-batch of its rows is (:meth:`StepBatches.batch`) and how held-out rows are batched
   (:meth:`StepDataModule.validation_batches`).

The methods themselves live above: :mod:`decoderlab.finetuning.sft`, :mod:`decoderlab.finetuning.dpo`,
:mod:`decoderlab.reinforcement.grpo`.

Sources: the masked-loss recipe as in nanochat ``chat_sft``, litgpt ``finetune`` and TRL ``SFTTrainer`` (prompt
tokens at -100); per-token normalisation across accumulation as discussed in Hugging Face transformers'
gradient-accumulation fix (2024).
"""

from __future__ import annotations

from typing import Sequence

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

from ..data import CountingSampler

#: the label of a token that is not a target (PyTorch's ``cross_entropy`` default ``ignore_index``)
IGNORE_INDEX = -100

#: one training row: (inputs, labels), the labels already shifted
Row = tuple[list[int], list[int]]


def shift_for_training(ids: Sequence[int], mask: Sequence[bool], max_len: int) -> Row:
    """``(inputs, labels)`` of one rendered row: the one place where labels are shifted.

    The first ``max_len + 1`` tokens are kept; ``inputs = ids[:-1]`` and ``labels[t] = ids[t + 1]`` where
    ``mask[t + 1]`` is True, else -100. Both lists have length ``min(len(ids), max_len + 1) - 1``.
    """
    ids, mask = list(ids[: max_len + 1]), list(mask[: max_len + 1])
    return ids[:-1], [t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:])]


def supervised_count(labels: Sequence[int]) -> int:
    """How many labels are targets (not -100)."""
    return sum(1 for t in labels if t != IGNORE_INDEX)


def collate(rows: Sequence[Row], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad rows to the longest: inputs with ``pad_id``, labels with -100. Returns two (B, T) int64.
    (Right padding needs no attention mask: causal attention never lets a real token see a later pad.)"""
    t = max(len(x) for x, _ in rows)
    xs = torch.full((len(rows), t), pad_id, dtype=torch.long)
    ys = torch.full((len(rows), t), IGNORE_INDEX, dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        xs[i, : len(x)] = torch.tensor(x, dtype=torch.long)
        ys[i, : len(y)] = torch.tensor(y, dtype=torch.long)
    return xs, ys


#: a packed row's segment of the shared prefix: every conversation of the row sees it
SHARED_SEGMENT = 0


def shared_prefix(rows: Sequence[Row]) -> int:
    """How many leading tokens every row of ``rows`` has in common with no target among their labels (the
    system prompt and the first user turn's opening, typically), keeping at least one token of each row its own:
    those tokens can be computed once for all of them. 0 for fewer than two rows."""
    if len(rows) < 2:
        return 0
    limit = min(len(x) for x, _ in rows) - 1
    first_x = rows[0][0]
    n = 0
    while n < limit and all(x[n] == first_x[n] and y[n] == IGNORE_INDEX for x, y in rows):
        n += 1
    return n


#: the segment of a packed row's padding (after every real token, so no real token sees it)
PAD_SEGMENT = -1


def pack_rows(rows: Sequence[Row], pad_id: int, capacity: int = 256) -> tuple[torch.Tensor, ...]:
    """The rows of one micro-batch packed into as few rows as fit, without padding, a common prefix once.

    The rows go first-fit, longest first, into packed rows of ``max(capacity, the longest row)`` tokens (so
    a packed row is never longer than the padded batch's, and its attention -- one mask over all its tokens --
    costs at most what the padded batch's does per row). A packed row is the prefix its rows share
    (:func:`shared_prefix`, P tokens, segment :data:`SHARED_SEGMENT`), then each row's tokens after it (segment
    k + 1 for its k-th row), at the positions they have in their own row (P, P + 1, ...): with
    :func:`segment_mask` every token sees exactly the tokens it saw in its own row, so the logits and the loss
    are the padded batch's (to float rounding) while the step computes the prefix once and little padding. The
    shared tokens' gradient is the sum of their copies' in the padded batch. The packed rows are right-padded to
    the longest (``pad_id``, labels -100, segment :data:`PAD_SEGMENT`).

    Returns ``(inputs, labels, positions, segments, targets)``: four (R, L) int64 tensors and ``targets``, the
    (K,) indices into the flattened (R * L) labels of those that are not -100 (found here on the host, so that
    the step selects its logits without waiting for the device). Raises ``ValueError`` on no rows.
    """
    if not rows:
        raise ValueError("pack_rows needs at least one row")
    size = max(capacity, max(len(x) for x, _ in rows))
    bins: list[list[Row]] = []
    for row in sorted(rows, key=lambda r: -len(r[0])):
        fit = next((b for b in bins if sum(len(x) for x, _ in b) + len(row[0]) <= size), None)
        bins.append([row]) if fit is None else fit.append(row)
    packed = [_pack_one(b) for b in bins]
    width = max(len(p[0]) for p in packed)
    out = [torch.tensor([p[i] + [fill] * (width - len(p[i])) for p in packed], dtype=torch.long)
           for i, fill in enumerate((pad_id, IGNORE_INDEX, 0, PAD_SEGMENT))]
    targets = (out[1].reshape(-1) != IGNORE_INDEX).nonzero().reshape(-1)  # (a CPU tensor: no device wait)
    return (*out, targets)


def _pack_one(rows: Sequence[Row]) -> tuple[list[int], list[int], list[int], list[int]]:
    """``(ids, labels, positions, segments)`` of one packed row (see :func:`pack_rows`)."""
    p = shared_prefix(rows)
    ids, labels, positions, segments = list(rows[0][0][:p]), list(rows[0][1][:p]), list(range(p)), [SHARED_SEGMENT] * p
    for k, (x, y) in enumerate(rows):
        ids += x[p:]
        labels += y[p:]
        positions += range(p, len(x))
        segments += [k + 1] * (len(x) - p)
    return ids, labels, positions, segments


def segment_mask(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) segment ids of packed rows (:func:`pack_rows`) -> (B, 1, T, T) bool, True = a key the query must
    not see: a key of another segment, unless it is the shared prefix's (the causal mask is added by the model)."""
    q, k = segments[:, :, None], segments[:, None, :]
    return ((q != k) & (k != SHARED_SEGMENT))[:, None]


def masked_ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of per-token cross-entropy in nats, number of supervised tokens)`` over the labels != -100.
    logits: (B, T, V); labels: (B, T), already shifted (:func:`shift_for_training`). Float32 sum."""
    ce = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1),
                         ignore_index=IGNORE_INDEX, reduction="sum")
    return ce, (labels != IGNORE_INDEX).sum()


#: bytes of float32 logits :func:`chunked_ce_sum` holds at a time (a slice of rows; at least one row): 64 MiB is 64
#: rows of Gemma 3's 262,144-token vocabulary, 341 of SmolLM2's 49,152
HEAD_CHUNK_BYTES = 64 << 20


def head_chunk_rows(num_tokens: int) -> int:
    """Rows of logits :func:`chunked_ce_sum` computes at a time for a ``num_tokens`` vocabulary (>= 1)."""
    return max(1, HEAD_CHUNK_BYTES // (4 * max(1, num_tokens)))


def _ce_of_rows(project, hidden: torch.Tensor, labels: torch.Tensor, accuracy: bool):
    """``(summed cross-entropy, correct argmax count or None)`` of one slice of rows (float32 logits; float64
    stay float64, for a reference model)."""
    logits = project(hidden)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    ce = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    if not accuracy:
        return ce, None
    return ce, ((logits.detach().argmax(-1) == labels) & (labels != IGNORE_INDEX)).sum()


class _FrozenHeadCE(torch.autograd.Function):
    """The summed cross-entropy of slices of rows through an output layer that takes no gradient (LoRA, a frozen
    head), with ``d sum / d hidden`` taken slice by slice in the forward pass (each slice's logits freed before the
    next: no (K, V) tensor, and no second product in the backward pass, which only scales it)."""

    @staticmethod
    def forward(ctx, hidden, labels, project, rows, accuracy):
        grad, ce, correct = torch.empty_like(hidden), None, None
        for s in range(0, hidden.shape[0], rows):
            with torch.enable_grad():
                h = hidden[s:s + rows].detach().requires_grad_()
                part, right = _ce_of_rows(project, h, labels[s:s + rows], accuracy)
                (grad[s:s + rows],) = torch.autograd.grad(part, h)
            ce = part.detach() if ce is None else ce + part.detach()
            correct = right if correct is None else correct + right
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(*([correct] if correct is not None else []))
        return ce, correct

    @staticmethod
    def backward(ctx, grad_ce, _grad_correct):
        (grad,) = ctx.saved_tensors
        return grad * grad_ce.to(grad.dtype), None, None, None, None


def chunked_ce_sum(project, hidden: torch.Tensor, labels: torch.Tensor, *, rows: int | None = None,
                   accuracy: bool = False, frozen: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(sum of cross-entropy in nats, correct argmax predictions or None)`` of ``project(hidden)``'s logits
    against ``labels``, ``rows`` rows at a time, so that no (K, V) float32 logits tensor of all the rows lives
    (only one slice's): the output layer and its log-softmax over a big vocabulary.

    Args:
        project: (k, d_model) -> (k, V) logits (the output layer; the model passes it, see
            ``DecoderOnlyTransformer.forward(head=...)``).
        hidden: (K, d_model), the final norm's output at the scored positions.
        labels: (K,) int64 targets; :data:`IGNORE_INDEX` is ignored.
        rows: rows a slice (:func:`head_chunk_rows` of the vocabulary: 64 MiB of logits); None: all at once.
        accuracy: also count ``argmax == label`` (without a gradient; ignored labels never count).
        frozen: ``project`` takes no gradient (its weights are frozen, as under LoRA): each slice's gradient to
            ``hidden`` is taken in the forward pass instead of recomputing its logits in the backward pass.

    Returns the float32 (float64 for float64 logits) 0-d sum (its gradient, when ``hidden`` has one, equals the
    unchunked sum's to rounding: with more than one slice each slice's logits are recomputed in the backward pass
    instead of kept, ``torch.utils.checkpoint`` -- measured 1.5x the head's time at 256 rows of Gemma 3's head,
    hence ``frozen``) and an int64 0-d count or None.
    """
    k = hidden.shape[0]
    rows = rows or max(k, 1)
    grad = torch.is_grad_enabled() and hidden.requires_grad and k > rows
    if grad and frozen:
        return _FrozenHeadCE.apply(hidden, labels, project, rows, accuracy)
    ce = correct = None
    for s in range(0, max(k, 1), rows):  # (no row: one empty slice, so the sum keeps its graph)
        h, y = hidden[s:s + rows], labels[s:s + rows]
        if grad:
            part, right = checkpoint(_ce_of_rows, project, h, y, accuracy, use_reentrant=False)
        else:
            part, right = _ce_of_rows(project, h, y, accuracy)
        ce = part if ce is None else ce + part
        correct = right if correct is None else correct + right
    return ce, correct


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probabilities (nats; float32, or float64 for float64 logits) of the labels under the logits:
    (B, T, V), (B, T) -> (B, T), 0 where the label is -100. The labels are already shifted (label t is the
    token after input t)."""
    logp = F.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
    picked = logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill(labels == IGNORE_INDEX, 0.0)


# ---------------------------------------------------------------------------------------------------------
# Step-exact batches
# ---------------------------------------------------------------------------------------------------------


class StepBatches(torch.utils.data.Dataset):
    """Micro-batch number k -> :meth:`batch` of this process's rows of it, for one process.

    Optimizer step ``s = k // accumulate`` takes ``G = batch_size * accumulate * world_size`` consecutive rows
    of an endless stream of seeded permutations of the rows (one per epoch); micro-batch ``m = k %
    accumulate`` of rank r takes rows ``[(m * world_size + r) * batch_size, ... + batch_size)`` of them. 1
    process x accumulate 4 x batch 2, 1 x 1 x 8 and 2 processes x 1 x 4 therefore see the same rows in the
    same step. A method subclasses it with its :meth:`batch` (and :meth:`length`, for ``group_by_length``).

    ``group_by_length`` (Hugging Face's ``TrainingArguments.group_by_length``): each epoch's permutation is cut
    into mega-batches of ``GROUP_STEPS`` steps, each sorted by row length (longest first) and cut into steps,
    and the steps of the epoch are shuffled -- every row is still seen once per epoch, but a step's rows have
    nearly one length, so the right padding (up to 3x the real tokens on a mix of short answers and long
    conversations) is mostly gone. The steps are still the same for every accumulate x processes split.
    """

    #: steps per mega-batch of ``group_by_length``
    GROUP_STEPS = 50

    def __init__(self, rows, batch_size: int, accumulate: int, seed: int, pad_id: int, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True, group_by_length: bool = False):
        self.rows, self.b, self.acc, self.seed = rows, int(batch_size), int(accumulate), int(seed)
        self.pad_id, self.rank, self.world, self.shuffle = int(pad_id), int(rank), int(world_size), shuffle
        self.group_by_length = bool(group_by_length)
        self._perms: dict[int, np.ndarray] = {}

    @staticmethod
    def length(row) -> int:
        """The tokens row ``row`` puts into a batch (its inputs)."""
        return len(row[0])

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            n = len(self.rows)
            rng = np.random.default_rng([self.seed, epoch])
            perm = rng.permutation(n) if self.shuffle else np.arange(n)
            self._perms = {epoch: self._grouped(perm, rng) if self.group_by_length else perm}
        return self._perms[epoch]

    def _grouped(self, perm: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """``perm`` with each mega-batch sorted by length (longest first) and the epoch's whole steps shuffled
        (a last partial step stays last)."""
        g = self.b * self.acc * self.world
        if not hasattr(self, "_lengths"):
            self._lengths = np.array([self.length(r) for r in self.rows], dtype=np.int64)
        mega = g * self.GROUP_STEPS
        parts = [perm[i:i + mega] for i in range(0, len(perm), mega)]
        perm = np.concatenate([p[np.argsort(-self._lengths[p], kind="stable")] for p in parts])
        whole = len(perm) // g
        order = rng.permutation(whole) if self.shuffle else np.arange(whole)
        steps = perm[: whole * g].reshape(whole, g)[order].reshape(-1)
        return np.concatenate([steps, perm[whole * g:]])

    def step_rows(self, step: int) -> np.ndarray:
        """Row indices of optimizer step ``step`` (all micro-batches, all processes)."""
        g = self.b * self.acc * self.world
        n = len(self.rows)
        pos = np.arange(step * g, (step + 1) * g)
        return np.array([self._perm(int(p // n))[p % n] for p in pos], dtype=np.int64)

    def batch(self, mine: list, step: np.ndarray):
        """The micro-batch of the rows ``mine`` (this process's share), in the step of the row indices ``step``."""
        raise NotImplementedError

    def __getitem__(self, k: int):
        step, m = divmod(int(k), self.acc)
        rows = self.step_rows(step)
        start = (m * self.world + self.rank) * self.b
        return self.batch([self.rows[i] for i in rows[start : start + self.b]], rows)

    def __len__(self) -> int:
        return 2**62


class StepDataModule(L.LightningDataModule):
    """Training micro-batches (a :class:`StepBatches` subclass, ``batches``) and validation batches (held-out
    rows, shared out across processes; the training rows when there are none). ``train`` and ``val`` hold the
    rows as ``.rows``. The number of micro-batches served is saved in Lightning checkpoints, so a resumed run
    continues with the batches the uninterrupted run would have seen."""

    batches: type[StepBatches] = StepBatches

    def __init__(self, train, val, *, batch_size: int, accumulate: int, seed: int, pad_id: int,
                 val_batch_size: int = 64, group_by_length: bool = False):
        super().__init__()
        self.train, self.val = train, val
        self.batch_size, self.accumulate, self.seed, self.pad_id = batch_size, accumulate, seed, pad_id
        self.val_batch_size, self.group_by_length = val_batch_size, group_by_length
        self.batches_served = 0

    def _rank_world(self):
        trainer = getattr(self, "trainer", None)
        return (0, 1) if trainer is None else (trainer.global_rank, trainer.world_size)

    def train_dataloader(self):
        rank, world = self._rank_world()
        ds = self.batches(self.train.rows, self.batch_size, self.accumulate, self.seed, self.pad_id, rank, world,
                          group_by_length=self.group_by_length)
        return DataLoader(ds, batch_size=None, sampler=CountingSampler(self.batches_served))

    def validation_batches(self, rows: list) -> list:
        """The held-out batches of ``rows`` (this process's share): ``val_batch_size`` rows, collated."""
        return [collate(rows[i : i + self.val_batch_size], self.pad_id)
                for i in range(0, len(rows), self.val_batch_size)]

    def val_dataloader(self):
        rank, world = self._rank_world()
        rows = self.val.rows if self.val is not None and self.val.rows else self.train.rows
        return DataLoader(self.validation_batches(rows[rank::world]), batch_size=None, shuffle=False)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.training:
            self.batches_served += 1
        return batch

    def state_dict(self):
        return {"batches_served": self.batches_served, "seed": self.seed}

    def load_state_dict(self, state):
        self.batches_served = int(state["batches_served"])
        self.seed = int(state["seed"])
