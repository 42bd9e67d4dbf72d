"""Optimizers and learning-rate schedules beyond plain AdamW: Muon for the hidden weight matrices with AdamW
for everything else, and the warm-up/stable/decay ("WSD", trapezoid) schedule.

Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers in neural networks"; ``torch.optim.Muon``)
orthogonalises the momentum of each 2-D weight matrix with a few Newton-Schulz iterations; it is meant for the
hidden matrices only. Embeddings, the output layer, norm gains and biases stay with AdamW (as in the
modded-nanogpt and nanochat speedruns). :func:`muon_parameter_groups` puts every parameter in exactly one
group; :class:`MuonAdamW` steps both optimizers as one ``torch.optim.Optimizer``, so Lightning's automatic
optimization, gradient clipping, ``LambdaLR``, a gradient scaler and checkpoints see a single optimizer, whose
``state_dict`` is PyTorch's standard ``{"state", "param_groups"}`` (what DDP, FSDP and one process save alike).

Under FSDP2 the parameters are ``DTensor`` shards of their matrices; :class:`WholeMatrixMuon` gathers each
momentum-corrected matrix for the Newton-Schulz iteration (which needs the whole matrix) and keeps
everything else sharded.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

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


def _is_dtensor(p) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def _whole_matrix_update(p, grad, buf, group) -> None:
    """``torch.optim.Muon``'s update of one sharded (DTensor) matrix ``p``: momentum and weight decay on the
    shards, Newton-Schulz on the gathered whole matrix (every process computes the same), the result cut
    back to this process's rows."""
    from torch.distributed.tensor import distribute_tensor

    momentum, lr = group["momentum"], group["lr"]
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if group["nesterov"] else buf
    whole = _zeropower_via_newtonschulz(update.full_tensor(), group["ns_coefficients"], group["ns_steps"],
                                        group["eps"])
    mine = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)  # no communication
    p.mul_(1 - lr * group["weight_decay"])
    p.add_(mine, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))


class WholeMatrixMuon(torch.optim.Muon):
    """``torch.optim.Muon`` that also steps FSDP2's sharded (DTensor) matrices correctly: applied to shards,
    ``torch.optim.Muon`` would orthogonalise each process's rows alone (measured: 1e-2 off one process after 3
    steps). Plain tensors take ``torch.optim.Muon.step`` unchanged."""

    @torch.no_grad()
    def step(self, closure=None):
        if not any(_is_dtensor(p) for g in self.param_groups for p in g["params"]):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            for p, grad, buf in zip(params, grads, bufs):
                _whole_matrix_update(p, grad, buf, group)
        return loss


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over ``muon_params`` and ``torch.optim.AdamW`` over ``adamw_groups``, as one optimizer.

    ``param_groups`` is the Muon groups followed by the AdamW groups (the same dicts the two inner optimizers
    use) and ``state`` the one per-parameter state both inner optimizers write into, so a learning-rate
    scheduler, gradient clipping or a gradient scaler acting on it acts on both. ``step(closure)`` evaluates
    the closure once, then steps Muon (:class:`WholeMatrixMuon`) and AdamW. ``state_dict()`` is PyTorch's
    standard ``{"state", "param_groups"}`` over those groups; ``load_state_dict`` takes it, and the
    ``{"muon": ..., "adamw": ...}`` of checkpoints written before.

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
        self.muon = (WholeMatrixMuon(muon_params, lr=muon_lr, momentum=muon_momentum,
                                     weight_decay=muon_weight_decay) if muon_params else None)
        self.adamw = (torch.optim.AdamW(adamw_groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused)
                      if adamw_groups else None)
        inner = [o for o in (self.muon, self.adamw) if o is not None]
        super().__init__([{"params": g["params"]} for o in inner for g in o.param_groups], {})
        self._share(inner_groups=[g for o in inner for g in o.param_groups], state=self.state)

    def _share(self, inner_groups, state) -> None:
        """Make ``param_groups`` the inner optimizers' groups (Muon's first) and ``state`` the one state dict
        both write into (their parameters are disjoint)."""
        self.param_groups = list(inner_groups)
        self.state = state
        k = 0
        for o in (self.muon, self.adamw):
            if o is not None:
                n = len(o.param_groups)
                o.param_groups, o.state = self.param_groups[k:k + n], state
                k += n

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

    def load_state_dict(self, state_dict: dict) -> None:
        """Load PyTorch's standard ``{"state", "param_groups"}`` (as ``state_dict()`` writes), or the
        ``{"muon": ..., "adamw": ...}`` of checkpoints written before.

        Raises:
            ValueError: a state of other groups or sizes (PyTorch's message), or a legacy state with a Muon or
                AdamW part missing or unexpected.
        """
        if "muon" in state_dict or "adamw" in state_dict:
            self._load_legacy(state_dict)
            return
        super().load_state_dict(state_dict)  # new group dicts and a new state: share them again
        self._share(self.param_groups, self.state)

    def _load_legacy(self, state_dict: dict) -> None:
        for key, o in (("muon", self.muon), ("adamw", self.adamw)):
            if (o is None) != (state_dict.get(key) is None):
                raise ValueError(f"optimizer state does not match this MuonAdamW: {key!r} "
                                 f"{'missing' if o is not None else 'unexpected'}")
            if o is not None:
                o.load_state_dict(state_dict[key])
        state = defaultdict(dict)
        for o in (self.muon, self.adamw):
            if o is not None:
                state.update(o.state)
        self._share([g for o in (self.muon, self.adamw) if o is not None for g in o.param_groups], state)


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
