"""Checkpoints: a directory with ``model.safetensors``, ``config.json`` and ``tokenizer.json``.

Layout of a checkpoint directory::

    model.safetensors   the weights (safetensors; tied tensors stored once)
    config.json         the ModelConfig
    tokenizer.json      the tokenizer
    meta.json           what the model was trained on ("task": "lm" | "chat"), its chat template ("chat_template",
                        for chat checkpoints: fine-tuned ones and the lesson's pair model) and by which version
    (training state files written by decoderlab.training, for --resume)

A LoRA run's directory is an adapter checkpoint instead (:func:`save_adapter_checkpoint`): ``adapter/`` (PEFT's
layout) in place of ``model.safetensors``, and in ``meta.json`` a pointer to the base it adapts -- ``"base"``
(a path; relative: inside the directory) and ``"base_sha256"`` (:func:`checkpoint_digest`), checked before the
base is used (:func:`check_base`). ``decoderlab.chat.load_model`` puts the adapter on that base.

Everything is written atomically: files go to a temporary name and are renamed into place, and a whole
directory is assembled next to its destination and swapped in, so a run killed while saving leaves the
previous checkpoint loadable. ``load_checkpoint`` needs no training code.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ._version import __version__
from .devices import resolve_device
from .dtypes import check_dtype, to_inference_dtype
from .files import atomic_write_bytes, atomic_write_text, replace_directory, temporary_directory, usual_mode
from .model import DecoderOnlyTransformer, ModelConfig
from .tokenizers import Tokenizer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
META_FILE = "meta.json"
REQUIRED = (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE)
#: a LoRA run directory's adapter (PEFT's layout: decoderlab.lora.save_adapter), in place of model.safetensors
ADAPTER_DIR = "adapter"
#: where a LoRA run keeps a base that has no file of its own (a model given in memory, a preset from scratch)
BASE_DIR = "base"
#: where a LoRA run writes its merged model when asked (an ordinary checkpoint)
MERGED_DIR = "merged"
#: the files of a directory a loader reads (its weights, config, tokenizer, template): what checkpoint_digest hashes
_MODEL_SUFFIXES = (".safetensors", ".bin", ".json", ".txt", ".model", ".jinja")
#: a run's bookkeeping, not its model: left out of checkpoint_digest
_BOOKKEEPING = ("run.json", "summary.json")
#: the ``meta.json`` key of a chat checkpoint's template (``decoderlab.chat.ChatTemplate.to_dict()``)
CHAT_TEMPLATE_KEY = "chat_template"
_PREFIXES = ("_orig_mod.", "module.", "_forward_module.")


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip wrapper prefixes (``_orig_mod.`` from torch.compile, ``module.`` from DDP, ...) from keys."""
    out = {}
    for k, v in state.items():
        while k.startswith(_PREFIXES):
            k = k.split(".", 1)[1]
        out[k] = v
    return out


def unwrap_model(model):
    """The ``DecoderOnlyTransformer`` inside a compiled or DDP-wrapped module."""
    for attr in ("_orig_mod", "module"):
        while hasattr(model, attr) and isinstance(getattr(model, attr), torch.nn.Module):
            model = getattr(model, attr)
    return model


def save_checkpoint(directory: str | os.PathLike, model, tokenizer, *, meta: dict | None = None,
                    extra_files: dict[str, bytes] | None = None, inplace: bool = False) -> Path:
    """Write a checkpoint directory atomically (see the module docstring) and return its path.

    Args:
        directory: destination; replaced as a whole if it exists.
        model: a ``DecoderOnlyTransformer`` (compiled or wrapped is fine).
        tokenizer: any decoderlab tokenizer.
        meta: extra metadata for ``meta.json`` (e.g. ``{"task": "lm"}``).
        extra_files: more files to place in the directory (name -> bytes).
        inplace: keep the directory and whatever else it holds (a training run's ``lightning/`` and
            ``logs/``) and replace the checkpoint's files one by one, each atomically (temporary file, then
            rename). Every file is either the old or the new version, so an interrupted save leaves a
            loadable checkpoint as long as config and tokenizer are unchanged (true within one run).

    Raises:
        ValueError: the tokenizer's vocabulary size differs from the model's num_tokens.
    """
    from safetensors.torch import save_model

    model = unwrap_model(model)
    if tokenizer.vocab_size != model.config.num_tokens:
        raise ValueError(
            f"tokenizer vocabulary size {tokenizer.vocab_size} does not match the model's num_tokens "
            f"{model.config.num_tokens}"
        )
    directory = Path(directory).absolute()
    if inplace:
        return _save_inplace(directory, model, tokenizer, meta, extra_files)
    check_output_dir(directory, extra_files)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_directory(directory)  # an error names directory, not the temporary name
    try:
        save_model(model, str(tmp / WEIGHTS_FILE))
        usual_mode(tmp / WEIGHTS_FILE)  # safetensors creates it 0600; the other files get the usual 0644
        (tmp / CONFIG_FILE).write_text(model.config.to_json(), encoding="utf-8")
        tokenizer.save(tmp / TOKENIZER_FILE)
        (tmp / META_FILE).write_text(
            json.dumps({"decoderlab_version": __version__, **(meta or {})}, indent=2), encoding="utf-8"
        )
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
        replace_directory(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _save_inplace(directory: Path, model, tokenizer, meta, extra_files) -> Path:
    from safetensors.torch import save_model

    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{WEIGHTS_FILE}.", suffix=".tmp")
    os.close(fd)
    try:
        save_model(model, tmp)  # safetensors writes a new file (mkstemp's 0600 would not survive it)
        usual_mode(tmp)  # so the mode is set after writing: 0644 under umask 022, as the other files
        os.replace(tmp, directory / WEIGHTS_FILE)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    atomic_write_text(directory / CONFIG_FILE, model.config.to_json())
    tokenizer.save(directory / TOKENIZER_FILE)  # atomic (Tokenizer.save)
    for name, data in (extra_files or {}).items():
        atomic_write_bytes(directory / name, data)
    atomic_write_text(directory / META_FILE, json.dumps({"decoderlab_version": __version__, **(meta or {})}, indent=2))
    return directory


def save_adapter_checkpoint(directory: str | os.PathLike, model, tokenizer, *, meta: dict) -> Path:
    """Write a LoRA run's checkpoint in place (see the module docstring): the adapter of ``model``
    (:func:`decoderlab.lora.save_adapter`, swapped in whole), ``config.json``, ``tokenizer.json`` and last
    ``meta.json`` -- which must hold the base pointer (``"base"``, ``"base_sha256"``) --, each atomically; no
    weights of the base.

    Raises:
        ValueError: the model has no adapters; the tokenizer's vocabulary size differs from the model's; a
            ``meta`` without the base pointer.
    """
    from .lora import save_adapter

    model = unwrap_model(model)
    if tokenizer.vocab_size != model.config.num_tokens:
        raise ValueError(f"tokenizer vocabulary size {tokenizer.vocab_size} does not match the model's num_tokens "
                         f"{model.config.num_tokens}")
    if not meta.get("base") or not meta.get("base_sha256"):
        raise ValueError("an adapter checkpoint's meta needs its base: \"base\" (a path) and \"base_sha256\"")
    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    save_adapter(directory / ADAPTER_DIR, model)
    atomic_write_text(directory / CONFIG_FILE, model.config.to_json())
    tokenizer.save(directory / TOKENIZER_FILE)
    atomic_write_text(directory / META_FILE, json.dumps({"decoderlab_version": __version__, **meta}, indent=2))
    return directory


def checkpoint_digest(path: str | os.PathLike) -> str:
    """The sha256 of what a loader reads from ``path``: a file's bytes (a GGUF file); for a directory, the name
    and bytes of each of its files with a model's suffix (weights, config, tokenizer, template: ``.safetensors``,
    ``.bin``, ``.json``, ``.txt``, ``.model``, ``.jinja``; not a run's ``run.json`` or ``summary.json``) and of
    its ``adapter/``, in name order. A base changed in any of them has another digest. Hex digits.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    import hashlib

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_file():
        files = [(path.name, path)]
    else:
        found = [p for p in path.iterdir() if p.is_file() and p.suffix in _MODEL_SUFFIXES and p.name not in _BOOKKEEPING]
        if (path / ADAPTER_DIR).is_dir():
            found += [p for p in (path / ADAPTER_DIR).iterdir() if p.is_file()]
        files = sorted((p.relative_to(path).as_posix(), p) for p in found)
    digest = hashlib.sha256()
    for name, p in files:
        digest.update(name.encode("utf-8") + b"\0")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
    return digest.hexdigest()


def is_adapter_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` is a LoRA run's adapter checkpoint: ``adapter/`` and a base pointer in ``meta.json``,
    no ``model.safetensors`` (a LoRA run of an earlier version wrote the merged weights: an ordinary checkpoint)."""
    directory = Path(directory)
    return (directory.is_dir() and not (directory / WEIGHTS_FILE).is_file() and (directory / ADAPTER_DIR).is_dir()
            and "base_sha256" in _meta_or_empty(directory))


def check_base(directory: str | os.PathLike, pointer: dict) -> Path:
    """The base a LoRA run ``directory`` adapts -- ``pointer``: its ``meta.json`` or ``run.json``, with ``"base"``
    (relative: inside ``directory``) and ``"base_sha256"`` -- once its files are checked to be the ones the
    adapter was trained on.

    Raises:
        FileNotFoundError: the base is gone (named). ValueError: the base changed since (named, both digests).
    """
    base = Path(pointer["base"])
    base = base if base.is_absolute() else Path(directory) / base
    if not base.exists():
        raise FileNotFoundError(f"the base {base} of the LoRA run {directory} does not exist: a LoRA run keeps its "
                                f"adapter and a pointer to its base; put the base back there")
    found = checkpoint_digest(base)
    if found != pointer["base_sha256"]:
        raise ValueError(f"the base {base} of the LoRA run {directory} has changed since the run (sha256 {found[:12]}, "
                         f"the run's {pointer['base_sha256'][:12]}): its adapter fits only the base it was trained "
                         f"on; put that base back, or start a new run")
    return base


def check_output_dir(directory: str | os.PathLike, extra_files: dict | None = None, *,
                     allowed: set[str] | None = None, what: str = "a decoderlab checkpoint",
                     new_run: bool = False) -> Path:
    """Check that ``directory`` may be replaced as a whole by a new checkpoint: it must not exist, or be empty,
    or hold only the files of ``what`` (by default a decoderlab checkpoint, recognised by its ``meta.json``).
    Anything else would be deleted, so it raises ``FileExistsError`` naming the directory and what it holds.

    ``allowed``: the file names that may be replaced (default: a decoderlab checkpoint's own files).
    ``new_run``: the directory is the output of a new training run (``train``, ``finetune``, ``train_pairs``),
    so it must not exist or be empty: an earlier checkpoint or run there is never replaced (it raises
    ``FileExistsError`` saying to choose another ``--out``, or to continue a run there with ``--resume``).
    """
    directory = Path(directory).absolute()
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"cannot write {what} to {directory}: it is a file, not a directory")
    if directory.is_dir():
        names = [p.name for p in directory.iterdir()]
        if new_run and names:
            listed = f"{', '.join(sorted(names)[:5])}{' ...' if len(names) > 5 else ''}"
            if (directory / "lightning" / "last.ckpt").is_file():
                raise FileExistsError(f"{directory} already holds a training run (lightning/last.ckpt); continue "
                                      f"it with --resume {directory}, or train into another --out directory")
            kind = "a checkpoint" if "decoderlab_version" in _meta_or_empty(directory) else "files"
            raise FileExistsError(f"refusing to replace {directory}: it already holds {kind} ({listed}) that a new "
                                  f"run would overwrite; choose another --out directory")
        own = allowed if allowed is not None else set(REQUIRED) | {META_FILE} | set(extra_files or ())
        foreign = sorted(n for n in names if n not in own)
        if not foreign and allowed is None and names and "decoderlab_version" not in _meta_or_empty(directory):
            foreign = sorted(names)  # files with our names, but not written by decoderlab
        if foreign:
            raise FileExistsError(
                f"refusing to replace {directory}: it holds files that are not part of {what} "
                f"({', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}); choose another output directory"
            )
    return directory


def _meta_or_empty(directory: Path) -> dict:
    try:
        meta = read_meta(directory)
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}


def check_checkpoint_dir(directory: str | os.PathLike) -> Path:
    """Raise ``FileNotFoundError`` naming the directory and the missing files, if it is not a checkpoint."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise FileNotFoundError(f"checkpoint {directory} is a file; a checkpoint is a directory holding "
                                f"{', '.join(REQUIRED)}")
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    missing = [f for f in REQUIRED if not (directory / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"checkpoint directory {directory} is incomplete: missing {', '.join(missing)} "
            f"(a checkpoint holds {', '.join(REQUIRED)})"
        )
    return directory


def read_meta(directory: str | os.PathLike) -> dict:
    """The checkpoint's ``meta.json`` as a dict ({} when absent). Raises ``ValueError`` naming a corrupt file."""
    p = Path(directory) / META_FILE
    if not p.is_file():
        return {}
    try:
        meta = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p} is not a valid JSON file: {e}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{p} must hold a JSON object, got {type(meta).__name__}")
    return meta


def read_config(directory: str | os.PathLike) -> ModelConfig:
    """The ``ModelConfig`` in ``directory/config.json`` (a checkpoint or a run directory), checked.

    Raises:
        FileNotFoundError: no config.json there.
        ValueError: not JSON, or a field of the wrong type or value (a hand-edited ``"n_layer": "4"``): the
            message names the file and the field.
    """
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (a checkpoint or run directory holds its model's config.json)")
    try:
        return ModelConfig.from_json(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a valid ModelConfig JSON file: {e}") from None


def load_checkpoint(directory: str | os.PathLike, map_location: str | torch.device = "cpu", dtype=None, *,
                    device: str | torch.device | None = None):
    """Load ``(model, tokenizer)`` from a checkpoint directory, without any training code.

    ``device``: where the model goes (``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``, or a ``torch.device``;
    :func:`decoderlab.devices.resolve_device`); None: ``map_location`` as given (default the CPU). The model
    is built on the meta device and the weights are read straight onto ``device`` and put in place
    (``load_state_dict(assign=True)``, tied weights tied again): no copy on the CPU on the way.

    Works for checkpoints written from compiled (``_orig_mod.``) and DDP-wrapped (``module.``) models.
    The model is returned in eval mode.

    ``dtype``: the weights for inference (see :mod:`decoderlab.dtypes`): None or ``torch.float32`` (default,
    as trained), ``torch.bfloat16`` / ``torch.float16`` (every parameter cast), or GGUF's blocks ``"q8_0"`` /
    ``"q4_0"`` / ``"q4_1"`` (every linear layer and the output layer, :mod:`decoderlab.quant`); the names in
    ``decoderlab.dtypes.DTYPES`` are accepted too. A model in another dtype is for inference (generation,
    evaluation); train and save the float32 one.

    Raises:
        FileNotFoundError: the directory or one of its required files is missing (named).
        ValueError: the tokenizer's vocabulary size does not match the config's num_tokens; a weight is
            missing or mis-shaped (named); an unknown dtype (the allowed ones listed).
        ValueError: a device this machine does not have (naming the ones it has), before any file is read.
    """
    from safetensors.torch import load_file

    target = torch.device(map_location) if device is None else resolve_device(device)
    check_dtype(dtype, target)  # an unknown dtype, or one the device cannot run, fails before any file is read
    directory = check_checkpoint_dir(directory)
    config = read_config(directory)
    read_meta(directory)  # a corrupt meta.json is named here rather than misread later
    tokenizer = Tokenizer.load(directory / TOKENIZER_FILE)
    if tokenizer.vocab_size != config.num_tokens:
        raise ValueError(
            f"checkpoint {directory}: tokenizer vocabulary size {tokenizer.vocab_size} does not match "
            f"config num_tokens {config.num_tokens}"
        )
    with torch.device("meta"):  # shapes only: every tensor comes from the file, on the target device
        model = DecoderOnlyTransformer(config)
    try:
        state = load_file(str(directory / WEIGHTS_FILE), device=str(target))
    except Exception as e:  # safetensors raises its own error type for a truncated or corrupt file
        raise ValueError(f"{directory / WEIGHTS_FILE} is not a readable safetensors file: {e}") from None
    state = clean_state_dict(state)
    load_weights(model, state, source=str(directory / WEIGHTS_FILE), assign=True)
    for module in model.modules():  # buffers computed, not stored (rope's cos/sin), made on the target device
        if hasattr(module, "materialize"):
            module.materialize(target)
    model.eval()
    to_inference_dtype(model, dtype)
    return model, tokenizer


def load_weights(model, state: dict[str, torch.Tensor], source: str = "state dict", *, assign: bool = False) -> None:
    """Copy ``state`` into ``model`` (``assign=True``: put its tensors in place, for a model built on the meta
    device); tied weights may be stored once. Raises ``ValueError`` naming a missing, unexpected or mis-shaped
    tensor."""
    own = model.state_dict()
    tied = {"fc_layer.weight"} if model.config.tie_weights else set()
    if tied and "we.weight" not in state and "fc_layer.weight" in state:
        state = {**state, "we.weight": state["fc_layer.weight"]}
    missing = [k for k in own if k not in state and k not in tied]
    unexpected = [k for k in state if k not in own]
    if missing:
        raise ValueError(f"{source}: missing tensor(s) {missing[:5]}")
    if unexpected:
        raise ValueError(f"{source}: unexpected tensor(s) {unexpected[:5]}")
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise ValueError(f"{source}: tensor {k} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)}")
    if assign:  # the model's dtype (float32), as a copy into it would give
        state = {k: v.to(own[k].dtype) if v.is_floating_point() else v for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=assign)  # (the model's post-hook ties the weights again)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:  # (cannot happen for a state that passed the checks above: a guard for the meta-device build)
        raise ValueError(f"{source}: tensor(s) {left[:5]} were not loaded")
