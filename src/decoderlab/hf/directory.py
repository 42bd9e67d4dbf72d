"""Hugging Face directories in and out: the one loader and the one writer every family goes through.

In: ``config.json`` names the class (``architectures``); its family (:data:`FAMILIES`) maps the config to a
``ModelConfig`` (refusing, in one message naming the file and the field, what the class computes and decoderlab
does not), the tokenizer is read (:mod:`.tokenizer`), the model is built on the meta device and every tensor
is read from the memory-mapped files once, into its final dtype and device (:mod:`.weights`, :mod:`.convert`).

Out: :func:`export_family` picks the class whose forward equals the model's (GPT-2, Qwen2 / Qwen3 where their
biases or QK-norm are used, Llama, Apertus / Arcee for the recipes' plain MLP), or refuses naming the fields and
the nearest class; :func:`save_hf_directory` writes config.json, generation_config.json, model.safetensors and
the tokenizer's files into a directory assembled beside its destination and swapped in (nothing is written
when anything is refused). No transformers needed either way.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

from ..checkpoint import CONFIG_FILE, check_output_dir, unwrap_model
from ..config.model import ModelConfig
from ..devices import resolve_device
from ..dtypes import check_dtype, to_inference_dtype
from ..files import replace_directory, temporary_directory, usual_mode
from ..model import DecoderOnlyTransformer
from . import gemma, gpt2, llama, qwen, recipe
from .convert import ConfigError, read_state, stored_names, table, write_state
from .generation_config import GENERATION_CONFIG, eos_token_id_of, read_eos_ids, with_eos_ids
from .tokenizer import TOKENIZER_FILES, read_tokenizer, special_ids_of, write_tokenizer
from .weights import INDEX_FILE, PICKLE_FILE, SINGLE_FILE, WeightFiles, write_safetensors

#: the families, in the order an export tries them (Qwen before Llama: a model with q/k/v biases or a QK-norm
#: goes to the class that has them)
FAMILIES = (gpt2, qwen, llama, recipe, gemma)
#: the classes decoderlab reads and writes
ARCHITECTURES = tuple(a for f in FAMILIES for a in f.ARCHITECTURES)
#: the files a Hugging Face directory written here holds (a directory holding only these may be replaced)
HF_FILES = {CONFIG_FILE, GENERATION_CONFIG, SINGLE_FILE, INDEX_FILE, PICKLE_FILE, *TOKENIZER_FILES}


class ExportError(ValueError):
    """A model no Hugging Face class carries; ``field`` names the first ModelConfig field in the way."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def is_hf_directory(directory: str | os.PathLike) -> bool:
    """True when ``directory`` holds a Hugging Face ``config.json`` (``architectures``, ``model_type`` or GPT-2's
    ``n_embd``) rather than a decoderlab one (``d_model``)."""
    config_file = Path(directory) / CONFIG_FILE
    if not config_file.is_file():
        return False
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return False
    return isinstance(config, dict) and "d_model" not in config and any(
        k in config for k in ("architectures", "model_type", "n_embd"))


def family_of(hf: dict, where: str):
    """``(family module, class name)`` of a config.json's ``architectures`` (or its ``model_type``).

    Raises:
        ConfigError: a class decoderlab does not read, naming it and those it reads.
    """
    names = hf.get("architectures")
    if isinstance(names, list) and names:
        name = names[0]
    else:
        types = {t: a for f in FAMILIES for t, a in (*f.MODEL_TYPES.items(), *getattr(f, "REFUSED_TYPES", {}).items())}
        legacy = "GPT2LMHeadModel" if "n_embd" in hf and "model_type" not in hf else None  # an old GPT-2 config
        name = types.get(hf.get("model_type"), legacy)
        names = hf.get("model_type")
    for family in FAMILIES:
        if name in family.ARCHITECTURES:
            return family, name
        refused = getattr(family, "refusal", lambda *a: None)(name, hf, where)
        if refused is not None:  # a class of a family read, adding what decoderlab does not compute: named
            raise refused
    field = "architectures" if hf.get("architectures") else "model_type"
    raise ConfigError(f"{where}: {field} {names!r} is not a class decoderlab reads; allowed: "
                      f"{', '.join(ARCHITECTURES)}", field)


def read_hf_config(directory: str | os.PathLike) -> tuple[dict, object, str, ModelConfig]:
    """``(config.json's dict, family, class name, our ModelConfig)`` of a Hugging Face directory.

    Raises:
        FileNotFoundError: no directory or no config.json.  ValueError (:class:`ConfigError`): a class or field
        decoderlab cannot honour, named with the file and what is allowed.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"Hugging Face directory {directory} does not exist")
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"Hugging Face directory {directory} has no config.json")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(hf).__name__}")
    family, name = family_of(hf, str(path))
    try:
        cfg = family.to_ours(hf, name, str(path))
    except ConfigError:
        raise
    except ValueError as e:  # ModelConfig's own check of the sizes (n_head that does not divide, ...)
        raise ValueError(f"{path}: {e}") from None
    return hf, family, name, cfg


_INIT = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "zeros_", "ones_",
         "constant_")
_INIT_LOCK = threading.Lock()


@contextmanager
def without_init():
    """``torch.nn.init``'s functions as no-ops while a model is built to be loaded (transformers'
    ``no_init_weights``): every tensor is then allocated but not written -- its pages untouched until the file's
    values are copied in, so a load holds one copy of the weights -- and no time goes to random numbers that are
    overwritten. (Not the meta device: an operation on a meta tensor goes through torch's Python references,
    whose first call imports ``torch._dynamo``, seconds of a load that takes one. A model another thread
    initialises in that moment would start from empty values; loading is not that moment.)"""
    with _INIT_LOCK:
        saved = {name: getattr(torch.nn.init, name) for name in _INIT}
        for name in _INIT:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(torch.nn.init, name, fn)


def build_model(files: WeightFiles, family, hf: dict, cfg: ModelConfig, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", config_file: str = CONFIG_FILE) -> DecoderOnlyTransformer:
    """The model of ``cfg`` with the weights of ``files`` (named as ``family`` names them in config ``hf``): built
    on ``device`` in ``dtype`` without an initialisation (its tensors allocated, not yet written), then each
    filled once from the files. In eval mode.

    Raises:
        ValueError: a missing, mis-shaped or unexpected tensor, named with its file and the shape config.json
            gives; an LM head that differs from the embedding of a tied config.
    """
    device = torch.device(device)
    with torch.device(device), without_init():  # not the meta device: see without_init
        model = DecoderOnlyTransformer(cfg)
    if dtype != torch.float32:  # (the float32 tensors were never written: no pages of theirs were touched)
        model.to(dtype)
    own = model.state_dict()
    entries = list(table(cfg, own, family.names(cfg, hf)))
    lookup, _ = stored_names(files, family.PREFIX, family.IGNORED)
    with torch.no_grad():
        state = read_state(files, entries, own, cfg, lookup, config_file=config_file)
    used = {name for e in entries if not hasattr(e, "value") for name, _, _ in e.parts}
    head = lookup.get("lm_head.weight")
    if cfg.tie_weights and head is not None:  # stored beside a tied embedding (older GPT-2 files): the same?
        used.add("lm_head.weight")
        same = files.shape(head) == tuple(state["we.weight"].shape) and torch.equal(
            files.view(head).to(device=device, dtype=dtype), state["we.weight"])
        files.release(head)
        if not same:
            raise ValueError(f"{files.where(head)}: lm_head.weight differs from the embedding, but {config_file} ties "
                             "them (tie_word_embeddings true); allowed: the same tensor, or tie_word_embeddings false")
    unexpected = sorted(stored for name, stored in lookup.items() if name not in used)
    if unexpected:
        raise ValueError(f"{files.where(unexpected[0])}: unexpected tensor(s) {unexpected[:5]} for the "
                         f"{cfg.n_layer}-layer model {config_file} describes")
    return model.eval()


def load_hf_directory(directory: str | os.PathLike, map_location: str | torch.device = "cpu", dtype=None, *,
                      device: str | torch.device | None = None):
    """``(model, tokenizer)`` of a Hugging Face directory (``config.json`` of a class in :data:`ARCHITECTURES`,
    ``model.safetensors`` or a sharded ``model.safetensors.index.json`` -- float32, bfloat16 or float16 on disk
    -- or ``pytorch_model.bin``, and its tokenizer: :func:`.tokenizer.read_tokenizer`, ending texts also at
    every id of ``eos_token_id``: :func:`.generation_config.read_eos_ids`), as
    :func:`decoderlab.checkpoint.load_checkpoint` reads decoderlab's. The weights are memory-mapped and copied
    once, into ``dtype`` for inference (None: float32; see :mod:`decoderlab.dtypes`), on ``device`` (``auto``,
    ``cpu``, ``cuda``, ``cuda:N``, ``mps``; None: ``map_location``). The model is in eval mode.

    Raises:
        FileNotFoundError: the directory, its config, weights, a shard or its tokenizer files are missing
            (named).
        ValueError: a class or config field decoderlab cannot honour; a missing, mis-shaped or unexpected
            tensor; inconsistent shards; a tokenizer larger than the embedding; an ``eos_token_id`` outside
            the vocabulary (each naming the file, the field and what is allowed); an unknown dtype or a device this machine lacks (before any file is
            read).
    """
    target = torch.device(map_location) if device is None else resolve_device(device)
    name = check_dtype(dtype, target)  # an unknown dtype, or one the device cannot run, fails before any file is read
    hf, family, _, cfg = read_hf_config(directory)
    tokenizer = read_tokenizer(directory, cfg.num_tokens)  # before the weights: a missing tokenizer is found at once
    tokenizer = with_eos_ids(tokenizer, read_eos_ids(directory, hf, cfg.num_tokens))  # where generate stops
    files = WeightFiles(directory)
    load_dtype = getattr(torch, name) if name in ("bfloat16", "float16") else torch.float32
    model = build_model(files, family, hf, cfg, dtype=load_dtype, device=target,
                        config_file=str(Path(directory) / CONFIG_FILE))
    return to_inference_dtype(model, dtype), tokenizer


# ----------------------------------------------------------------------------------------------------------
# Out
# ----------------------------------------------------------------------------------------------------------


def export_family(cfg: ModelConfig, tokenizer=None):
    """``(family module, class name)`` of the Hugging Face class whose forward equals the model of ``cfg`` (and
    that gives ``tokenizer`` back through ``AutoTokenizer``, when given: a family may say it cannot,
    ``carries_tokenizer``, and the next class that computes the model is taken).

    Raises:
        ExportError: no class computes it: the message names each field in the way (value, why) and the nearest
            class with what it needs.
    """
    tried = []
    for family in FAMILIES:
        bad = family.mismatches(cfg)
        if not bad and getattr(family, "carries_tokenizer", lambda c, t: True)(cfg, tokenizer):
            return family, family.architecture(cfg)
        tried.append((len(bad), family, bad))
    _, family, bad = min(tried, key=lambda t: t[0])
    fields = "; ".join(f"{f}={v!r} ({why})" for f, v, _, why in bad)
    needs = ", ".join(f"{f}={w[0] if isinstance(w, tuple) else w!r}" for f, _, w, _ in bad)
    raise ExportError(f"no Hugging Face class computes this model: {fields}; the nearest is "
                      f"{family.architecture(cfg)}, which needs {needs}", bad[0][0])


def plain_model(model) -> DecoderOnlyTransformer:
    """The bare ``DecoderOnlyTransformer`` of ``model`` (compiled or wrapped), its LoRA adapters (if any) merged
    into its weights (:func:`decoderlab.lora.merge_lora`).

    Raises:
        TypeError: not a ``DecoderOnlyTransformer``.
    """
    from ..lora import has_lora, merge_lora

    model = unwrap_model(model)
    if not isinstance(model, DecoderOnlyTransformer):
        raise TypeError(f"a Hugging Face export takes a DecoderOnlyTransformer, got {type(model).__name__}")
    return merge_lora(model) if has_lora(model) else model


def hf_state(model: DecoderOnlyTransformer, tokenizer=None) -> tuple[object, str, ModelConfig, dict[str, torch.Tensor]]:
    """``(family, class name, the config it is written with, the Hugging Face tensors)`` of ``model`` written
    with ``tokenizer`` (:func:`export_family`; a LayerNorm model for an RMSNorm class comes out centred and
    untied: :func:`.convert.center_writes`)."""
    family, name = export_family(model.config, tokenizer)
    cfg, state = family.prepare(model.config, model.state_dict())
    names = family.names(cfg, family.to_theirs(cfg))
    return family, name, cfg, write_state(state, list(table(cfg, state, names)), cfg)


def hf_config(family, cfg: ModelConfig, tokenizer, dtype: torch.dtype) -> dict:
    """config.json of the written model: the family's fields, the tokenizer's special ids (``eos_token_id`` a list
    with its :attr:`~decoderlab.tokenizers.Tokenizer.eos_ids`: :func:`.generation_config.eos_token_id_of`), the
    dtype."""
    ids = special_ids_of(tokenizer)
    if tokenizer is not None:
        ids["eos_token_id"] = eos_token_id_of(ids["eos_token_id"], tokenizer.eos_ids)
    return {**family.to_theirs(cfg), **ids, "torch_dtype": str(dtype).removeprefix("torch.")}


def save_hf_directory(model: DecoderOnlyTransformer, tokenizer, directory: str | os.PathLike, *,
                      chat_template: str | None = None) -> dict:
    """Write ``model`` with ``tokenizer`` as a Hugging Face directory that ``AutoModelForCausalLM`` and
    ``AutoTokenizer`` load with the same logits and ids: config.json, generation_config.json (the end token
    ``generate`` stops at), model.safetensors, the tokenizer's files with the Jinja ``chat_template`` when given.
    The directory is assembled beside ``directory`` and swapped in (an existing one of such files is replaced).
    LoRA adapters are merged first. Returns ``{"architecture", "bytes", "tensors", "chat_template"}`` (the
    class, the bytes written, the tensors, whether a chat template was written).

    Raises:
        ExportError: no Hugging Face class computes the model (:func:`export_family`), before anything is
            written.  ValueError: a tokenizer whose size is not the model's.  FileExistsError: ``directory``
            holds other files (nothing is deleted).
    """
    model = plain_model(model)
    family, name = export_family(model.config, tokenizer)  # refused before anything is read or written
    if tokenizer is not None and tokenizer.vocab_size != model.config.num_tokens:
        raise ValueError(f"tokenizer vocabulary size {tokenizer.vocab_size} does not match the model's num_tokens "
                         f"{model.config.num_tokens}")
    directory = Path(directory)
    check_output_dir(directory, allowed=HF_FILES, what="a Hugging Face model directory")
    _, _, cfg, tensors = hf_state(model, tokenizer)
    dtype = model.we.weight.dtype
    config = hf_config(family, cfg, tokenizer, dtype)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None}
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_directory(directory)  # an error names directory, not the temporary name
    try:
        write_safetensors(tmp / SINGLE_FILE, tensors)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (tmp / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
        if tokenizer is not None:
            write_tokenizer(tmp, tokenizer, model.config.max_len, chat_template)
        for f in tmp.iterdir():  # safetensors creates its file 0600: every file gets the usual mode
            usual_mode(f)
        replace_directory(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"architecture": name, "bytes": sum(f.stat().st_size for f in directory.iterdir()),
            "tensors": len(tensors), "chat_template": chat_template is not None}
