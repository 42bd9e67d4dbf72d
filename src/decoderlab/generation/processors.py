"""Logits processors: the small steps that turn a model's next-token logits into the distribution a token is
drawn from (the shape of Hugging Face's ``LogitsProcessorList``), with one setting per row.

The order (:data:`RAW_PROCESSORS` then :data:`WARPERS`), and why:

1. :class:`RepetitionPenalty` -- on the model's raw logits: its rule (divide a positive logit, multiply a
   negative one, CTRL) reads the sign of the model's own logit, which a bias or a temperature would change.
2. :class:`FrequencyPenalty`, 3. :class:`PresencePenalty` -- on the raw logits too: OpenAI defines them as
   amounts subtracted from the logits (``mu[j] - c[j] * frequency - (c[j] > 0) * presence``), in the units of
   the logits before any scaling.
4. :class:`LogitBias` -- after the penalties, so that the caller's bias is the last word on a token's logit
   (a penalty never rescales it; -100 stays a ban).
5. :class:`SuppressTokens` -- -inf: never chosen, whatever came before (``<PAD>``).
5b. :class:`GrammarMask` -- structured output: -inf for the tokens the row's grammar does not allow next, the
   others unchanged; after everything that changes a logit's value, before anything that truncates.
6. :class:`Temperature` -- scales the distribution; everything after it truncates the distribution that is
   actually sampled (as Hugging Face's warpers follow its processors).
7. :class:`TopK`, 8. :class:`TopP`, 9. :class:`MinP` -- truncation, in Hugging Face's order. The most probable
   token survives each of them.

Steps 1-5b are the raw processors: a greedy row (temperature 0) is the argmax after them (penalties and bias
change greedy choices, as in Hugging Face; truncation never does). Steps 6-9 apply to sampled rows only.

Every processor is called as ``processor(logits, counts) -> logits`` with logits (B, V) and ``counts`` the
rows' :class:`TokenCounts` (needed only when ``uses_counts``). It is built with one value for every row
(``TopK(40)``, broadcast to any B) or one value per row (``TopK.per_row([40, None, 5])``, B fixed); a row
given the neutral value (None, 0, 1.0, empty) is left exactly as it was. Each processor checks its own values
(``check``, the one definition of what a setting allows, which :class:`decoderlab.generation.SamplingParams`
calls too) and raises ``TypeError`` / ``ValueError`` naming the setting and what is allowed.
"""

from __future__ import annotations

import math
from typing import ClassVar, Mapping, Sequence

import torch

from .checks import as_scalar, check_int, check_range, check_real, is_integer
from .grammar import check_grammar

NEG_INF = float("-inf")


def check_rows(logits: torch.Tensor) -> None:
    """Raise ``ValueError`` for NaN logits or a row with no possible token (every logit -inf)."""
    if torch.isnan(logits).any():
        raise ValueError("the model's logits hold NaN, so no token can be chosen (check the weights, and "
                         "that the model's values fit its dtype: in float16 a value past 65,504 overflows, as "
                         "Gemma 3's do -- use bfloat16 or float32)")
    if (logits == NEG_INF).all(dim=-1).any():
        raise ValueError("no token can be chosen: every logit of a row is -inf (every token suppressed or "
                         "filtered out)")


class TokenCounts:
    """The per-row state the processors read: which tokens each row's prompt holds and how often each token
    was generated so far (the penalties), and where each row stands in its grammar (structured output).

    Attributes:
        generated: (B, V) float32 counts of the generated tokens (OpenAI's ``c[j]``).
        in_prompt: (B, V) bool, True where the token occurs in the row's prompt.
        grammars: per row its :class:`decoderlab.generation.grammar.GrammarState`, or None (no grammar).

    ``add(ids)`` counts one generated token per row (and advances each row's grammar); :meth:`keep` drops rows;
    :meth:`cat` joins rows kept apart (the scheduler keeps one (1, V) state per row, as its rows join and leave; the grammar states
    are shared, not copied); :meth:`complete` says a row's grammar allows no more text.
    """

    def __init__(self, generated: torch.Tensor, in_prompt: torch.Tensor, grammars: Sequence | None = None):
        self.generated, self.in_prompt = generated, in_prompt
        self.grammars = list(grammars) if grammars is not None else [None] * generated.size(0)

    @classmethod
    def for_prompts(cls, prompts: Sequence[Sequence[int]], num_tokens: int, device: torch.device | str = "cpu",
                    grammars: Sequence | None = None) -> "TokenCounts":
        """Empty counts for rows whose prompts are ``prompts`` (lists of token ids < num_tokens); ``grammars``:
        per row a bound grammar (``BoundParams.grammar``) or None, each row starting at its grammar's start."""
        b = len(prompts)
        in_prompt = torch.zeros(b, num_tokens, dtype=torch.bool, device=device)
        for i, ids in enumerate(prompts):
            if len(ids):
                in_prompt[i, torch.as_tensor(list(ids), dtype=torch.long, device=device)] = True
        states = None if grammars is None else [g.state() if g is not None else None for g in grammars]
        return cls(torch.zeros(b, num_tokens, dtype=torch.float32, device=device), in_prompt, states)

    @classmethod
    def cat(cls, parts: Sequence["TokenCounts"]) -> "TokenCounts":
        return cls(torch.cat([p.generated for p in parts]), torch.cat([p.in_prompt for p in parts]),
                   [g for p in parts for g in p.grammars])

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (indices), in place: rows that left a batch (the engine's ``generate_batch``)."""
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=self.generated.device)
        self.generated, self.in_prompt = self.generated.index_select(0, idx), self.in_prompt.index_select(0, idx)
        self.grammars = [self.grammars[k] for k in rows]

    def add(self, ids: torch.Tensor | Sequence[int]) -> None:
        """Count ``ids`` (B,): one generated token per row; each row's grammar takes its token."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.generated.device).view(-1)
        rows = torch.arange(ids.numel(), device=ids.device)
        self.generated[rows, ids] += 1
        if any(g is not None for g in self.grammars):
            for g, t in zip(self.grammars, ids.tolist()):
                if g is not None:
                    g.advance(t)

    def complete(self, row: int) -> bool:
        """Row ``row``'s grammar allows no more text (so generation ends that row, as at a stop)."""
        g = self.grammars[row]
        return g is not None and g.complete

    @property
    def seen(self) -> torch.Tensor:
        """(B, V) bool: in the prompt or generated (the repetition penalty's tokens)."""
        return self.in_prompt | (self.generated > 0)


class LogitsProcessor:
    """One step of the pipeline: ``processor(logits, counts) -> logits`` (see the module docstring).

    Subclasses set ``field`` (the :class:`~decoderlab.generation.SamplingParams` field it reads), ``neutral``
    (the value that changes nothing), ``check`` (value -> normalised value, raising for a bad one) and
    ``apply(logits, value, counts)``, where ``value`` is the Python value shared by every row or a (B, 1)
    tensor of per-row values in the logits' dtype (:meth:`column`).
    """

    field: ClassVar[str] = ""
    neutral: ClassVar[object] = None
    uses_counts: ClassVar[bool] = False

    def __init__(self, value):
        self.value = self.check(value)
        self.values: tuple | None = None  # per-row values, when built with per_row
        self._columns: dict = {}

    @classmethod
    def per_row(cls, values: Sequence) -> "LogitsProcessor":
        """One value per row (B = ``len(values)``), each checked; equal values become one shared value."""
        checked = [cls.check(v) for v in values]
        if not checked:
            raise ValueError(f"{cls.__name__}.per_row needs at least one value")
        proc = cls(checked[0])
        if any(v != checked[0] for v in checked[1:]):
            proc.values = tuple(checked)
        return proc

    @classmethod
    def check(cls, value):  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def is_neutral(cls, value) -> bool:
        return value == cls.neutral

    def column(self, like: torch.Tensor, fill=None) -> torch.Tensor:
        """The per-row values as a (B, 1) tensor of ``like``'s dtype and device (neutral rows as ``fill``)."""
        key = (like.dtype, like.device)
        if key not in self._columns:
            vals = [fill if (fill is not None and self.is_neutral(v)) else v for v in self.values]
            self._columns[key] = torch.tensor(vals, dtype=like.dtype, device=like.device).unsqueeze(1)
        return self._columns[key]

    def rows(self, logits: torch.Tensor) -> None:
        if self.values is not None and logits.size(0) != len(self.values):
            raise ValueError(f"{type(self).__name__} has settings for {len(self.values)} rows, got logits for "
                             f"{logits.size(0)}")

    def __call__(self, logits: torch.Tensor, counts: TokenCounts | None = None) -> torch.Tensor:
        self.rows(logits)
        if self.uses_counts and counts is None:
            raise ValueError(f"{type(self).__name__} needs the rows' TokenCounts")
        return self.apply(logits, counts)

    def apply(self, logits, counts):  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value if self.values is None else list(self.values)!r})"


def _penalty_setting(name: str, value) -> float:
    return check_range(name, value, -2.0, 2.0, "a number from -2 to 2 (0 = off)")


class RepetitionPenalty(LogitsProcessor):
    """CTRL's repetition penalty (Keskar et al. 2019), as Hugging Face's ``RepetitionPenaltyLogitsProcessor``:
    for every token in the prompt or generated so far, a logit < 0 is multiplied by ``penalty`` and a logit
    >= 0 divided by it (``penalty`` > 1 discourages repeats, < 1 encourages them, 1 is off)."""

    field = "repetition_penalty"
    neutral = 1.0
    uses_counts = True

    @classmethod
    def check(cls, value) -> float:
        value = check_real("repetition_penalty", value, "a finite number > 0 (1 = off)")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {value!r}")
        return value

    def apply(self, logits, counts):
        p = self.value if self.values is None else self.column(logits)
        penalized = torch.where(logits < 0, logits * p, logits / p)
        return torch.where(counts.seen, penalized, logits)


class FrequencyPenalty(LogitsProcessor):
    """OpenAI's frequency penalty: ``logit[j] - c[j] * penalty``, with ``c[j]`` how often token j was generated
    so far (the prompt does not count); -2 .. 2, 0 is off."""

    field = "frequency_penalty"
    neutral = 0.0
    uses_counts = True

    @classmethod
    def check(cls, value) -> float:
        return _penalty_setting("frequency_penalty", value)

    def apply(self, logits, counts):
        p = self.value if self.values is None else self.column(logits)
        return logits - p * counts.generated.to(logits.dtype)


class PresencePenalty(LogitsProcessor):
    """OpenAI's presence penalty: ``logit[j] - penalty`` for every token j generated at least once so far (the
    prompt does not count); -2 .. 2, 0 is off."""

    field = "presence_penalty"
    neutral = 0.0
    uses_counts = True

    @classmethod
    def check(cls, value) -> float:
        return _penalty_setting("presence_penalty", value)

    def apply(self, logits, counts):
        p = self.value if self.values is None else self.column(logits)
        return logits - p * (counts.generated > 0).to(logits.dtype)


#: a logit bias this low bans its token: the logit becomes -inf (OpenAI: "-100 should result in a ban")
BAN = -100.0


class LogitBias(LogitsProcessor):
    """OpenAI's ``logit_bias``: a map token id -> bias in -100 .. 100 added to that token's logit; a bias of
    -100 bans the token (its logit becomes -inf, so it is never chosen, also when greedy).

    The value is normalised to a tuple of ``(id, bias)`` pairs in id order (hashable; ``dict(value)`` gives the
    map back). Ids are integers >= 0, or decimal strings (JSON's keys, as OpenAI's clients send them); the
    range of the vocabulary is checked when a request is bound to a model (``SamplingParams.bind``).
    """

    field = "logit_bias"
    neutral = None

    @classmethod
    def check(cls, value) -> tuple[tuple[int, float], ...] | None:
        if value is None:
            return None
        if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
            items = list(value)  # already normalised (SamplingParams.replace checks again)
        elif isinstance(value, Mapping):
            items = list(value.items())
        else:
            raise TypeError(f"logit_bias must be a map of token id -> bias (-100 .. 100), got {value!r}")
        out: dict[int, float] = {}
        for key, bias in items:
            tid = as_scalar(key)
            if isinstance(tid, str) and tid.isascii() and tid.isdigit():
                tid = int(tid)
            if not is_integer(tid) or int(tid) < 0:
                raise TypeError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
            tid = int(tid)
            if tid in out:
                raise ValueError(f"logit_bias gives token id {tid} twice")
            out[tid] = check_range(f"logit_bias[{tid}]", bias, -100.0, 100.0, "a number from -100 to 100 "
                                   "(-100 bans the token)")
        return tuple(sorted(out.items())) or None

    def _dense(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, V) biases and bans for ``logits`` (rows = 1 shared, or B per-row), cached per dtype/device."""
        key = (logits.dtype, logits.device, logits.size(-1))
        if key not in self._columns:
            maps = [self.value] if self.values is None else list(self.values)
            bias = torch.zeros(len(maps), logits.size(-1), dtype=logits.dtype, device=logits.device)
            ban = torch.zeros(len(maps), logits.size(-1), dtype=torch.bool, device=logits.device)
            for i, pairs in enumerate(maps):
                for tid, b in pairs or ():
                    if b <= BAN:
                        ban[i, tid] = True
                    else:
                        bias[i, tid] = b
            self._columns[key] = (bias, ban)
        return self._columns[key]

    def apply(self, logits, counts):
        bias, ban = self._dense(logits)
        return (logits + bias).masked_fill(ban, NEG_INF)


class SuppressTokens(LogitsProcessor):
    """Token ids never to choose: their logits become -inf (e.g. the tokenizer's ``<PAD>``, which a language
    model never sees as a target). A tuple of ids >= 0; ``()`` or None is off."""

    field = "suppress_tokens"
    neutral = ()

    @classmethod
    def check(cls, value) -> tuple[int, ...]:
        if value is None:
            return ()
        if isinstance(value, torch.Tensor):
            value = value.flatten().tolist()
        if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, set, frozenset)):
            raise TypeError(f"suppress_tokens must be a sequence of token ids, got {value!r}")
        return tuple(sorted({check_int("suppress_tokens id", i, 0) for i in value}))

    @classmethod
    def is_neutral(cls, value) -> bool:
        return not value

    def apply(self, logits, counts):
        key = (logits.device, logits.size(-1))
        if key not in self._columns:
            v = logits.size(-1)
            if self.values is None:
                self._columns[key] = torch.tensor([i for i in self.value if i < v], dtype=torch.long,
                                                  device=logits.device)
            else:
                mask = torch.zeros(len(self.values), v, dtype=torch.bool, device=logits.device)
                for r, ids in enumerate(self.values):
                    mask[r, [i for i in ids if i < v]] = True
                self._columns[key] = mask
        where = self._columns[key]
        if self.values is None:
            return logits.index_fill(-1, where, NEG_INF)
        return logits.masked_fill(where, NEG_INF)


class Temperature(LogitsProcessor):
    """Divide the logits by the temperature, safely: never NaN, a row's maximum always finite.

    Where the plain division overflows (a tiny temperature) that row's maximum is subtracted first; rows
    holding +inf logits keep only those tokens (logit 0, the others -inf). Rows whose logits hold NaN or are
    all -inf come out unusable (the :class:`~decoderlab.generation.Sampler` raises ``ValueError`` for them,
    through :func:`check_rows`). Temperature 0 means greedy, which is the argmax, not a division: this
    processor takes temperatures > 0 (``check`` allows the 0 that ``SamplingParams`` takes).
    """

    field = "temperature"
    neutral = None  # every sampled row is scaled, 1.0 too: the step also guards against NaN and +inf

    def __init__(self, value):
        super().__init__(value)
        if self.value == 0.0:
            raise ValueError("Temperature needs a temperature > 0; temperature 0 is greedy (the argmax)")

    @classmethod
    def per_row(cls, values):
        proc = super().per_row(values)
        if proc.values is not None and 0.0 in proc.values:
            raise ValueError("Temperature needs temperatures > 0; rows with temperature 0 are greedy")
        return proc

    @classmethod
    def check(cls, value) -> float:
        value = check_real("temperature", value, "a number >= 0 (0 = greedy)")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {value!r}")
        return value

    def apply(self, logits, counts):
        t = self.value if self.values is None else self.column(logits)
        z = logits / t
        ok = torch.isfinite(z.amax(dim=-1, keepdim=True))
        # the safe values are made for every row and kept where the division overflowed: asking whether any
        # row did would wait for the device. (Rows holding NaN or only -inf stay unusable: the sampler flags
        # them, and check_rows explains why.)
        m = logits.amax(dim=-1, keepdim=True)
        posinf = m == float("inf")
        # the maxima are 0 exactly, also where the temperature underflows the dtype (0 / 0 would be NaN)
        shifted = torch.where(logits == m, 0.0, (logits - m.masked_fill(posinf, 0.0)) / t)
        only_inf = torch.zeros_like(logits).masked_fill(logits != float("inf"), NEG_INF)
        safe = torch.where(posinf, only_inf, shifted)
        return torch.where(ok, z, safe)  # only the rows that overflowed: rows stay independent


class TopK(LogitsProcessor):
    """Keep the k largest logits of a row (ties with the k-th value are kept; k larger than the vocabulary
    keeps all). An integer >= 0 where 0 or None means no top-k filter (as in Hugging Face and llama.cpp); the
    value is normalised to None for "no filter"."""

    field = "top_k"
    neutral = None

    @classmethod
    def check(cls, value) -> int | None:
        if value is None:
            return None
        return check_int("top_k", value, 0) or None

    def apply(self, logits, counts):
        v = logits.size(-1)
        if self.values is None:
            if self.value is None or self.value >= v:
                return logits
            kth = torch.topk(logits, self.value, dim=-1).values[..., -1:]
            return logits.masked_fill(logits < kth, NEG_INF)
        key = (logits.device, v)
        if key not in self._columns:
            on = [k for k in self.values if k is not None and k < v]  # rows whose filter keeps fewer than V
            kmax = max(on, default=1)
            ks = [k if k is not None and k < v else kmax for k in self.values]
            self._columns[key] = (kmax, torch.tensor(ks, device=logits.device).unsqueeze(1) - 1,
                                  torch.tensor([k is None or k >= v for k in self.values],
                                               device=logits.device).unsqueeze(1))
        kmax, index, off = self._columns[key]
        # each row's own k-th value, from one topk of the largest k in use
        kth = torch.topk(logits, kmax, dim=-1).values.gather(-1, index)
        return logits.masked_fill((logits < kth) & ~off, NEG_INF)


class TopP(LogitsProcessor):
    """Nucleus sampling (Holtzman et al. 2019): keep the smallest set of most probable tokens whose probability
    reaches top_p; the most probable token is always kept. A number in (0, 1]; 1 (or None) keeps every token."""

    field = "top_p"
    neutral = None

    @classmethod
    def check(cls, value) -> float | None:
        if value is None:
            return None
        return check_range("top_p", value, 0.0, 1.0, "in (0, 1] (1 keeps every token)", low_open=True)

    @classmethod
    def is_neutral(cls, value) -> bool:
        return value is None or value >= 1.0

    def apply(self, logits, counts):
        if self.values is None and self.is_neutral(self.value):
            return logits
        p = self.value if self.values is None else self.column(logits, fill=float("inf"))
        probs = torch.softmax(logits, dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # probability of the more probable tokens
        drop_sorted = before >= p  # the first token has before == 0 < top_p: always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        return logits.masked_fill(drop, NEG_INF)


class MinP(LogitsProcessor):
    """Min-p sampling (Nguyen et al. 2024), as Hugging Face's ``MinPLogitsWarper``: keep the tokens whose
    probability is at least ``min_p`` times the row's largest probability. A number in [0, 1]; 0 (or None) is
    off, normalised to None."""

    field = "min_p"
    neutral = None

    @classmethod
    def check(cls, value) -> float | None:
        if value is None:
            return None
        return check_range("min_p", value, 0.0, 1.0, "a number from 0 to 1 (0 = off)") or None

    def apply(self, logits, counts):
        if self.values is None and self.value is None:
            return logits
        p = self.value if self.values is None else self.column(logits, fill=0.0)
        probs = torch.softmax(logits, dim=-1)
        top = probs.amax(dim=-1, keepdim=True)
        return logits.masked_fill(probs < p * top, NEG_INF)


class GrammarMask(LogitsProcessor):
    """Structured output: the tokens the row's grammar does not allow next become -inf; the allowed ones keep
    their logits exactly (a mask, not a rescaling). The setting is a
    :class:`decoderlab.generation.grammar.Grammar` (None: off); the row's position in it is its
    ``TokenCounts.grammars`` state, which ``TokenCounts.add`` advances with each sampled token. Last of the raw
    processors, so a greedy row is the argmax of the allowed tokens and top-k, top-p and min-p cut the
    distribution the grammar leaves."""

    field = "grammar"
    neutral = None
    uses_counts = True

    @classmethod
    def check(cls, value):
        return check_grammar(value)

    def apply(self, logits, counts):
        v = logits.size(-1)
        masks = [g.allowed(v) if g is not None else None for g in counts.grammars]
        if all(m is None for m in masks):
            return logits
        allowed = torch.stack([m if m is not None else torch.ones(v, dtype=torch.bool) for m in masks])
        return logits.masked_fill(~allowed.to(logits.device), NEG_INF)


#: the processors greedy and sampled rows share, in order (see the module docstring)
RAW_PROCESSORS: tuple[type[LogitsProcessor], ...] = (RepetitionPenalty, FrequencyPenalty, PresencePenalty,
                                                     LogitBias, SuppressTokens, GrammarMask)
#: the steps only sampled rows take, after the raw processors
WARPERS: tuple[type[LogitsProcessor], ...] = (Temperature, TopK, TopP, MinP)


class LogitsProcessorList(list):
    """Processors applied in list order: ``processors(logits, counts) -> logits`` (Hugging Face's name)."""

    @property
    def uses_counts(self) -> bool:
        return any(p.uses_counts for p in self)

    def __call__(self, logits: torch.Tensor, counts: TokenCounts | None = None) -> torch.Tensor:
        for proc in self:
            logits = proc(logits, counts)
        return logits

    @classmethod
    def for_rows(cls, steps: Sequence[type[LogitsProcessor]], rows: Sequence[Mapping]) -> "LogitsProcessorList":
        """The processors of ``steps`` for rows of settings (``rows[i][field]``): one shared value when every
        row has the same, per-row values otherwise; a step whose every row is neutral is left out (so rows
        without penalties pay nothing for them). ``Temperature`` is always kept (it guards the draw)."""
        out = cls()
        for step in steps:
            values = [row[step.field] for row in rows]
            if step is not Temperature and all(step.is_neutral(v) for v in values):
                continue
            out.append(step(values[0]) if len(set(values)) == 1 else step.per_row(values))
        return out
