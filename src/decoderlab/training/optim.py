"""The optimizer of a run and its learning-rate schedule, from a ``TrainConfig`` (plain torch, no Lightning):
``lr_at`` (warm-up then cosine, or warm-up/stable/decay), ``parameter_groups`` (every parameter in exactly one
group: decay for matrices, none for the rest), ``group_names`` (those groups, named once on the unwrapped model
before any strategy wraps or shards it), ``configure_optimizers`` (AdamW, or Muon + AdamW, + ``LambdaLR``) and
``apply_train_config`` (a restored optimizer made to follow a changed config); and the optimizers and schedules
beyond plain AdamW: Muon for the hidden weight matrices with AdamW for everything else, and the
warm-up/stable/decay ("WSD", trapezoid) schedule.

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
from ..config.train import TrainConfig
from ..positions import LearnedPositionEncoding



def muon_parameter_groups(model: torch.nn.Module) -> tuple[list[str], list[str], list[str]]:
    """Split a ``DecoderOnlyTransformer``'s parameters into ``(muon, adamw_decay, adamw_no_decay)`` names.

    muon: 2-D weight matrices inside the decoder blocks (attention ``qkv``/``proj``, MLP ``fc``/``gate``/``proj``).
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


# ---------------------------------------------------------------------------------------------------------
# The optimizer and schedule of a TrainConfig
# ---------------------------------------------------------------------------------------------------------


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up ``lr * (step + 1) / warmup`` for
    ``step < warmup``, then cosine decay from ``lr`` to ``min_lr``, reaching ``min_lr`` at ``step = max_steps``
    (and staying there). ``schedule="wsd"``: see :func:`decoderlab.training.optim.schedule_factor`."""
    if cfg.schedule != "cosine":
        return cfg.lr * schedule_factor(step, warmup=cfg.warmup, max_steps=cfg.max_steps, lr=cfg.lr,
                                        min_lr=cfg.min_lr, schedule=cfg.schedule, cooldown=cfg.cooldown)
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.max_steps - cfg.warmup)
    ratio = min(1.0, (step - cfg.warmup) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - cfg.min_lr)


def parameter_groups(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """Names of the parameters that get weight decay and of those that do not.

    Decayed: weight matrices of linear layers (attention projections, MLP). Not decayed: biases, norm
    weights, token and learned position embeddings (and ``fc_layer.weight`` when it is tied to the token
    embedding: each shared tensor is listed once, under its first name).
    """
    model = unwrap_model(model)
    embedding_ids = set()
    for module in model.modules():
        if isinstance(module, (torch.nn.Embedding, LearnedPositionEncoding)):
            embedding_ids.add(id(module.weight))
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():  # named_parameters lists a shared tensor once
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 and id(p) not in embedding_ids else no_decay).append(name)
    return decay, no_decay


def _fused_adamw_available() -> bool:
    try:
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad = torch.zeros(2)
        torch.optim.AdamW([p], lr=1e-3, fused=True).step()
        return True
    except (RuntimeError, TypeError, ValueError):  # pragma: no cover - older builds
        return False


def use_fused_adamw(cfg: TrainConfig, precision: str | None = None) -> bool:
    """Whether :func:`configure_optimizers` builds the fused AdamW: ``cfg.fused``, or when None, whether this
    PyTorch build has it -- but not under a mixed precision (``precision``: the one the run trains at,
    Lightning's name or decoderlab's; default ``cfg.precision``) with gradient clipping (Lightning refuses to
    clip a fused optimizer's gradients under mixed precision)."""
    if cfg.fused is not None:
        return bool(cfg.fused)
    if str(precision or cfg.precision).endswith("-mixed") and cfg.grad_clip > 0:
        return False
    return _fused_adamw_available()


def apply_train_config(optimizer: torch.optim.Optimizer, scheduler, cfg: TrainConfig, step: int) -> None:
    """Make an optimizer and schedule restored from a checkpoint follow ``cfg`` from optimizer step ``step``
    (0-based, the next step to run) on.

    Restoring a checkpoint brings back the saved learning rate, betas, eps and weight decay of each group
    and the schedule's base rate; after this, the groups made by :func:`configure_optimizers` (decayed
    first) hold ``cfg``'s values, the next step runs at ``lr_at(step, cfg)`` and every later one follows
    ``lr_at`` of ``cfg`` (warm-up and cosine recomputed for its ``max_steps``). A no-op for an unchanged
    config. A :class:`~decoderlab.training.optim.MuonAdamW`'s Muon groups take ``muon_lr`` (scaled by the same
    schedule), ``muon_momentum`` and ``muon_weight_decay``; its AdamW groups as above.
    """
    factor = lr_at(step, cfg) / cfg.lr
    muon = optimizer.muon if isinstance(optimizer, MuonAdamW) else None
    adamw = optimizer.adamw if isinstance(optimizer, MuonAdamW) else optimizer
    muon_ids = {id(g) for g in muon.param_groups} if muon is not None else set()
    fused = adamw.defaults.get("fused") if adamw is not None else None
    base_lrs = []
    k = 0  # index among the AdamW groups: the first is the decayed one (unless tagged)
    for group in optimizer.param_groups:
        if id(group) in muon_ids:
            group.update(initial_lr=cfg.muon_lr, lr=cfg.muon_lr * factor, momentum=cfg.muon_momentum,
                         weight_decay=cfg.muon_weight_decay)
            base_lrs.append(cfg.muon_lr)
            continue
        group["initial_lr"] = cfg.lr
        group["lr"] = cfg.lr * factor
        group["betas"] = tuple(cfg.betas)
        group["eps"] = cfg.eps
        if group.get("decay", k == 0):
            group["weight_decay"] = cfg.weight_decay
        if fused is not None:
            group["fused"] = fused
        base_lrs.append(cfg.lr)
        k += 1
    if scheduler is not None:
        scheduler.base_lrs = base_lrs
        scheduler.last_epoch = step
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def group_names(model: torch.nn.Module, optimizer: str = "adamw") -> dict[str, list[str]]:
    """The parameter groups of ``optimizer`` ("adamw" or "muon") by name, decided on the plain model:
    ``{"decay", "no_decay"}`` (:func:`parameter_groups`), plus ``"muon"`` for Muon
    (:func:`~decoderlab.training.optim.muon_parameter_groups`). Call it before a strategy wraps or shards the
    model (FSDP's flat 1-D shards would put every parameter in no-decay); parameters keep these names under
    DDP and FSDP2."""
    if optimizer == "muon":
        muon, decay, no_decay = muon_parameter_groups(model)
        return {"muon": muon, "decay": decay, "no_decay": no_decay}
    decay, no_decay = parameter_groups(model)
    return {"decay": decay, "no_decay": no_decay}


def _named(model: torch.nn.Module, names: dict[str, list[str]]) -> dict[str, list]:
    """``names``' groups as the parameters of ``model`` now (wrapped or sharded, under the same names).

    Raises:
        ValueError: a named parameter the model no longer has, or a trainable one in no group (a wrapper
            that renames parameters): naming it."""
    params = dict(unwrap_model(model).named_parameters())
    grouped = {n for group in names.values() for n in group}
    missing = sorted(grouped - set(params))
    stray = sorted(n for n, p in params.items() if p.requires_grad and n not in grouped)
    if missing or stray:
        raise ValueError(f"the model's parameters changed names after the optimizer groups were chosen "
                         f"(missing {missing[:3]}, ungrouped {stray[:3]}): a strategy that renames parameters "
                         f"cannot train this model; use --strategy ddp or fsdp")
    return {k: [params[n] for n in group] for k, group in names.items()}


def configure_optimizers(model: torch.nn.Module, cfg: TrainConfig, names: dict[str, list[str]] | None = None,
                         precision: str | None = None) -> dict:
    """AdamW with weight decay on matrices only (see :func:`parameter_groups`), fused when available, and a
    ``LambdaLR`` following :func:`lr_at`, stepped after every optimizer step. With ``optimizer="muon"``: a
    :class:`~decoderlab.training.optim.MuonAdamW` (Muon for the blocks' 2-D matrices, AdamW for the rest; see
    :func:`~decoderlab.training.optim.muon_parameter_groups`), the same schedule scaling both. ``names``: the
    groups by name (:func:`group_names`, chosen before wrapping; default: chosen now from ``model``);
    ``precision``: the precision the run trains at (for :func:`use_fused_adamw`). Returns Lightning's
    ``{"optimizer": ..., "lr_scheduler": {...}}`` dict."""
    groups = _named(model, names if names is not None else group_names(model, cfg.optimizer))
    fused = use_fused_adamw(cfg, precision)
    adamw = [{"params": groups["decay"], "weight_decay": cfg.weight_decay},
             {"params": groups["no_decay"], "weight_decay": 0.0}]
    if cfg.optimizer == "muon":
        adamw[0]["decay"], adamw[1]["decay"] = True, False
        opt = MuonAdamW(groups["muon"], adamw, muon_lr=cfg.muon_lr, muon_momentum=cfg.muon_momentum,
                        muon_weight_decay=cfg.muon_weight_decay, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                        fused=fused)
    else:
        opt = torch.optim.AdamW(adamw, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=bool(fused))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(step, cfg) / cfg.lr)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}
