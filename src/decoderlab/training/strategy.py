"""``--strategy fsdp``: fully sharded data parallel as decoderlab builds it, and the model after training.

Lightning's string ``"fsdp"`` is its ``FSDPStrategy`` (FSDP1): one flat unit for the whole model (no memory
saved), gradients reduced in bfloat16 under bf16-mixed, flat 1-D parameters that Muon cannot use, and the GPU
only. decoderlab's ``fsdp`` is FSDP2 instead (``torch.distributed.fsdp.fully_shard`` over DTensor
parameters, through Lightning's ``ModelParallelStrategy``, which runs on CPUs too): one unit per
``DecoderBlock`` plus the root (embeddings, final norm, output layer), gradients reduced in float32, every
parameter keeping its name and its 2-D shape (a ``DTensor`` sharded by rows), so parameter groups and Muon
see whole matrices. Lightning checkpoints are written from the full state dict (gathered collectively,
written by global rank 0), so they load under one process, DDP and FSDP alike.

After ``fit`` (or at a validation) the run's own code needs the model with its whole weights on one process:
:func:`full_model` gathers them (a collective: every process calls it), :func:`evaluation_model` puts them on
the device the model trained on, and :func:`on_training_device` does both for the end of a run.
Sources: PyTorch FSDP2 docs (``fully_shard``, ``MixedPrecisionPolicy``, ``torch.distributed.checkpoint.state_dict``);
Lightning's ``ModelParallelStrategy``.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from ..checkpoint import load_weights, unwrap_model
from ..config.names import OPTIMIZERS
from ..model import DecoderOnlyTransformer



def _flat_sharding(strategy: str) -> bool:
    """Whether Lightning's strategy of that name shards parameters (or their optimizer state) into flat 1-D
    pieces: FSDP1 with CPU offload, DeepSpeed."""
    return strategy == "fsdp_cpu_offload" or strategy.startswith("deepspeed")


class FSDPStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` as pure data parallelism over every process (tensor parallel
    size 1), writing full (not sharded) checkpoints; :meth:`decoderlab.training.LitModel.configure_model`
    shards the model (:func:`shard_model`)."""

    def __init__(self, **kwargs):
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=False,
                         **kwargs)

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every process is a data-parallel rank
        super().setup_environment()

    def optimizer_state(self, optimizer) -> dict:
        """The optimizer's whole state (gathered: a collective) in PyTorch's format, its parameters numbered
        in the optimizer's own order, as one process and DDP write it (Lightning's numbers them in the
        model's order, which a plain optimizer would misread); empty off rank 0."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        state = get_optimizer_state_dict(self.model, optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return _numbered(state) if self.global_rank == 0 else state

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """Lightning's loading of a full checkpoint, with the optimizer states read in PyTorch's numbering
        (see :meth:`optimizer_state`): a checkpoint of one process, DDP or FSDP resumes alike."""
        from lightning.fabric.strategies.model_parallel import _load_checkpoint
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        path = Path(self.broadcast(checkpoint_path))
        checkpoint = _load_checkpoint(path=path, state={"state_dict": self.model},
                                      strict=self.lightning_module.strict_loading, weights_only=weights_only)
        options = StateDictOptions(full_state_dict=True, strict=self.lightning_module.strict_loading)
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=_named(state, optimizer, self.model),
                                     options=options)
        return checkpoint


def _numbered(state: dict) -> dict:
    """An optimizer state keyed by parameter names (torch.distributed.checkpoint's) in PyTorch's format:
    each parameter numbered by its place in the groups."""
    index = {name: i for i, name in enumerate(n for g in state["param_groups"] for n in g["params"])}
    return {"state": {index[n]: v for n, v in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


def _named(state: dict, optimizer, model) -> dict:
    """PyTorch's numbered optimizer state, keyed by the names of ``optimizer``'s parameters in ``model``
    instead (the k-th number of the saved groups is the k-th parameter of the optimizer's groups)."""
    names = {id(p): n for n, p in model.named_parameters()}
    current = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    saved = [i for g in state["param_groups"] for i in g["params"]]
    if len(saved) != len(current):
        raise ValueError(f"the checkpoint's optimizer state has {len(saved)} parameters, this optimizer "
                         f"{len(current)}")
    name = dict(zip(saved, current))
    return {"state": {name[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [name[i] for i in g["params"]]} for g in state["param_groups"]]}


def build_strategy(strategy: str):
    """What ``Trainer(strategy=...)`` gets for ``strategy``: an :class:`FSDPStrategy` for "fsdp", else the
    name itself (Lightning's)."""
    return FSDPStrategy() if strategy == "fsdp" else strategy


def check_strategy(strategy: str, *, optimizer: str = "adamw", accelerator: str = "auto",
                   compile=False) -> None:
    """Refuse, before any process starts, a combination that cannot run: ``--strategy fsdp`` on Apple MPS
    (no distributed backend) or with ``--compile`` (not supported here yet), and Muon under Lightning's flat
    FSDP1 and DeepSpeed strategies (naming ``--strategy fsdp``, which keeps whole matrices).

    Raises:
        ValueError: one line naming the strategy, what cannot run under it and the alternative.
    """
    if optimizer not in OPTIMIZERS:
        return  # TrainConfig names a bad optimizer itself
    if _flat_sharding(str(strategy)) and optimizer == "muon":
        raise ValueError(f"--strategy {strategy} shards each weight into flat 1-D pieces, and Muon orthogonalises "
                         f"whole matrices: use --strategy fsdp (FSDP2, whole matrices) or --optimizer adamw")
    if strategy != "fsdp":
        return
    if str(accelerator) == "mps":
        raise ValueError("--strategy fsdp needs CUDA GPUs or the CPU (Apple MPS has no distributed backend): "
                         "train on one device (--strategy auto)")
    if compile:
        raise ValueError("--compile cannot be combined with --strategy fsdp yet: train without --compile, or "
                         "with --strategy ddp")


def shard_model(model: torch.nn.Module, mesh) -> None:
    """FSDP2 in place: ``fully_shard`` each ``DecoderBlock`` of ``model`` (a ``DecoderOnlyTransformer``),
    then the model itself (the embeddings, final norm and output layer; tied weights stay one tensor), over
    the 1-D device ``mesh``; gradients are reduced in float32 whatever the autocast dtype. A no-op for a
    model already sharded."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if is_sharded(model):
        return
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    inner = unwrap_model(model)
    for block in inner.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(inner, mesh=mesh, mp_policy=policy)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are DTensors (sharded by FSDP2)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def full_model(trainer, model: torch.nn.Module) -> torch.nn.Module | None:
    """``model`` (a ``DecoderOnlyTransformer``) with its whole weights, on global rank 0; None on the others.

    Not sharded (one process, DDP): ``model`` itself on rank 0. Sharded (FSDP2): a collective -- every
    process must call it at the same point -- gathering the full state dict to rank 0's CPU, where a plain
    copy of the model is built (without touching the random number generator) and loaded with it.
    """
    if not is_sharded(model):
        return model if trainer.is_global_zero else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    inner = unwrap_model(model)
    state = get_model_state_dict(inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not trainer.is_global_zero:
        return None
    with torch.random.fork_rng(devices=[]):
        plain = DecoderOnlyTransformer(inner.config)
    load_weights(plain, state, source="the gathered FSDP state")
    plain.train(inner.training)
    return plain


def training_device(trainer) -> torch.device:
    """The device this process trained on (``trainer.strategy.root_device``; the CPU without a strategy)."""
    strategy = getattr(trainer, "strategy", None)
    return torch.device("cpu") if strategy is None else torch.device(strategy.root_device)


def evaluation_model(trainer, model: torch.nn.Module) -> tuple[torch.nn.Module | None, torch.device]:
    """``(model, device)`` for an evaluation after ``fit``: on global rank 0 the model with its whole weights
    (:func:`full_model`; a collective under FSDP) moved to the device it trained on -- Lightning moves the
    module back to the CPU when ``fit`` ends, and an evaluation there would run at CPU speed -- and that
    device; None and the device on the other processes. Move the model back with ``.cpu()`` when done."""
    device = training_device(trainer)
    full = full_model(trainer, model)
    if full is not None:
        full.to(device)
    return full, device


@contextmanager
def on_training_device(trainer, model: torch.nn.Module):
    """The end of a run: ``with on_training_device(trainer, model) as (final, device):`` -- every process
    enters (a collective under FSDP); ``final`` is the trained model with its whole weights on the device it
    trained on, on global rank 0 (None elsewhere), for the final evaluation and export; on leaving it is back
    on the CPU, as Lightning leaves a trained module, and is the model to return (a plain copy under FSDP)."""
    final, device = evaluation_model(trainer, model)
    try:
        yield final, device
    finally:
        if final is not None:
            final.cpu()
