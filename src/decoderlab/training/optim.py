"""Optimizers and learning-rate schedules beyond plain AdamW: Muon for the hidden weight matrices with AdamW
for everything else, and the warm-up/stable/decay ("WSD", trapezoid) schedule.

Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers in neural networks"; ``torch.optim.Muon``)
orthogonalises the momentum of each 2-D weight matrix with a few Newton-Schulz iterations; it is meant for the
hidden matrices only. Embeddings, the output layer, norm gains and biases stay with AdamW (as in the
modded-nanogpt and nanochat speedruns). :func:`muon_parameter_groups` puts every parameter in exactly one
group; :class:`MuonAdamW` steps both optimizers as one ``torch.optim.Optimizer``, so Lightning's automatic
optimization, gradient clipping, ``LambdaLR`` and checkpoints see a single optimizer.
"""

from __future__ import annotations

import math

import torch

from ..checkpoint import unwrap_model
from ..config.names import OPTIMIZERS, SCHEDULES
from ..positions import LearnedPositionEncoding



def muon_parameter_groups(model: torch.nn.Module) -> tuple[list[str], list[str], list[str]]:
    """Split a ``DecoderOnlyTransformer``'s parameters into ``(muon, adamw_decay, adamw_no_decay)`` names.

    muon: 2-D weight matrices inside the decoder blocks (attention ``qkv``/``proj``, MLP ``fc``/``proj``).
    adamw_decay: other 2-D matrices that are not embeddings (the untied output layer ``fc_layer.weight``).
    adamw_no_decay: token and learned position embeddings (and the output layer when tied to them), norm
    gains, biases. Each tensor appears once, under its first name; frozen parameters are left out.
    """
    model = unwrap_model(model)
    embedding_ids = {id(m.weight) for m in model.modules()
                     if isinstance(m, (torch.nn.Embedding, LearnedPositionEncoding))}
    muon, decay, no_decay, seen = [], [], [], set()
    for name, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        if p.dim() == 2 and name.startswith("blocks.") and id(p) not in embedding_ids:
            muon.append(name)
        elif p.dim() >= 2 and id(p) not in embedding_ids:
            decay.append(name)
        else:
            no_decay.append(name)
    return muon, decay, no_decay


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over ``muon_params`` and ``torch.optim.AdamW`` over ``adamw_groups``, as one optimizer.

    ``param_groups`` is the Muon groups followed by the AdamW groups (the same dicts the two inner optimizers
    use), so a learning-rate scheduler or gradient clipping acting on it acts on both. ``step(closure)``
    evaluates the closure once, then steps Muon and AdamW. ``state_dict()`` is ``{"muon": ..., "adamw": ...}``.

    Args:
        muon_params: 2-D tensors (hidden weight matrices).
        adamw_groups: AdamW parameter groups (dicts with "params" and optional "weight_decay").
        muon_lr, muon_momentum, muon_weight_decay: Muon's lr (Keller Jordan's scaling: the update is
            multiplied by sqrt(max(1, rows / cols))), Nesterov momentum and decoupled weight decay.
        lr, betas, eps, fused: AdamW's.

    Raises:
        ValueError: a Muon parameter that is not 2-D (naming its shape), or no parameters at all.
    """

    def __init__(self, muon_params, adamw_groups, *, muon_lr: float = 0.05, muon_momentum: float = 0.95,
                 muon_weight_decay: float = 0.0, lr: float = 1e-3, betas=(0.9, 0.99), eps: float = 1e-8,
                 fused: bool = False):
        muon_params = list(muon_params)
        for p in muon_params:
            if p.dim() != 2:
                raise ValueError(f"Muon takes 2-D weight matrices only, got a parameter of shape {tuple(p.shape)}")
        adamw_groups = [g for g in adamw_groups if g["params"]]
        if not muon_params and not adamw_groups:
            raise ValueError("MuonAdamW got no parameters")
        self.muon = (torch.optim.Muon(muon_params, lr=muon_lr, momentum=muon_momentum,
                                      weight_decay=muon_weight_decay) if muon_params else None)
        self.adamw = (torch.optim.AdamW(adamw_groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused)
                      if adamw_groups else None)
        inner = [o for o in (self.muon, self.adamw) if o is not None]
        super().__init__([{"params": g["params"]} for o in inner for g in o.param_groups], {})
        self.param_groups = [g for o in inner for g in o.param_groups]  # shared with the inner optimizers

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in (self.muon, self.adamw):
            if o is not None:
                o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in (self.muon, self.adamw):
            if o is not None:
                o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": None if self.muon is None else self.muon.state_dict(),
                "adamw": None if self.adamw is None else self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        for key, o in (("muon", self.muon), ("adamw", self.adamw)):
            if (o is None) != (state_dict.get(key) is None):
                raise ValueError(f"optimizer state does not match this MuonAdamW: {key!r} "
                                 f"{'missing' if o is not None else 'unexpected'}")
            if o is not None:
                o.load_state_dict(state_dict[key])
        # the inner load replaces their group dicts: share them again
        self.param_groups = [g for o in (self.muon, self.adamw) if o is not None for g in o.param_groups]


def schedule_factor(step: int, *, warmup: int, max_steps: int, lr: float, min_lr: float,
                    schedule: str = "cosine", cooldown: float = 0.4) -> float:
    """Learning rate of optimizer step ``step`` (0-based) divided by the peak ``lr``.

    Both schedules warm up linearly, ``(step + 1) / warmup`` for ``step < warmup``. "cosine" then decays from
    1 to ``min_lr / lr`` along a half cosine, reaching it at ``step = max_steps``. "wsd" (warm-up, stable,
    decay; Hu et al. 2024 "MiniCPM") stays at 1 until the last ``cooldown`` fraction of ``max_steps``, then
    falls linearly to ``min_lr / lr`` at ``step = max_steps``. Beyond ``max_steps`` both stay at the end value.

    Raises:
        ValueError: an unknown schedule (naming the allowed ones) or ``cooldown`` outside [0, 1].
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; allowed: {', '.join(SCHEDULES)}")
    if not 0 <= cooldown <= 1:
        raise ValueError(f"cooldown must be a fraction of max_steps in [0, 1], got {cooldown!r}")
    if step < warmup:
        return (step + 1) / warmup
    end = min_lr / lr
    if schedule == "cosine":
        span = max(1, max_steps - warmup)
        ratio = min(1.0, (step - warmup) / span)
        return end + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1.0 - end)
    decay_steps = max(1, round(cooldown * max_steps))
    start = max_steps - decay_steps
    if step < start:
        return 1.0
    ratio = min(1.0, (step - start) / decay_steps)
    return 1.0 + ratio * (end - 1.0)
