"""LoRA adapters on a ``DecoderOnlyTransformer`` through PEFT: wrap, count, merge back, save the adapter alone.

LoRA (Hu et al. 2021) freezes a linear layer's weight W (out x in) and learns a low-rank change to it::

    y = x W^T + (alpha / r) * dropout(x) A^T B^T        A: (r, in), B: (out, r), B = 0 at the start

so a targeted layer trains ``r * (in + out)`` numbers instead of ``in * out``. The layers are PEFT's
(``peft.inject_adapter_in_model``, the maintained implementation shared with litgpt's and TRL's users): the
model stays a ``DecoderOnlyTransformer`` whose targeted ``nn.Linear`` modules became ``peft`` LoRA layers,
so its forward pass, the KV-cache engine and the Lightning modules work on it unchanged, and only the
adapters have ``requires_grad``. :func:`merge_lora` folds ``W + (alpha / r) B A`` back into an ordinary model
(which :func:`decoderlab.checkpoint.save_checkpoint` writes as every checkpoint); :func:`save_adapter` writes
the adapter alone in PEFT's layout (``adapter_model.safetensors`` + ``adapter_config.json``).

Targets (``decoderlab.config.LORA_TARGETS``): ``attn`` -> every block's ``attention.qkv`` (and
``attention.proj`` when the model has an output projection), ``mlp`` -> ``mlp.fc`` and ``mlp.proj``. The
word embedding and the (often tied) output layer are never adapted.

QLoRA-style, over a base held in GGUF blocks (Dettmers et al. 2023, with llama.cpp's blocks in place of NF4): a
targeted :class:`decoderlab.quant.BlockLinear` (a GGUF file's matrix in its packed bytes) gets PEFT's LoRA layer
too -- registered with PEFT as a custom module type (``LoraConfig._register_custom_module``), its forward PEFT's
own, ``base(x) + scale * B(A(dropout(x)))`` --, so the frozen base trains in about the memory of its file: the
base's product goes through the block kernels (activations quantized to 8 bits, as ggml does), its gradient to
``x`` through the dequantized weight (``decoderlab.quant``), and only A and B take gradients. The adapter's keys
are the float base's (``blocks.0.attention.qkv.lora_A.weight``), so an adapter trained over blocks loads onto the
float base and back. Merging never writes into blocks (that would requantize, losing most of a small update):
:func:`merge_lora` returns a float32 model, the dequantized weight plus the update, as QLoRA does (PEFT's
bitsandbytes layers dequantize to merge); PEFT's in-place ``merge`` on a block layer is refused, saying so.

``peft`` (and through it ``transformers``) is imported only when an adapter is made or saved: install
``decoderlab[lora]``.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

import torch

from .config.names import DEFAULT_LORA_TARGETS, LORA_TARGETS
from .files import replace_directory, usual_mode
from .model import DecoderOnlyTransformer, initialisers_skipped
from .output import quiet_imports
from .half import HalfLinear, half_dtype
from .quant import (BlockLinear, block_dtypes, block_weights, dequantized_state_dict, is_block_layer,
                    weights_read_once)

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_NAME = "default"


def _peft():
    try:
        with quiet_imports():  # peft imports torchao, whose CUDA-kernel notices are no error of a CPU run
            import peft
    except ImportError:  # pragma: no cover - dev installs have it
        raise ImportError("LoRA needs the peft package: pip install 'decoderlab[lora]'") from None
    return peft


#: why merging an adapter into a block layer in place is refused, and what to do instead
BLOCK_MERGE = ("a LoRA adapter over GGUF blocks is not merged into them in place: the sum would be requantized, "
               "losing most of a small update; decoderlab.lora.merge_lora returns the merged model in float32 (the "
               "dequantized weight plus the update, as QLoRA merges), and a run's --merge writes that")


@functools.cache
def _block_lora_layer() -> type:
    """PEFT's LoRA ``Linear`` over a :class:`~decoderlab.quant.BlockLinear` (the class made once, PEFT imported)."""
    from peft.tuners.lora.layer import Linear

    class BlockLoraLinear(Linear):
        """PEFT's LoRA layer over a frozen block layer: the forward is PEFT's, ``base(x) + scale * B(A(dropout(
        x)))``; ``merge`` in place raises ``ValueError`` (:data:`BLOCK_MERGE`: :func:`merge_lora` makes a float
        model)."""

        def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
            raise ValueError(BLOCK_MERGE)

        def _get_in_out_features(self, module) -> tuple[int, int]:
            # (PEFT's guess for a layer type it does not know warns "proceed at your own risk")
            return module.in_features, module.out_features

    BlockLoraLinear.__module__ = __name__
    return BlockLoraLinear


def _lora_config(**settings):
    """``peft.LoraConfig(**settings)`` with :class:`~decoderlab.quant.BlockLinear` registered as a layer PEFT's
    LoRA may wrap (PEFT's custom-module API; every other layer type as PEFT handles it)."""
    config = _peft().LoraConfig(**settings)
    config._register_custom_module({BlockLinear: _block_lora_layer()})
    return config


def parse_targets(targets: str | Sequence[str]) -> tuple[str, ...]:
    """``"attn,mlp"`` or ``["attn", "mlp"]`` -> ``("attn", "mlp")`` (order kept, duplicates dropped).

    Raises:
        ValueError: an empty list or an unknown group, listing the known ones.
    """
    if isinstance(targets, str):
        items = targets.split(",")
    elif isinstance(targets, (list, tuple)) and all(isinstance(t, str) for t in targets):
        items = list(targets)
    else:
        raise ValueError(f"LoRA targets must be a list of names or a comma-separated string, got {targets!r}")
    items = [t.strip() for t in items if t.strip()]
    if not items:
        raise ValueError(f"LoRA targets must name at least one of {', '.join(LORA_TARGETS)}, got {targets!r}")
    unknown = [t for t in items if t not in LORA_TARGETS]
    if unknown:
        raise ValueError(f"unknown LoRA target {unknown[0]!r}; allowed: {', '.join(LORA_TARGETS)} "
                         f"(comma-separated)")
    return tuple(dict.fromkeys(items))


def lora_settings(rank: int, alpha: float | None = None, dropout: float = 0.0,
                  targets: str | Sequence[str] = DEFAULT_LORA_TARGETS) -> dict:
    """The LoRA settings of a run as plain data (what ``run.json`` records and :func:`apply_lora` takes as
    keywords): ``{"rank", "alpha", "dropout", "targets"}``, alpha None -> rank (scale 1), targets a list.

    Raises:
        ValueError: a rank that is not an integer >= 1, an alpha not > 0, a dropout outside [0, 1), a bad
            target (each named with what is allowed; a rank larger than a layer is found by :func:`apply_lora`).
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be an integer >= 1, got {rank!r}")
    alpha = float(rank) if alpha is None else alpha
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < float("inf"):
        raise ValueError(f"LoRA alpha must be a finite number > 0, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
    return {"rank": rank, "alpha": float(alpha), "dropout": float(dropout), "targets": list(parse_targets(targets))}


def describe_lora(model: torch.nn.Module, settings: dict) -> str:
    """One line for the terminal: the adapters' settings and the trainable parameter count of ``model``."""
    held = block_weights(model)  # (a block base's weights are buffers, not parameters)
    total = sum({id(p): p.numel() for p in model.parameters()}.values()) + held
    n = trainable_parameters(model)
    kind = " + ".join(block_dtypes(model))  # (a K-quant file's mix: every type, the most-held first)
    over = (f"over the base's {kind} blocks, as the file holds them (--dtype float32 dequantizes them)" if held
            else f"over a {next(model.parameters()).dtype} base".replace("torch.", ""))
    return (f"LoRA rank {settings['rank']} (alpha {settings['alpha']:g}, dropout {settings['dropout']:g}) on "
            f"{','.join(settings['targets'])} {over}: {n:,} trainable parameters of {total:,} "
            f"({n / max(total, 1):.2%})")


def lora_target_names(model: torch.nn.Module, targets: str | Sequence[str] = DEFAULT_LORA_TARGETS) -> list[str]:
    """The full names of the linear layers the target groups select (``blocks.0.attention.qkv``, ...): ``nn.Linear``
    or a :class:`~decoderlab.quant.BlockLinear` over GGUF blocks.

    Raises:
        ValueError: a bad target (see :func:`parse_targets`), or a group that names no layer of this model
            (``mlp`` on a model built with ``mlp='none'``).
    """
    groups = parse_targets(targets)
    linear = [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, BlockLinear))]
    names = []
    for g in groups:
        found = [n for n in linear if n.startswith("blocks.") and n.split(".", 2)[2] in LORA_TARGETS[g]]
        if not found:
            raise ValueError(f"LoRA target {g!r} names no layer of this model (it has no "
                             f"{' or '.join(LORA_TARGETS[g])} layers; linear layers: {', '.join(linear) or 'none'})")
        names.extend(found)
    return names


def _check_rank(model, names: list[str], rank) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be an integer >= 1, got {rank!r}")
    modules = dict(model.named_modules())
    for n in names:
        layer = modules[n]
        limit = min(layer.in_features, layer.out_features)
        if rank > limit:
            raise ValueError(f"LoRA rank {rank} is larger than layer {n} ({layer.in_features} -> "
                             f"{layer.out_features} features) allows; the rank must be at most {limit} (a "
                             f"higher rank adds nothing a full update would not)")
    return rank


def lora_parameter_count(model: torch.nn.Module, rank: int,
                         targets: str | Sequence[str] = DEFAULT_LORA_TARGETS) -> int:
    """The number of LoRA parameters of rank ``rank`` on the targets: sum over the targeted layers of
    ``rank * (in_features + out_features)`` (A is rank x in, B is out x rank)."""
    modules = dict(model.named_modules())
    return sum(rank * (modules[n].in_features + modules[n].out_features) for n in lora_target_names(model, targets))


def apply_lora(model: DecoderOnlyTransformer, rank: int, alpha: float | None = None, dropout: float = 0.0,
               targets: str | Sequence[str] = DEFAULT_LORA_TARGETS, *, init: bool = True) -> DecoderOnlyTransformer:
    """Put LoRA adapters on ``model`` in place and return it (still a ``DecoderOnlyTransformer``); only the
    adapters keep ``requires_grad``. A targeted layer held in GGUF blocks stays in them (QLoRA-style: module
    docstring).

    Args:
        rank: r, between 1 and the smaller side of every targeted layer.
        alpha: the scale numerator (the update is scaled by alpha / r); None: alpha = r (scale 1).
        dropout: dropout on the adapters' input, in [0, 1).
        targets: groups of ``decoderlab.config.LORA_TARGETS`` ("attn", "mlp"), as a list or "attn,mlp".
        init: True starts B at zero (the adapted model equals the base, LoRA's initialisation); False draws
            A and B at random (PEFT's ``init_lora_weights=False``, for tests).

    Raises:
        ValueError: a bad rank, alpha, dropout or target (each named with what is allowed); a model that
            already has adapters.
    """
    if has_lora(model):
        raise ValueError("the model already has LoRA adapters; merge them first (merge_lora)")
    settings = lora_settings(rank, alpha, dropout, targets)
    names = lora_target_names(model, settings["targets"])
    rank, alpha, dropout = _check_rank(model, names, rank), settings["alpha"], settings["dropout"]
    config = _lora_config(r=rank, lora_alpha=float(alpha), lora_dropout=float(dropout), target_modules=names,
                          bias="none", init_lora_weights=bool(init))
    with weights_read_once():  # PEFT reads a block layer's dequantized weight ~19 times (its device, dtype)
        _peft().inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    if half_dtype(model):  # PEFT gives adapters their base weight's dtype: over 16-bit matrices, train float32 ones
        for name, p in model.named_parameters():
            if "lora_" in name and p.dtype != torch.float32:
                p.data = p.data.float()
    return model


def has_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds LoRA layers (PEFT tuner layers)."""
    return any(hasattr(m, "base_layer") and hasattr(m, "lora_A") for m in model.modules())


def trainable_parameters(model: torch.nn.Module) -> int:
    """Parameters with ``requires_grad`` (shared tensors counted once): the adapters of a LoRA model."""
    seen = {}
    for p in model.parameters():
        if p.requires_grad:
            seen[id(p)] = p.numel()
    return sum(seen.values())


def merge_lora(model: DecoderOnlyTransformer) -> DecoderOnlyTransformer:
    """An ordinary ``DecoderOnlyTransformer`` with every adapter folded into its weight (``W + (alpha / r) B
    A``, PEFT's ``merge``); ``model`` itself is left as it is. Every parameter of the result trains. A model
    without adapters is returned as a copy.

    A base held in GGUF blocks or in 16-bit matrices (:mod:`decoderlab.half`) gives a float32 model: each adapted layer's weight dequantized plus its update, every other block layer dequantized --
    QLoRA's merge (PEFT's bitsandbytes layers dequantize to merge); nothing is requantized (quantize the result
    again, ``--dtype q8_0`` or a GGUF export, if blocks are wanted).

    The result has exactly the keys of a model built from ``model.config``, so ``save_checkpoint`` writes an
    ordinary checkpoint.
    """
    work = copy.deepcopy(model)
    layers = [(n, m) for n, m in work.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]
    for name, layer in layers:
        base = layer.get_base_layer()
        if is_block_layer(base) or isinstance(base, HalfLinear):
            base = _merged_linear(layer, base)
        else:
            layer.merge(safe_merge=True)
        parent_name, _, child = name.rpartition(".")
        setattr(work.get_submodule(parent_name) if parent_name else work, child, base)
    with initialisers_skipped():  # every parameter is loaded below (strict): 135M random numbers not drawn
        out = DecoderOnlyTransformer(model.config)
    out.lr = getattr(model, "lr", out.lr)
    p = next(model.parameters())
    out = out.to(device=p.device, dtype=torch.float32 if half_dtype(model) else p.dtype)
    out.load_state_dict(dequantized_state_dict(work), strict=True)
    out.train(model.training)
    return out


def _merged_linear(layer, base) -> torch.nn.Linear:
    """An ``nn.Linear`` (float32) holding the block layer ``base``'s dequantized weight (a 16-bit
    :class:`~decoderlab.half.HalfLinear`'s widened) plus ``layer``'s active adapters' updates (PEFT's
    ``get_delta_weight``), its bias ``base``'s: the update is not rounded to 16 bits.

    Raises:
        ValueError: an update that is not finite (PEFT's safe merge's check)."""
    weight = base.weight.detach().float() if isinstance(base, HalfLinear) else base.dequantize(torch.float32)
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:
            weight = weight + layer.get_delta_weight(adapter).to(device=weight.device, dtype=torch.float32)
    if not torch.isfinite(weight).all():
        raise ValueError("NaNs or infinities in the merged weights: the adapter is broken")
    with initialisers_skipped():  # its weight and bias are set just below
        linear = torch.nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                                 device=weight.device)
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if base.bias is not None:
        linear.bias = torch.nn.Parameter(base.bias.detach().float(), requires_grad=False)
    return linear


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights alone, with PEFT's key names (``blocks.0.attention.qkv.lora_A.weight``, ...)."""
    if not has_lora(model):
        raise ValueError("the model has no LoRA adapters")
    return {k: v.detach().contiguous() for k, v in _peft().get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME).items()}


def save_adapter(directory: str | os.PathLike, model: torch.nn.Module) -> Path:
    """Write the adapter alone in PEFT's layout, atomically (assembled next to ``directory``, then swapped
    in): ``adapter_model.safetensors`` (:func:`adapter_state_dict`) and ``adapter_config.json`` (the
    ``peft.LoraConfig``: rank, alpha, dropout, target layer names). Returns the directory.

    Raises:
        ValueError: the model has no adapters.
    """
    from safetensors.torch import save_file

    state = adapter_state_dict(model)
    config = model.peft_config[ADAPTER_NAME]
    directory = Path(directory).absolute()
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".tmp"))
    try:
        save_file(state, str(tmp / ADAPTER_WEIGHTS_FILE))
        usual_mode(tmp / ADAPTER_WEIGHTS_FILE)
        d = config.to_dict()
        d["target_modules"] = sorted(d["target_modules"])  # PEFT keeps a set
        (tmp / ADAPTER_CONFIG_FILE).write_text(json.dumps(d, indent=2, sort_keys=True, default=str), encoding="utf-8")
        replace_directory(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def load_adapter(directory: str | os.PathLike, model: DecoderOnlyTransformer) -> DecoderOnlyTransformer:
    """Put the adapter saved by :func:`save_adapter` on ``model`` (its base) in place and return it; the base may
    be float or held in GGUF blocks, whichever the adapter was trained over (the keys are the same).

    Raises:
        FileNotFoundError: a missing adapter file.  ValueError: weights that do not fit the model.
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"no {name} in {directory} (an adapter directory written by save_adapter)")
    d = json.loads((directory / ADAPTER_CONFIG_FILE).read_text(encoding="utf-8"))
    peft = _peft()
    config = _lora_config(r=d["r"], lora_alpha=d["lora_alpha"], lora_dropout=d["lora_dropout"],
                          target_modules=list(d["target_modules"]), bias="none")
    peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    result = peft.set_peft_model_state_dict(model, load_file(str(directory / ADAPTER_WEIGHTS_FILE)),
                                            adapter_name=ADAPTER_NAME)
    missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
    if missing or getattr(result, "unexpected_keys", []):
        raise ValueError(f"the adapter in {directory} does not fit the model: missing {missing[:3]}, unexpected "
                         f"{list(getattr(result, 'unexpected_keys', []))[:3]}")
    return model
