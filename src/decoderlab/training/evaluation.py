"""A language model's evaluation: the mean cross-entropy over non-overlapping windows (``evaluate_lm``) and its
exact sums (``evaluation_sums``: nats, targets, bytes), at the run's precision on the model's device; plain
torch (no Lightning)."""

from __future__ import annotations

import numpy as np
import torch

from ..checkpoint import unwrap_model
from ..data import SequentialWindows
from .precision import autocast_dtype, detect_machine, resolve_precision
from .sums import host_column_sums


def _check_ids(tokens, num_tokens: int) -> None:
    """The range check of the ids, once on the host for all windows (the forward passes then skip theirs)."""
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= num_tokens:
        raise ValueError(f"token id {lo if lo < 0 else hi} is out of range; allowed ids are 0 .. {num_tokens - 1} "
                         f"(num_tokens={num_tokens})")


@torch.no_grad()
def evaluation_sums(model, tokens, max_len: int | None = None, batch_size: int = 64,
                    max_batches: int | None = None, precision: str = "32", byte_lengths=None) -> dict[str, float]:
    """Sums over the validation windows of ``tokens``: ``{"nats": cross-entropy summed over every target,
    "targets": their number, "bytes": their UTF-8 bytes}`` (``bytes`` from ``byte_lengths``, an array
    (vocab_size,) of bytes per token id as :func:`decoderlab.data.token_byte_lengths` gives; 0 without it).

    The windows are :class:`decoderlab.data.SequentialWindows`' (every token but the first predicted exactly
    once), at most ``max_batches`` batches of ``batch_size`` windows, run on the model's device at
    ``precision`` (decoderlab's or Lightning's name; "auto" resolved for that device). The per-batch sums
    stay on the device and are added in float64 on the host at the end
    (:func:`~decoderlab.training.sums.host_column_sums`).

    Raises:
        ValueError: a token id outside the model's vocabulary (checked once, on the host).
    """
    model = unwrap_model(model)
    max_len = max_len or model.config.max_len
    ds = SequentialWindows(tokens, max_len, batch_size, max_batches)
    _check_ids(np.asarray(tokens), model.config.num_tokens)
    lengths = None if byte_lengths is None else torch.as_tensor(byte_lengths, dtype=torch.int64)
    device = next(model.parameters()).device
    if precision == "auto":
        precision = resolve_precision("auto", detect_machine(device.type))[0]
    dtype = autocast_dtype(precision)
    was_training = model.training
    model.eval()
    losses, count, nbytes = [], 0, 0
    try:
        for j in range(len(ds)):
            x, y = ds[j]
            with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                logits = model(x.to(device), check_ids=False)
            losses.append(torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                                            y.to(device).reshape(-1), reduction="sum"))
            count += y.numel()
            if lengths is not None:
                nbytes += int(lengths[y.reshape(-1)].sum())
    finally:
        model.train(was_training)
    nats = host_column_sums([[loss] for loss in losses])
    return {"nats": nats[0] if nats else 0.0, "targets": count, "bytes": float(nbytes)}


def evaluate_lm(model, tokens, max_len: int | None = None, batch_size: int = 64,
                max_batches: int | None = None, precision: str = "32") -> float:
    """Mean cross-entropy (nats per token) over the non-overlapping windows of ``tokens``.

    The windows are :class:`decoderlab.data.SequentialWindows`' (every token but the first predicted exactly
    once), at most ``max_batches`` batches of ``batch_size`` windows (see :func:`evaluation_sums`).
    """
    sums = evaluation_sums(model, tokens, max_len, batch_size, max_batches, precision)
    return sums["nats"] / sums["targets"]
