"""The one loader for inference: a checkpoint directory -> the model, its tokenizer, its chat template and its
``meta.json`` together, for ``decoderlab.load``, the command line, chat and the server. Below it are the readers
of the formats (``checkpoint.load_checkpoint`` for decoderlab's, ``hf.load_hf_directory`` for Hugging Face's,
``gguf.load_gguf`` for a GGUF file of llama.cpp and ollama); beside it, :func:`checkpoint_template`, the
chat template of a directory, and :func:`gguf_template`, a GGUF file's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import torch

from ..checkpoint import (ADAPTER_DIR, CONFIG_FILE, TOKENIZER_FILE, check_base, is_adapter_checkpoint, read_config,
                          read_meta)
from ..gguf import is_gguf_file, load_gguf, read_info
from ..hf import checkpoint_reader, is_hf_directory
from ..kernels import huge_pages
from .hf_templates import builtin_jinja, read_chat_template
from .jinja import JinjaChatTemplate
from .templates import TEMPLATES, ChatTemplate, template_from_meta

#: what a checkpoint is, in the one message of a path that is none (:func:`checkpoint_kind`)
CHECKPOINT_KINDS = "a decoderlab run or checkpoint directory, a Hugging Face directory or a .gguf file"

#: GGUF's control-token roles -> the names a Jinja template writes them by
_GGUF_TOKEN_NAMES = {"bos": "bos_token", "eos": "eos_token", "unk": "unk_token", "pad": "pad_token"}


class LoadedModel(NamedTuple):
    """What :func:`load_model` returns (unpacks as ``model, tokenizer, template, meta``).

    Attributes:
        model: the ``DecoderOnlyTransformer``, in eval mode.
        tokenizer: its tokenizer (with the template's special tokens, for a chat checkpoint).
        template: the chat template (:func:`checkpoint_template`: a fine-tuned chat checkpoint's, ``lesson`` for
            the lesson's pair model, a Hugging Face directory's own Jinja template); None for a base language
            model.
        meta: the checkpoint's ``meta.json`` ({} when there is none).
    """

    model: torch.nn.Module
    tokenizer: object
    template: ChatTemplate | JinjaChatTemplate | None
    meta: dict


def checkpoint_kind(path: str | os.PathLike) -> str:
    """What the front door (:func:`load_model`, ``decoderlab.load``, every ``--checkpoint``) reads ``path`` as:
    ``"gguf"`` (a ``.gguf`` file), ``"hf"`` (a directory whose ``config.json`` is Hugging Face's:
    :func:`decoderlab.hf.is_hf_directory`) or ``"decoderlab"`` (another directory with a ``config.json``: a
    checkpoint or training run directory). Looks at names and ``config.json`` only: the reader of the kind names
    what else is missing or wrong (a weights file, a bad header).

    Raises:
        FileNotFoundError: ``path`` is none of them -- it does not exist, is a file that is not a ``.gguf`` one,
            or a directory without ``config.json`` -- in one message for every command: ``checkpoint PATH
            <what it is>; a checkpoint is`` :data:`CHECKPOINT_KINDS`.
    """
    p = Path(path)
    if not p.exists():
        what = "does not exist"
    elif is_gguf_file(p):
        return "gguf"
    elif not p.is_dir():
        what = "is a file but not a GGUF file (.gguf)"
    elif not (p / CONFIG_FILE).is_file():
        what = f"is a directory without {CONFIG_FILE}"
    else:
        return "hf" if is_hf_directory(p) else "decoderlab"
    raise FileNotFoundError(f"checkpoint {path} {what}; a checkpoint is {CHECKPOINT_KINDS}")


def checkpoint_template(directory: str | os.PathLike, meta: dict | None = None
                        ) -> ChatTemplate | JinjaChatTemplate | None:
    """The chat template of a checkpoint directory: the one its ``meta.json`` stores
    (:func:`~decoderlab.chat.template_from_meta`), else a Hugging Face directory's own
    (:func:`~decoderlab.chat.read_chat_template`: ``chat_template.jinja`` or ``tokenizer_config.json``); a GGUF
    file's (:func:`gguf_template`, read from its header); None for a base language model. ``meta``: the
    directory's ``meta.json`` when already read.

    Raises:
        ValueError: a malformed stored template; a Hugging Face template that is not valid Jinja (named).
    """
    if is_gguf_file(directory):
        return gguf_template(read_info(directory))
    meta = read_meta(directory) if meta is None else meta
    return template_from_meta(meta) or read_chat_template(directory)


def gguf_template(info) -> ChatTemplate | JinjaChatTemplate | None:
    """The chat template of a GGUF file (``info``: its :class:`~decoderlab.gguf.GGUFInfo`): its
    ``tokenizer.chat_template`` as a :class:`JinjaChatTemplate` named ``gguf:<file name>`` with the file's bos /
    eos / unk / pad tokens -- or, when the text is one decoderlab wrote for a built-in template, that built-in
    template; None when the file has none.

    Raises:
        ValueError: a template that is not valid Jinja (naming the file).
    """
    source = info.chat_template
    if not source:
        return None
    for builtin in TEMPLATES.values():
        if source in (builtin_jinja(builtin), builtin_jinja(builtin, " ")):
            return builtin
    tokens = {_GGUF_TOKEN_NAMES[k]: t for k, t in info.special_tokens.items() if k in _GGUF_TOKEN_NAMES}
    try:
        return JinjaChatTemplate(source, name=f"gguf:{info.path.stem}", tokens=tokens)
    except ValueError as e:
        raise ValueError(f"{info.path}: tokenizer.chat_template: {e}") from None


def load_model(directory: str | os.PathLike, *, map_location: str | torch.device = "cpu",
               dtype=None, device: str | torch.device | None = None) -> LoadedModel:
    """The one loader: a decoderlab checkpoint directory (:func:`decoderlab.checkpoint.load_checkpoint`), a
    Hugging Face directory (:func:`decoderlab.hf.load_hf_directory`: GPT-2, Llama, Mistral, Qwen2,
    Qwen3, ...) or a GGUF file
    (:func:`decoderlab.gguf.load_gguf`: its template :func:`gguf_template`, its summary and what was
    dequantized under ``meta["gguf"]``), for inference (weights in
    ``dtype``, see :mod:`decoderlab.dtypes`; on ``device``: ``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``, see
    :func:`decoderlab.devices.resolve_device`) together with its chat template (:func:`checkpoint_template`: a
    checkpoint of the lesson's pair training written by an earlier version reads as the ``lesson`` template; a
    Hugging Face directory's own Jinja template) and its ``meta.json``.

    On the CPU the weights end in one mapping of transparent huge pages (:func:`decoderlab.kernels.huge_pages`:
    the decode step streams them 1.1-1.3x faster than from 4 KiB pages).

    A LoRA run's directory (:func:`decoderlab.checkpoint.is_adapter_checkpoint`) loads as its base -- read by this
    same loader, checked to be the one it was trained on -- with its adapter merged in (:func:`load_base`).

    Raises:
        FileNotFoundError: a path that is none of those (:func:`checkpoint_kind`'s one message); a required file
            of a checkpoint missing (named); a LoRA run's base that is gone.
        ValueError: a file that cannot be read (named, with the field for a bad ``config.json``); a tokenizer
            whose vocabulary size is not the model's; a malformed stored template; an unknown dtype; a LoRA run's
            base that changed since the run (named).
    """
    if checkpoint_kind(directory) == "gguf":  # one file: its template and what its load cost under meta["gguf"]
        model, tokenizer, info = load_gguf(directory, map_location=map_location, dtype=dtype, device=device)
        loaded = LoadedModel(model, tokenizer, gguf_template(info), {"gguf": info.to_meta()})
    elif is_adapter_checkpoint(directory):  # a LoRA run: its base (checked) with its adapter
        loaded = _load_adapted(directory, map_location=map_location, dtype=dtype, device=device)
    else:
        read = checkpoint_reader(directory)  # decoderlab's format or Hugging Face's
        model, tokenizer = read(directory, map_location=map_location, dtype=dtype, device=device)
        meta = read_meta(directory)  # ({} for a Hugging Face directory: it has no meta.json)
        loaded = LoadedModel(model, tokenizer, checkpoint_template(directory, meta), meta)
    # the weights into 2 MiB pages, in the order a step reads them (decoderlab.kernels.pages: 1.1-1.3x a CPU
    # decode); here, once the loaders' own references to the old copies are gone, so each is freed as it moves
    huge_pages(loaded.model)
    return loaded


def load_base(run_dir: str | os.PathLike, pointer: dict, *, map_location: str | torch.device = "cpu",
              device: str | torch.device | None = None, dtype: str = "float32") -> torch.nn.Module:
    """The base model a LoRA run ``run_dir`` adapts, as its adapter was put on it: the base ``pointer``
    names (its ``meta.json`` or ``run.json``; checked by :func:`decoderlab.checkpoint.check_base`) read by
    :func:`load_model` -- any kind it reads, another LoRA run too --, with the rows of the chat tokens the run added
    to its vocabulary (at the mean of the others, as :func:`~decoderlab.chat.add_chat_tokens` made them). In train
    mode. ``dtype``: ``"float32"`` (every weight float32, what an adapter is merged into) or ``"auto"`` (a GGUF
    file's blocks kept, the run trained over them: ``decoderlab.lora``'s QLoRA-style layers).

    Raises:
        FileNotFoundError, ValueError: as :func:`~decoderlab.checkpoint.check_base`; a base whose shape is not the
            run's ``config.json`` (named).
    """
    base = check_base(run_dir, pointer)
    if dtype not in ("float32", "auto"):
        raise ValueError(f"a LoRA run's base loads as float32 or auto (a GGUF file's blocks kept), got {dtype!r}")
    model = load_model(base, map_location=map_location, dtype=dtype, device=device).model
    config = read_config(run_dir)
    if model.config.num_tokens < config.num_tokens:
        model.resize_token_embeddings(config.num_tokens)
    if model.config != config:
        raise ValueError(f"the base {base} of the LoRA run {run_dir} is not the model its config.json describes")
    return model.train()


def _load_adapted(directory, *, map_location, dtype, device) -> LoadedModel:
    """A LoRA run's directory as an ordinary model: its base (:func:`load_base`) with the adapter merged in."""
    from ..dtypes import check_dtype, to_inference_dtype
    from ..lora import load_adapter, merge_lora
    from ..devices import resolve_device
    from ..tokenizers import Tokenizer

    check_dtype(dtype, torch.device(map_location) if device is None else resolve_device(device))
    meta = read_meta(directory)
    # (float32 even for a run trained over a GGUF file's blocks: merge_lora would dequantize them to the same sums)
    model = load_base(directory, meta, map_location=map_location, device=device)
    tokenizer = Tokenizer.load(os.path.join(directory, TOKENIZER_FILE))
    model = merge_lora(load_adapter(os.path.join(directory, ADAPTER_DIR), model)).eval()
    return LoadedModel(to_inference_dtype(model, dtype), tokenizer, checkpoint_template(directory, meta), meta)


def weights_dtype(path: str | os.PathLike) -> torch.dtype:
    """The dtype ``path`` stores its weights in -- the most common among the floating tensors of its (first)
    safetensors file or ``pytorch_model.bin`` --; a LoRA run's, its base's; float32 for a GGUF file (blocks and
    scales, dequantized on load) and for a directory without weights."""
    from pathlib import Path

    path = Path(path)
    if is_adapter_checkpoint(path):
        meta = read_meta(path)
        base = Path(meta["base"])
        return weights_dtype(base if base.is_absolute() else path / base)
    counts: dict = {}
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if files:
        from safetensors import safe_open

        with safe_open(str(files[0]), framework="pt") as f:
            for key in f.keys():
                dtype = f.get_slice(key).get_dtype()
                counts[dtype] = counts.get(dtype, 0) + 1
        names = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
        counts = {names[k]: v for k, v in counts.items() if k in names}
    elif path.is_dir() and (path / "pytorch_model.bin").is_file():
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", mmap=True, weights_only=True)
        for t in state.values():
            if t.is_floating_point():
                counts[t.dtype] = counts.get(t.dtype, 0) + 1
    return max(counts, key=counts.get) if counts else torch.float32
