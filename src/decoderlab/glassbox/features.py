"""What an SAE's features do inside a model: activations read at a hook, the reconstruction spliced back in,
SAELens's evaluation, a feature ablated or steered with, and the numbers of a feature's dashboard.

- :func:`hook_activations`: (B, T, d_in) at one hook point, the pass stopped right after it (the batches an
  SAE trains on; equal to ``run_with_cache(...)[1][hook]``).
- :func:`splice_sae`, :func:`feature_ablation`, :func:`feature_steering`: ``(name, fn)`` hooks for
  ``run_with_hooks`` / ``generate(hooks=...)``.
- :func:`evaluate_sae`: L0, explained variance, MSE, dead share and the cross-entropy loss recovered, on
  held-out windows (SAELens's ``run_evals``).
- :func:`feature_dashboard`: one feature's top activating contexts, activation histogram, logit effects and
  density (as SAELens's / Neuronpedia's dashboards show them).

Sources: SAELens ``evals.py`` (``get_recons_loss``, ``ce_loss_score``, ``ExplainedVarianceCalculator``);
Bricken et al. 2023 (feature dashboards, logit effects); Templeton et al. 2024 (feature steering).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..hooks import hook_model
from .cache import as_ids, forward_with_hooks
from .sae import SparseAutoencoder


class _Reached(Exception):
    """Raised by the hook that read the activation: the rest of the pass is not needed."""


def hook_activations(model, token_ids, hook: str, *, tokenizer=None) -> torch.Tensor:
    """(B, T, d_in) float the activation at ``hook`` for ``token_ids`` (per-head points (B, T, H, d_head)
    flattened to H * d_head, as SAELens's ``hook_z``); the forward pass stops after that point (eval mode, no
    gradients). Raises ``ValueError`` for an unknown hook name or bad ids (as ``run_with_cache``)."""
    model = hook_model(model)
    ids = as_ids(model, token_ids, tokenizer)
    got = {}

    def keep(x: torch.Tensor, name: str):
        got["x"] = x.detach()
        raise _Reached

    try:
        forward_with_hooks(model, ids, [(hook, keep)])
    except _Reached:
        pass
    x = got["x"]
    return x.flatten(2) if x.dim() == 4 else x


def _as_point(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return x.reshape(like.shape).to(like.dtype)


def splice_sae(sae: SparseAutoencoder, hook: str):
    """The hook that replaces the activation at ``hook`` with the SAE's reconstruction (SAELens's spliced run:
    the CE loss "with SAE")."""
    def fn(x: torch.Tensor, name: str):
        return _as_point(sae(x.flatten(2) if x.dim() == 4 else x), x)
    return (hook, fn)


def check_feature(sae: SparseAutoencoder, feature) -> int:
    """``feature`` as an int in 0 .. d_sae - 1, or ``ValueError`` naming the range."""
    n = sae.d_sae
    if isinstance(feature, bool) or not isinstance(feature, numbers.Integral) or not 0 <= int(feature) < n:
        raise ValueError(f"feature {feature!r} is out of range; valid features are 0 .. {n - 1} (d_sae={n})")
    return int(feature)


def _positions_mask(x: torch.Tensor, positions) -> torch.Tensor:
    """(1, T, 1) 1.0 at ``positions`` (None: all) of the activation's T axis."""
    t = x.size(1)
    mask = torch.zeros(1, t, 1, dtype=x.dtype, device=x.device)
    if positions is None:
        return mask + 1
    for p in [positions] if isinstance(positions, numbers.Integral) else positions:
        if not -t <= int(p) < t:
            raise ValueError(f"position {p} is outside the text of {t} tokens; valid: {-t} .. {t - 1}")
        mask[0, int(p)] = 1
    return mask


def feature_ablation(sae: SparseAutoencoder, hook: str, feature, positions=None):
    """The hook that removes one feature from the activation at ``hook``: x - f_F(x) W_dec[F] (at
    ``positions``, default all), leaving the rest of x -- the SAE's error included -- as it was."""
    feature = check_feature(sae, feature)

    def fn(x: torch.Tensor, name: str):
        flat = x.flatten(2) if x.dim() == 4 else x
        f = sae.encode(flat)[..., feature:feature + 1]
        return _as_point(flat - _positions_mask(flat, positions) * f * sae.W_dec[feature], x)
    return (hook, fn)


def feature_steering(sae: SparseAutoencoder, hook: str, feature, scale: float, positions=None):
    """The hook that adds ``scale`` x feature F's unit direction W_dec[F] to the activation at ``hook`` (at
    ``positions``, default all): steering with a feature (Templeton et al. 2024)."""
    feature = check_feature(sae, feature)
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")

    def fn(x: torch.Tensor, name: str):
        flat = x.flatten(2) if x.dim() == 4 else x
        return _as_point(flat + _positions_mask(flat, positions) * float(scale) * sae.W_dec[feature], x)
    return (hook, fn)


def _zero(hook: str):
    return (hook, lambda x, name: torch.zeros_like(x))


def held_out_windows(tokens, context: int, max_windows: int | None = None) -> torch.Tensor:
    """(n, context + 1) int64 the non-overlapping windows of a 1-D token array (inputs ``w[:, :-1]``, targets
    ``w[:, 1:]``), at most ``max_windows``. Raises ``ValueError`` when not one window fits."""
    tokens = np.asarray(tokens)
    n = (len(tokens) - 1) // context
    if n < 1:
        raise ValueError(f"{len(tokens)} held-out tokens are too few for one window of {context + 1}")
    n = n if max_windows is None else min(n, int(max_windows))
    idx = np.arange(n)[:, None] * context + np.arange(context + 1)
    return torch.from_numpy(tokens[idx].astype(np.int64))


@dataclass
class SAEEvaluation:
    """SAELens's evaluation of an SAE on held-out tokens.

    Attributes:
        tokens: tokens evaluated.
        l0: mean number of active features per token.
        explained_variance: 1 - E||x - x̂||² / (E||x||² - ||E x||²) (SAELens's ``explained_variance``).
        mse: E||x - x̂||² (summed over d_in, averaged over tokens).
        dead_share: the share of features that never fired on these tokens.
        ce_clean, ce_sae, ce_zero: next-token cross-entropy (nats/token) of the clean pass, with the
            reconstruction spliced in, and with the activation zero-ablated.
        ce_loss_recovered: (ce_zero - ce_sae) / (ce_zero - ce_clean): 1 = as good as the model, 0 = as bad as
            removing the activation (SAELens's ``ce_loss_score``).
        density: (d_sae,) the share of tokens on which each feature fired.
    """

    tokens: int
    l0: float
    explained_variance: float
    mse: float
    dead_share: float
    ce_clean: float
    ce_sae: float
    ce_zero: float
    ce_loss_recovered: float
    density: torch.Tensor = field(repr=False)

    @property
    def dead_features(self) -> int:
        """The features that fired on none of these tokens (``dead_share`` x d_sae): the measure training's
        progress lines count over as many of its last tokens."""
        return int((self.density == 0).sum())

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "density"}

    def table(self) -> str:
        rows = [("tokens", f"{self.tokens}"), ("L0 (active features per token)", f"{self.l0:.2f}"),
                ("explained variance", f"{self.explained_variance:.4f}"), ("MSE", f"{self.mse:.5g}"),
                (f"dead (fired on none of the {self.tokens:,} tokens)",
                 f"{self.dead_features:,}/{self.density.numel():,} ({100 * self.dead_share:.2f}%)"),
                ("CE clean / with SAE / zero-ablated (nats)",
                 f"{self.ce_clean:.4f} / {self.ce_sae:.4f} / {self.ce_zero:.4f}"),
                ("CE loss recovered", f"{self.ce_loss_recovered:.4f}")]
        w = max(len(r[0]) for r in rows)
        return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


class _Sums:
    """Float64 running sums of one evaluation."""

    def __init__(self, d_sae: int):
        self.n = 0
        self.sum_x = None
        self.sq = self.res = self.l0 = 0.0
        self.fired = torch.zeros(d_sae, dtype=torch.float64)
        self.ce = {"clean": 0.0, "sae": 0.0, "zero": 0.0}

    def add(self, x: torch.Tensor, x_hat: torch.Tensor, f: torch.Tensor) -> None:
        x, x_hat = x.double(), x_hat.double()
        self.n += x.size(0)
        s = x.sum(0)
        self.sum_x = s if self.sum_x is None else self.sum_x + s
        self.sq += float(x.pow(2).sum())
        self.res += float((x - x_hat).pow(2).sum())
        active = f != 0
        self.l0 += float(active.sum())
        self.fired += active.sum(0).double()


def _ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return float(F.cross_entropy(logits.double().flatten(0, 1), targets.flatten(), reduction="sum"))


@torch.no_grad()
def evaluate_sae(model, sae: SparseAutoencoder, hook: str, windows: torch.Tensor, *, batch_size: int = 32,
                 progress=None) -> SAEEvaluation:
    """SAELens's evaluation of ``sae`` at ``hook`` over ``windows`` (n, T + 1) of held-out token ids
    (:func:`held_out_windows`): per batch one clean pass (the activations and CE), one with the reconstruction
    spliced in (:func:`splice_sae`, through ``forward_with_hooks`` as ``run_with_hooks``) and one with the
    activation zero-ablated; sums in float64. ``progress``: called after each pass with the tokens evaluated
    so far (of n x T), a batch counting a third at each of its passes (a pass of a large model takes seconds;
    e.g. :meth:`decoderlab.waiting.ProgressLines.update`). Raises ``ValueError`` for an unknown hook or bad ids."""
    model = hook_model(model)
    sums = _Sums(sae.d_sae)
    for i in range(0, windows.size(0), batch_size):
        w = windows[i:i + batch_size].to(model.we.weight.device)
        ids, targets = as_ids(model, w[:, :-1]), w[:, 1:]
        done, batch = sums.n, ids.numel()
        got = {}

        def keep(x, name):
            got["x"] = x.detach()

        def said(passes: int) -> None:
            if progress is not None:
                progress(done + batch * passes // 3)

        clean = forward_with_hooks(model, ids, [(hook, keep)])
        x = got["x"].flatten(2) if got["x"].dim() == 4 else got["x"]
        x = x.flatten(0, 1)
        f = sae.encode(x)
        sums.add(x, sae.decode(f), f)
        sums.ce["clean"] += _ce_sum(clean, targets)
        said(1)
        sums.ce["sae"] += _ce_sum(forward_with_hooks(model, ids, [splice_sae(sae, hook)]), targets)
        said(2)
        sums.ce["zero"] += _ce_sum(forward_with_hooks(model, ids, [_zero(hook)]), targets)
        said(3)
    return _evaluation(sums)


def _evaluation(s: _Sums) -> SAEEvaluation:
    n = s.n
    variance = s.sq / n - float((s.sum_x / n).pow(2).sum())
    mse = s.res / n
    ev = (1.0 if mse < 1e-10 else 0.0) if variance < 1e-10 else 1.0 - mse / variance
    ce = {k: v / n for k, v in s.ce.items()}
    gap = ce["zero"] - ce["clean"]
    recovered = (ce["zero"] - ce["sae"]) / gap if abs(gap) > 1e-12 else float("nan")
    density = (s.fired / n).float()
    return SAEEvaluation(tokens=n, l0=s.l0 / n, explained_variance=ev, mse=mse,
                         dead_share=float((s.fired == 0).double().mean()), ce_clean=ce["clean"],
                         ce_sae=ce["sae"], ce_zero=ce["zero"], ce_loss_recovered=recovered, density=density)


# ---- one feature's dashboard ------------------------------------------------------------------------------

@dataclass
class FeatureContext:
    """One activating context: ``ids`` the window's tokens around ``position`` (an index into ``ids``), and
    ``activations`` the feature's value at each of them."""

    ids: list[int]
    position: int
    activation: float
    activations: list[float]


@dataclass
class FeatureDashboard:
    """The numbers of one feature's dashboard.

    Attributes:
        feature: its index; ``hook``: where the SAE reads.
        density: the share of tokens on which it fired; ``tokens``: tokens read.
        contexts: the top activating contexts, strongest first (:class:`FeatureContext`).
        histogram: (counts, edges) of its non-zero activations (``numpy.histogram``).
        logit_effects: (V,) its direction's direct effect on each next-token logit: W_dec[F] through the
            final norm's linear part (centred for layernorm, times the norm's weight) and the output layer.
    """

    feature: int
    hook: str
    density: float
    tokens: int
    contexts: list[FeatureContext]
    histogram: tuple[np.ndarray, np.ndarray]
    logit_effects: torch.Tensor = field(repr=False)

    def top_logits(self, n: int = 10, largest: bool = True) -> list[tuple[int, float]]:
        """The ``n`` tokens the feature promotes most (``largest``) or suppresses most, as (id, effect)."""
        v, i = self.logit_effects.topk(min(n, self.logit_effects.numel()), largest=largest)
        return list(zip(i.tolist(), v.tolist()))


def logit_effects(model, sae: SparseAutoencoder, feature) -> torch.Tensor:
    """(V,) feature ``feature``'s decoder direction through the final norm's linear part and the output layer
    (Bricken et al. 2023's logit weights): the direction centred (layernorm only), times the norm's weight,
    dotted with every row of ``fc_layer.weight``; the biases left out. Needs an SAE on a residual stream
    point (d_in = d_model)."""
    model = hook_model(model)
    feature = check_feature(sae, feature)
    d = sae.W_dec[feature].detach().double()
    if d.numel() != model.config.d_model:
        raise ValueError(f"logit effects need an SAE on the residual stream (d_in = d_model = "
                         f"{model.config.d_model}); this one has d_in = {d.numel()}")
    norm = model.norm_f
    if isinstance(norm, nn.LayerNorm):
        d = d - d.mean()
    if not isinstance(norm, nn.Identity) and getattr(norm, "weight", None) is not None:
        d = d * norm.weight.detach().double()
    return (model.fc_layer.weight.detach().double() @ d).float()


def _top_contexts(acts: torch.Tensor, windows: torch.Tensor, n: int, before: int, after: int
                  ) -> list[FeatureContext]:
    flat = acts.flatten()
    top = flat.topk(min(n, int((flat > 0).sum())))
    t = acts.size(1)
    out = []
    for value, index in zip(top.values.tolist(), top.indices.tolist()):
        row, pos = divmod(index, t)
        lo, hi = max(0, pos - before), min(t, pos + after + 1)
        out.append(FeatureContext(ids=windows[row, lo:hi].tolist(), position=pos - lo, activation=value,
                                  activations=acts[row, lo:hi].tolist()))
    return out


@torch.no_grad()
def feature_dashboard(model, sae: SparseAutoencoder, hook: str, feature, windows: torch.Tensor, *,
                      n_contexts: int = 12, before: int = 24, after: int = 4, bins: int = 30,
                      batch_size: int = 32) -> FeatureDashboard:
    """The dashboard numbers of ``feature`` over ``windows`` (n, T) token ids (the inputs; a held-out split's
    windows): its activation at every token, the top ``n_contexts`` tokens with ``before`` tokens before and
    ``after`` after, a ``bins``-bin histogram of its non-zero activations, its density and its logit
    effects. Raises ``ValueError`` for a feature out of range (naming the range)."""
    model = hook_model(model)
    feature = check_feature(sae, feature)
    cols = []
    for i in range(0, windows.size(0), batch_size):
        x = hook_activations(model, windows[i:i + batch_size].to(model.we.weight.device), hook)
        cols.append(sae.encode(x)[..., feature].float().cpu())
    acts = torch.cat(cols)  # (n, T)
    nonzero = acts[acts > 0].numpy()
    hist = np.histogram(nonzero, bins=bins) if nonzero.size else (np.zeros(bins, dtype=np.int64),
                                                                   np.linspace(0, 1, bins + 1))
    return FeatureDashboard(feature=feature, hook=hook, density=float((acts > 0).float().mean()),
                            tokens=acts.numel(), contexts=_top_contexts(acts, windows, n_contexts, before, after),
                            histogram=hist, logit_effects=logit_effects(model, sae, feature))


@torch.no_grad()
def token_features(model, sae: SparseAutoencoder, hook: str, token_ids, *, top: int = 8, tokenizer=None
                   ) -> list[list[tuple[int, float]]]:
    """For each position of one text, its ``top`` strongest active features as (feature, activation),
    strongest first (the page's hover)."""
    x = hook_activations(model, token_ids, hook, tokenizer=tokenizer)[0]
    f = sae.encode(x)
    v, i = f.topk(min(top, sae.d_sae), dim=-1)
    return [[(int(a), float(b)) for a, b in zip(ii, vv) if b > 0] for ii, vv in zip(i.tolist(), v.tolist())]
