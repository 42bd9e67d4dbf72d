"""Sampling: logits -> the next token of each row, through the rows' logits processors, then the argmax
(greedy rows) or one inverse-CDF draw from each row's own seeded ``torch.Generator``."""

from __future__ import annotations

from typing import Sequence

import torch

from .checks import MAX_SEED, as_scalar, check_int, check_real, check_seed, is_integer
from .params import SamplingParams, row_settings
from .processors import RAW_PROCESSORS, WARPERS, LogitsProcessorList, TokenCounts, check_rows

__all__ = ["MAX_SEED", "Sampler", "as_scalar", "check_int", "check_real", "check_seed", "is_integer",
           "make_generator", "make_generators"]


class Sampler:
    """Choose the next token of each row from its logits.

    Args:
        params: the settings of every row (one :class:`SamplingParams`, applied to any number of rows) or of
            each row (a sequence of B of them). ``suppress_tokens`` is taken as given here (None: none); the
            engine binds it to the tokenizer's ``<PAD>`` first.
        **sampling: fields of a :class:`SamplingParams` built from them (``Sampler(temperature=0.7,
            top_k=40)``).

    ``sampler(logits, generators, counts=None)``: logits (B, V); ``generators`` one ``torch.Generator`` per row
    (None, or the list empty, for greedy rows; each sampled row draws exactly one uniform number per token, so a
    row's tokens depend only on its own generator, logits and settings); ``counts`` the rows'
    :class:`TokenCounts` when a penalty is on (:attr:`uses_counts`). Returns (B,) token ids.

    A greedy row (temperature 0) is the argmax after the raw processors (penalties, bias, suppression); a
    sampled row also goes through temperature, top-k, top-p and min-p, then one draw by inverse CDF (no sort
    unless top_p is set). Half-precision logits are upcast to float32 first (a CDF needs more than 8 bits).
    The global RNG is never used.

    Extremes: the choice is never driven by a NaN. A temperature so small that logits / temperature
    overflows picks among the largest logits (as the limit of the distribution does); tokens with a logit of
    +inf are the only candidates (equally likely); a row whose logits are all -inf (every token suppressed or
    filtered), or logits holding NaN, raise ``ValueError``.

    Raises: what :class:`SamplingParams` raises for bad settings.
    """

    def __init__(self, params: SamplingParams | Sequence[SamplingParams] | None = None, **sampling):
        if isinstance(params, SamplingParams) or params is None:
            rows = [SamplingParams.of(params, **sampling)]
            self.per_row = False
        else:
            rows = [SamplingParams.of(p, **sampling) for p in params]
            self.per_row = True
            if not rows:
                raise ValueError("Sampler needs the settings of at least one row")
        self.rows = rows
        settings = row_settings(rows)
        self.raw = LogitsProcessorList.for_rows(RAW_PROCESSORS, settings)
        greedy = [p.greedy for p in rows]
        self._greedy_rows = [i for i, g in enumerate(greedy) if g]
        self._sampled_rows = [i for i, g in enumerate(greedy) if not g]
        sampled = [settings[i] for i in self._sampled_rows]
        self.warpers = LogitsProcessorList.for_rows(WARPERS, sampled) if sampled else LogitsProcessorList()
        self._index: dict = {}

    @property
    def greedy(self) -> bool:
        """Every row is greedy (no generator needed)."""
        return not self._sampled_rows

    @property
    def uses_counts(self) -> bool:
        """A penalty is on in some row: call with the rows' :class:`TokenCounts`."""
        return self.raw.uses_counts

    def filter(self, logits: torch.Tensor, counts: TokenCounts | None = None) -> torch.Tensor:
        """Logits (B, V) of the distribution sampled rows draw from: the raw processors, then temperature,
        top-k, top-p and min-p (the tokens they leave out at -inf). Greedy rows come back after the raw
        processors only."""
        logits = self.raw(self._upcast(logits), counts)
        if self.greedy:
            return logits
        if not self._greedy_rows:
            return self.warpers(logits, counts)
        out = logits.clone()
        s = self._rows_index("sampled", logits.device)
        out[s] = self.warpers(logits[s], counts)
        return out

    @staticmethod
    def _upcast(logits: torch.Tensor) -> torch.Tensor:
        return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits

    def _rows_index(self, which: str, device) -> torch.Tensor:
        key = (which, device)
        if key not in self._index:
            rows = self._sampled_rows if which == "sampled" else self._greedy_rows
            self._index[key] = torch.tensor(rows, dtype=torch.long, device=device)
        return self._index[key]

    def __call__(self, logits: torch.Tensor, generators: Sequence[torch.Generator | None] = (),
                 counts: TokenCounts | None = None) -> torch.Tensor:
        logits = self.raw(self._upcast(logits), counts)
        if self.greedy:
            return _argmax(logits)
        if not self._greedy_rows:
            return _draw(self.warpers(logits, counts), generators)
        if logits.size(0) != len(self.rows):
            raise ValueError(f"the sampler has settings for {len(self.rows)} rows, got logits for {logits.size(0)}")
        g, s = self._rows_index("greedy", logits.device), self._rows_index("sampled", logits.device)
        ids = torch.empty(logits.size(0), dtype=torch.long, device=logits.device)
        ids[g] = _argmax(logits[g])
        ids[s] = _draw(self.warpers(logits[s], counts), [generators[i] for i in self._sampled_rows])
        return ids


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    if not bool(torch.isfinite(logits.amax(dim=-1)).all()):
        check_rows(logits)  # +inf is a fine maximum; NaN and all -inf rows raise
    return logits.argmax(dim=-1)


def _draw(logits: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One inverse-CDF draw per row of softmax(logits) (B, V), row i from ``generators[i]``."""
    probs = torch.softmax(logits, dim=-1)
    cdf = probs.cumsum(dim=-1)
    if len(generators) == 1:
        u = torch.rand(1, generator=generators[0], dtype=torch.float64, device=logits.device)
    else:
        u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=logits.device) for g in generators])
    x = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)  # in [0, total): the first cdf > x has prob > 0
    ids = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    # x rounded up to the total (about 2**-24 of draws in float32): the last token that has probability
    last = probs.size(-1) - 1 - (probs > 0).flip(-1).to(torch.uint8).argmax(dim=-1)
    return torch.minimum(ids, last)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device``: seeded with ``seed`` (checked: 0 .. 2**63-1), or fresh entropy
    for None."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(check_seed(seed))
    return g


def make_generators(seed, n: int, device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One ``torch.Generator`` per row: seed None -> fresh entropy; an integer (of any kind) -> every row
    seeded with it; a sequence of n integers -> one seed per row.

    Raises:
        TypeError: a seed that is not an integer (text is refused, not read as a sequence of characters).
        ValueError: a seed out of range; a sequence of another length than n."""
    seed = as_scalar(seed)
    if seed is None or is_integer(seed):
        seeds = [seed] * n
    elif isinstance(seed, (str, bytes)):
        raise TypeError(f"seed must be an integer in 0 .. 2**63-1 or one per prompt, got {seed!r}")
    else:
        try:
            seeds = list(seed)
        except TypeError:
            raise TypeError(f"seed must be an integer or one integer per prompt, got {seed!r}") from None
    if len(seeds) != n:
        raise ValueError(f"seed must be an int or one int per prompt ({n}), got {len(seeds)} seeds")
    return [make_generator(s, device) for s in seeds]
