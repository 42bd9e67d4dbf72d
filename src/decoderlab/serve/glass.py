"""The glass-box parts of a trace response, all read from the one cache of the traced pass (or, for an
ablation, one more pass): the logit lens, the decomposition of a logit, the head detectors' scores and a
zero-ablation of chosen heads -- the library's own functions (``decoderlab.glassbox``), turned into the
protocol's models. Every function here runs on the scheduler's thread (hooks sit on the model object).
"""

from __future__ import annotations

import weakref

import torch

from ..glassbox import (all_head_scores, decompose, decompose_names, lens_names, logit_lens, run_with_hooks,
                        zero_ablation)
from ..glassbox.detectors import pattern_names
from ..glassbox.watching import probe_tokens
from .trace_protocol import (HeadRef, TokenProb, TraceAblation, TraceChange, TraceDecomposition, TraceHeadScores,
                             TraceLensEntry, TracePart, TraceToken)

#: how many tokens each logit-lens entry lists
LENS_TOP = 5

#: model -> its detectors' scores on the probe (the model never changes under a server; computed once)
_PROBE_SCORES: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def glass_names(model, scores_on_text: bool) -> list[str]:
    """The hook names the glass-box parts read from the traced pass (added to the trace's own)."""
    return lens_names(model) + decompose_names(model) + (pattern_names(model) if scores_on_text else [])


def top_probs(tokenizer, probs: torch.Tensor, k: int) -> list[TokenProb]:
    """The ``k`` most probable ids of ``probs`` (V,), most probable first."""
    vals, idx = torch.topk(probs, min(k, probs.numel()))
    return [TokenProb(id=int(i), token=tokenizer.decode([int(i)]), prob=float(v))
            for v, i in zip(vals.tolist(), idx.tolist())]


def lens_part(cache, tokenizer, position: int) -> list[TraceLensEntry]:
    """``logit_lens(cache, position)``: every entry's most probable tokens."""
    lens = logit_lens(cache, position)
    probs = lens.probs()[:, 0, 0]  # (n_layer + 1, V)
    return [TraceLensEntry(label=label, top=top_probs(tokenizer, p, LENS_TOP)) for label, p in zip(lens.labels, probs)]


def decomposition_part(cache, tokenizer, position: int, token: int | None) -> TraceDecomposition:
    """``decompose(cache, position, token)``; ``token`` None: the most probable token at ``position``."""
    if token is None:
        token = int(cache.logits[0, position].argmax())
    d = decompose(cache, position, token)
    return TraceDecomposition(position=d.position, token=TraceToken(id=d.token, token=tokenizer.decode([d.token])),
                              logit=float(d.logit), total=float(d.total()),
                              parts=[TracePart(label=k, value=v) for k, v in d.as_dict().items()])


def _as_lists(scores: dict[str, torch.Tensor]) -> dict[str, list[list[float]]]:
    return {kind: t.tolist() for kind, t in scores.items()}


def scores_part(model, cache, on: str | None) -> TraceHeadScores | None:
    """``all_head_scores`` of every head on the traced tokens (from the cache; None for one token) or on the
    probe :func:`decoderlab.glassbox.watching.probe_tokens` gives (what ``--watch-heads`` records)."""
    if on is None or (on == "text" and cache.token_ids.size(1) < 2):
        return None
    if on == "text":
        return TraceHeadScores(on="text", scores=_as_lists(all_head_scores(model, cache=cache)))
    if model not in _PROBE_SCORES:
        _PROBE_SCORES[model] = _as_lists(all_head_scores(model, probe_tokens(model)))
    return TraceHeadScores(on="probe", scores=_PROBE_SCORES[model])


def ablation_part(model, tokenizer, ids: list[int], clean_logits: torch.Tensor, heads: list[HeadRef],
                  top: int) -> TraceAblation:
    """The last position's next-token distribution with ``heads`` zero-ablated (each head's slice of
    ``blocks.L.attn.hook_z`` set to 0: ``run_with_hooks`` with ``zero_ablation``), beside the clean one
    (``clean_logits``, (V,))."""
    hooks = [zero_ablation(model, f"blocks.{h.layer}.attn.hook_z", head=h.head) for h in heads]
    ablated = run_with_hooks(model, ids, hooks)[0, -1].double()
    p, q = torch.softmax(clean_logits.double(), -1), torch.softmax(ablated, -1)
    kl = float((p * (torch.log_softmax(clean_logits.double(), -1) - torch.log_softmax(ablated, -1))).sum())
    shown = list(dict.fromkeys([int(i) for i in torch.topk(p, min(top, p.numel())).indices]
                               + [int(i) for i in torch.topk(q, min(top, q.numel())).indices]))
    changes = sorted((TraceChange(id=i, token=tokenizer.decode([i]), before=float(p[i]), after=float(q[i]))
                      for i in shown), key=lambda c: -abs(c.after - c.before))
    return TraceAblation(heads=heads, top=top_probs(tokenizer, q, top), changes=changes, kl=kl)
