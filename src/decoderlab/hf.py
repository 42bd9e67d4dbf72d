"""GPT-2 weights in and out: convert between Hugging Face ``GPT2LMHeadModel`` and ``DecoderOnlyTransformer``.

``from_gpt2`` reads a ``GPT2LMHeadModel`` (or ``GPT2Model``), its state dict, or a local directory in Hugging
Face format (``config.json`` + ``model.safetensors``, a sharded ``model.safetensors.index.json``, or
``pytorch_model.bin``); ``to_gpt2`` builds a ``GPT2LMHeadModel`` from one of ours and can write that directory
format back. Nothing is downloaded: configs and models are built locally.

``transformers`` is an optional dependency (``pip install 'decoderlab[hf]'``): it is needed to accept or return
a ``GPT2LMHeadModel`` (and so by ``to_gpt2``); reading a state dict or a directory needs only torch and
safetensors.

Tensor mapping (GPT-2 stores its ``Conv1D`` weights as (in, out), so they are transposed into our
``nn.Linear`` weights, (out, in))::

    wte.weight                 (num_tokens, d_model)   -> we.weight
    wpe.weight                 (max_len, d_model)      -> pe.weight
    h.{i}.ln_1.weight/bias     (d_model,)              -> blocks.{i}.norm_1.weight/bias
    h.{i}.attn.c_attn.weight   (d_model, 3 d_model)    -> blocks.{i}.attention.qkv.weight   (transposed)
    h.{i}.attn.c_attn.bias     (3 d_model,)            -> blocks.{i}.attention.qkv.bias
    h.{i}.attn.c_proj.weight   (d_model, d_model)      -> blocks.{i}.attention.proj.weight  (transposed)
    h.{i}.ln_2.weight/bias     (d_model,)              -> blocks.{i}.norm_2.weight/bias
    h.{i}.mlp.c_fc.weight      (d_model, d_ff)         -> blocks.{i}.mlp.fc.weight          (transposed)
    h.{i}.mlp.c_proj.weight    (d_ff, d_model)         -> blocks.{i}.mlp.proj.weight        (transposed)
    ln_f.weight/bias           (d_model,)              -> norm_f.weight/bias
    lm_head.weight             (num_tokens, d_model)   -> fc_layer.weight (tied to we.weight unless untied)

Both use the same query/key/value order in the fused projection and the same head split (consecutive
d_head-sized slices), and GPT-2's "gelu_new" is GELU with the tanh approximation, as our MLP. Keys may carry
the ``transformer.`` prefix (``GPT2LMHeadModel``) or not (``GPT2Model``); the non-parameter buffers
``attn.bias`` / ``attn.masked_bias`` of older ``transformers`` versions are ignored.

Source: Radford et al. 2019 (GPT-2); the tensor names are those of Hugging Face's GPT-2 implementation.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch

from .checkpoint import CONFIG_FILE, check_output_dir, load_checkpoint, unwrap_model
from .config.names import GPT2_SHAPE
from .devices import resolve_device
from .dtypes import check_dtype, to_inference_dtype
from .files import replace_directory, temporary_directory, usual_mode
from .model import DecoderOnlyTransformer, ModelConfig, preset
from .tokenizers import BPETokenizer, Tokenizer

__all__ = ["from_gpt2", "to_gpt2", "gpt2_config_to_model_config", "model_config_to_gpt2_config",
           "load_gpt2_directory", "checkpoint_reader", "load_any_checkpoint", "is_gpt2_directory", "gpt2_tokenizer"]

_INSTALL_HINT = "pip install 'decoderlab[hf]'"
_IGNORED_BLOCK_KEYS = ("attn.bias", "attn.masked_bias")  # causal-mask buffers of older transformers versions
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
_BLOCK_RE = re.compile(r"^h\.(\d+)\.(.+)$")


def _require_transformers():
    try:
        import transformers  # noqa: F401
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"decoderlab.hf needs Hugging Face transformers for GPT2LMHeadModel; install it with: {_INSTALL_HINT}"
        ) from e
    return GPT2Config, GPT2LMHeadModel


# ----------------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------------


def gpt2_config_to_model_config(gpt2_config: Any, attention: str = "sdpa") -> ModelConfig:
    """Our ``ModelConfig`` for a GPT-2 config (a ``transformers.GPT2Config`` or the dict of its config.json).

    Fields: num_tokens = vocab_size, d_model = n_embd, n_layer, n_head, max_len = n_positions,
    d_ff = n_inner or 4 n_embd, norm_eps = layer_norm_epsilon, dropout = resid_pdrop, tie_weights =
    tie_word_embeddings; the rest as the ``gpt2`` preset (learned positions, pre-LayerNorm, GELU MLP, biases,
    output projection, no bias in the LM head).

    Raises:
        ValueError: a GPT-2 option that our model does not implement (another activation function,
            unscaled attention, scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn, a model_type other
            than gpt2), naming the option and its value; a missing size.
    """
    d = gpt2_config.to_dict() if hasattr(gpt2_config, "to_dict") else dict(gpt2_config)
    model_type = d.get("model_type", "gpt2")
    if model_type != "gpt2":
        raise ValueError(f"model_type {model_type!r} is not supported; allowed: 'gpt2'")
    act = d.get("activation_function", "gelu_new")
    if act not in _TANH_GELUS:
        raise ValueError(
            f"activation_function {act!r} is not supported; allowed: {', '.join(map(repr, _TANH_GELUS))} "
            "(GELU with the tanh approximation)"
        )
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("reorder_and_upcast_attn", False)):
        if key in d and bool(d[key]) != ok:
            raise ValueError(f"GPT-2 option {key}={d[key]!r} is not supported; allowed: {key}={ok}")
    sizes = {}
    for ours, theirs in (("num_tokens", "vocab_size"), ("d_model", "n_embd"), ("n_layer", "n_layer"),
                         ("n_head", "n_head"), ("max_len", "n_positions")):
        if d.get(theirs) is None:
            raise ValueError(f"GPT-2 config has no {theirs!r} (needed for {ours})")
        sizes[ours] = d[theirs]
    n_inner = d.get("n_inner")
    return preset(
        "gpt2",
        **sizes,
        d_ff=int(n_inner) if n_inner else 0,
        norm_eps=float(d.get("layer_norm_epsilon", 1e-5)),
        dropout=float(d.get("resid_pdrop", 0.0) or 0.0),
        tie_weights=bool(d.get("tie_word_embeddings", True)),
        attention=attention,
    )


def _check_expressible(cfg: ModelConfig) -> None:
    """Raise ``ValueError`` naming the first ModelConfig field that GPT-2 cannot express (``GPT2_SHAPE``)."""
    for name, allowed, _, why in GPT2_SHAPE:
        value = getattr(cfg, name)
        if value != allowed:
            raise ValueError(f"GPT-2 cannot express {name}={value!r}; allowed: {name}={allowed!r} ({why})")


def model_config_to_gpt2_config(cfg: ModelConfig, **gpt2_kwargs):
    """A ``transformers.GPT2Config`` for our config (built locally; nothing is downloaded).

    ``n_ctx`` repeats ``n_positions`` (llama.cpp's GGUF converter reads it; transformers writes only
    ``n_positions``). ``bias=False`` is expressed with zero biases (GPT-2 always has them); dropout goes to resid_pdrop,
    embd_pdrop and attn_pdrop. Extra keyword arguments go to ``GPT2Config`` (e.g. ``attn_implementation``).

    Raises:
        ValueError: a field GPT-2 cannot express (rope/sinusoidal/no positions, rmsnorm/no norm, no MLP, no
            output projection, a bias in the LM head), naming the field and its value.
        ImportError: transformers is not installed.
    """
    _check_expressible(cfg)
    GPT2Config, _ = _require_transformers()
    special = {} if cfg.num_tokens > 50256 else dict(bos_token_id=None, eos_token_id=None)
    kwargs = dict(
        vocab_size=cfg.num_tokens, n_positions=cfg.max_len, n_ctx=cfg.max_len, n_embd=cfg.d_model, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_inner=None if cfg.ff_size == 4 * cfg.d_model else cfg.ff_size,
        activation_function="gelu_new", resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
        layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=cfg.tie_weights, scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False, **special,
    )
    kwargs.update(gpt2_kwargs)
    return GPT2Config(**kwargs)


# ----------------------------------------------------------------------------------------------------------
# State dicts
# ----------------------------------------------------------------------------------------------------------

# (GPT-2 name inside a block, our name inside a block, transposed)
_BLOCK_MAP = (
    ("ln_1.weight", "norm_1.weight", False),
    ("ln_1.bias", "norm_1.bias", False),
    ("attn.c_attn.weight", "attention.qkv.weight", True),
    ("attn.c_attn.bias", "attention.qkv.bias", False),
    ("attn.c_proj.weight", "attention.proj.weight", True),
    ("attn.c_proj.bias", "attention.proj.bias", False),
    ("ln_2.weight", "norm_2.weight", False),
    ("ln_2.bias", "norm_2.bias", False),
    ("mlp.c_fc.weight", "mlp.fc.weight", True),
    ("mlp.c_fc.bias", "mlp.fc.bias", False),
    ("mlp.c_proj.weight", "mlp.proj.weight", True),
    ("mlp.c_proj.bias", "mlp.proj.bias", False),
)
_TOP_MAP = (
    ("wte.weight", "we.weight"),
    ("wpe.weight", "pe.weight"),
    ("ln_f.weight", "norm_f.weight"),
    ("ln_f.bias", "norm_f.bias"),
)


def _strip_prefixes(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys without "transformer." (and wrapper prefixes); drop the causal-mask buffers."""
    out = {}
    for key, value in state.items():
        k = key
        for prefix in ("module.", "_orig_mod.", "transformer."):
            if k.startswith(prefix):
                k = k[len(prefix):]
        m = _BLOCK_RE.match(k)
        if m and m.group(2) in _IGNORED_BLOCK_KEYS:
            continue
        if k in out:
            raise ValueError(f"GPT-2 state dict has tensor {k!r} twice (as {key!r} and another key)")
        out[k] = value
    return out


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, f, v = cfg.d_model, cfg.ff_size, cfg.num_tokens
    shapes = {"wte.weight": (v, d), "wpe.weight": (cfg.max_len, d), "ln_f.weight": (d,), "ln_f.bias": (d,)}
    block = {
        "ln_1.weight": (d,), "ln_1.bias": (d,), "attn.c_attn.weight": (d, 3 * d), "attn.c_attn.bias": (3 * d,),
        "attn.c_proj.weight": (d, d), "attn.c_proj.bias": (d,), "ln_2.weight": (d,), "ln_2.bias": (d,),
        "mlp.c_fc.weight": (d, f), "mlp.c_fc.bias": (f,), "mlp.c_proj.weight": (f, d), "mlp.c_proj.bias": (d,),
    }
    for i in range(cfg.n_layer):
        shapes.update({f"h.{i}.{k}": s for k, s in block.items()})
    if not cfg.tie_weights:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def _infer_config(state: dict[str, torch.Tensor], n_head: int | None, attention: str) -> ModelConfig:
    """A ModelConfig from tensor shapes; n_head must be given (shapes do not determine it)."""
    if n_head is None:
        raise ValueError(
            "n_head cannot be inferred from a GPT-2 state dict's tensor shapes; pass it as "
            "from_gpt2(state_dict, n_head=...) or give config= (a GPT2Config, its dict, or a ModelConfig)"
        )
    for key in ("wte.weight", "wpe.weight", "h.0.mlp.c_fc.weight"):
        if key not in state:
            raise ValueError(f"GPT-2 state dict is missing tensor {key!r}; cannot infer the model's sizes")
        if state[key].dim() != 2:
            raise ValueError(f"GPT-2 tensor {key!r} must be 2-D, got shape {tuple(state[key].shape)}")
    v, d = state["wte.weight"].shape
    n_layer = 1 + max(int(m.group(1)) for k in state if (m := _BLOCK_RE.match(k)))
    tied = "lm_head.weight" not in state or _same_tensor(state["lm_head.weight"], state["wte.weight"])
    return gpt2_config_to_model_config(
        dict(vocab_size=v, n_embd=d, n_layer=n_layer, n_head=n_head, n_positions=state["wpe.weight"].shape[0],
             n_inner=state["h.0.mlp.c_fc.weight"].shape[1], tie_word_embeddings=tied),
        attention=attention,
    )


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if a.data_ptr() == b.data_ptr() and a.device == b.device:
        return True
    return bool(torch.equal(a, b.to(a.dtype)))


def _check_state(state: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> None:
    expected = _expected_shapes(cfg)
    for key, shape in expected.items():
        if key not in state:
            raise ValueError(f"{source}: missing tensor {key!r} (expected shape {shape})")
        if tuple(state[key].shape) != shape:
            raise ValueError(
                f"{source}: tensor {key!r} has shape {tuple(state[key].shape)}, expected {shape}"
            )
    allowed_extra = {"lm_head.weight"} if cfg.tie_weights else set()
    unexpected = sorted(k for k in state if k not in expected and k not in allowed_extra)
    if unexpected:
        raise ValueError(f"{source}: unexpected tensor(s) {unexpected[:5]} for a {cfg.n_layer}-layer GPT-2")
    if cfg.tie_weights and "lm_head.weight" in state and not _same_tensor(state["lm_head.weight"],
                                                                          state["wte.weight"]):
        raise ValueError(f"{source}: lm_head.weight differs from wte.weight, but the config ties them "
                         "(tie_word_embeddings=True)")


def gpt2_state_to_ours(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename/transpose a checked GPT-2 state dict (without prefixes) into our state dict's keys."""
    out = {ours: state[theirs] for theirs, ours in _TOP_MAP}
    for i in range(cfg.n_layer):
        for theirs, ours, transpose in _BLOCK_MAP:
            t = state[f"h.{i}.{theirs}"]
            out[f"blocks.{i}.{ours}"] = t.t() if transpose else t
    out["fc_layer.weight"] = out["we.weight"] if cfg.tie_weights else state["lm_head.weight"]
    return out


def ours_to_gpt2_state(model: DecoderOnlyTransformer) -> dict[str, torch.Tensor]:
    """Our model's weights under GPT-2 names (with "transformer." prefix); zero biases when bias=False."""
    cfg = model.config
    sd = model.state_dict()
    out = {f"transformer.{theirs}": sd[ours] for theirs, ours in _TOP_MAP if ours in sd}
    for i in range(cfg.n_layer):
        for theirs, ours, transpose in _BLOCK_MAP:
            key = f"blocks.{i}.{ours}"
            if key in sd:
                t = sd[key]
                out[f"transformer.h.{i}.{theirs}"] = t.t().contiguous() if transpose else t
    if not cfg.bias:  # GPT-2 always has biases: zeros compute the same function
        for key, shape in _expected_shapes(cfg).items():
            if key.endswith(".bias") and f"transformer.{key}" not in out:
                out[f"transformer.{key}"] = torch.zeros(shape, dtype=model.we.weight.dtype)
    out["lm_head.weight"] = sd["fc_layer.weight"]
    return out


# ----------------------------------------------------------------------------------------------------------
# Directories
# ----------------------------------------------------------------------------------------------------------


def _read_directory(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    if not directory.is_dir():
        raise FileNotFoundError(f"GPT-2 directory {directory} does not exist")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"GPT-2 directory {directory} has no config.json")
    config = json.loads(config_file.read_text(encoding="utf-8"))
    single, index, pt = (directory / "model.safetensors", directory / "model.safetensors.index.json",
                         directory / "pytorch_model.bin")
    if single.is_file():
        from safetensors.torch import load_file

        return config, load_file(str(single))
    if index.is_file():
        from safetensors.torch import load_file

        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            if not (directory / shard).is_file():
                raise FileNotFoundError(f"GPT-2 directory {directory}: shard {shard} listed in {index.name} "
                                        "is missing")
            state.update(load_file(str(directory / shard)))
        return config, state
    if pt.is_file():
        return config, torch.load(pt, map_location="cpu", weights_only=True)
    raise FileNotFoundError(
        f"GPT-2 directory {directory} has no weights file; expected model.safetensors, "
        "model.safetensors.index.json (with its shards) or pytorch_model.bin"
    )


# ----------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------


def from_gpt2(source: Any, config: Any = None, attention: str = "sdpa", *,
              n_head: int | None = None) -> DecoderOnlyTransformer:
    """Build a ``DecoderOnlyTransformer`` with GPT-2 weights; it computes the same logits (float32, eval mode).

    Args:
        source: a ``transformers.GPT2LMHeadModel`` or ``GPT2Model``; a GPT-2 state dict (keys with or without
            the ``transformer.`` prefix); or a local directory in Hugging Face format (``config.json`` and
            ``model.safetensors``, ``model.safetensors.index.json`` + shards, or ``pytorch_model.bin``).
        config: optional; a ``GPT2Config``, the dict of a GPT-2 config.json, or our ``ModelConfig``. For a
            state dict without it, the sizes are read from the tensor shapes and ``n_head`` must be given.
        attention: our attention kernel, "sdpa" | "explicit".
        n_head: number of heads, for a state dict given without ``config``.

    Returns the model in eval mode, float32 weights, ``tie_weights`` as in the source.

    Raises:
        ValueError: a missing, unexpected or mis-shaped tensor (named, with expected and actual shapes); no
            n_head for a bare state dict; a GPT-2 option or ModelConfig field we cannot map (named).
        FileNotFoundError: a directory that does not exist, or has no config.json or no weights file (named).
        TypeError: a source of another kind.
    """
    source_name = "GPT-2 state dict"
    if isinstance(source, (str, os.PathLike)):
        directory = Path(source)
        dir_config, state = _read_directory(directory)
        config = dir_config if config is None else config
        source_name = f"GPT-2 directory {directory}"
    elif isinstance(source, Mapping):
        state = dict(source)
    elif isinstance(source, torch.nn.Module) and hasattr(source, "config") and hasattr(source.config, "to_dict"):
        state = source.state_dict()
        config = source.config if config is None else config
        source_name = f"{type(source).__name__}"
    else:
        raise TypeError(
            "from_gpt2 takes a GPT2LMHeadModel/GPT2Model, a GPT-2 state dict or a directory path; "
            f"got {type(source).__name__}"
        )
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"{source_name}: value of {bad[0]!r} is a {type(state[bad[0]]).__name__}, not a tensor")
    state = _strip_prefixes(state)

    if config is None:
        cfg = _infer_config(state, n_head, attention)
    elif isinstance(config, ModelConfig):
        _check_expressible(config)
        if not config.bias:
            raise ValueError("config.bias=False: a GPT-2 state dict has biases; use bias=True")
        cfg = config.replace(attention=attention)
    else:
        cfg = gpt2_config_to_model_config(config, attention=attention)
        if n_head is not None and n_head != cfg.n_head:
            raise ValueError(f"n_head={n_head} contradicts the config's n_head={cfg.n_head}")
    _check_state(state, cfg, source_name)

    ours = gpt2_state_to_ours(state, cfg)
    model = DecoderOnlyTransformer(cfg)
    with torch.no_grad():
        model.load_state_dict(ours, strict=True)
    model.eval()
    return model


#: GPT-2's tokenizer files: Hugging Face's ``tokenizer.json``, or ``vocab.json`` + ``merges.txt``
GPT2_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt")
#: the files ``save_pretrained`` (and a tokenizer's) write; ``to_gpt2`` replaces a directory holding only these
HF_FILES = {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
            "pytorch_model.bin", *GPT2_TOKENIZER_FILES, "tokenizer_config.json", "special_tokens_map.json"}


def _special_tokens(tokenizer: BPETokenizer) -> dict[str, str]:
    """Hugging Face's names for the tokenizer's control tokens: its end of text is also the start token."""
    out = {}
    if tokenizer.eos_id is not None:
        eos = tokenizer.id_to_token[tokenizer.eos_id]
        out.update(bos_token=eos, eos_token=eos)
    if tokenizer.pad_id is not None:
        out["pad_token"] = tokenizer.id_to_token[tokenizer.pad_id]
    return out


def _special_ids(tokenizer: BPETokenizer | None) -> dict[str, int]:
    """The GPT-2 config's bos/eos/pad ids of ``tokenizer`` (so ``generate`` stops at the end token)."""
    if tokenizer is None:
        return {}
    out = {} if tokenizer.eos_id is None else dict(bos_token_id=tokenizer.eos_id, eos_token_id=tokenizer.eos_id)
    return out if tokenizer.pad_id is None else {**out, "pad_token_id": tokenizer.pad_id}


def write_tokenizer_files(directory: Path, tokenizer: BPETokenizer, max_len: int) -> None:
    """GPT-2's tokenizer files in ``directory``: ``tokenizer.json``, ``vocab.json``, ``merges.txt``, and the
    ``tokenizer_config.json`` and ``special_tokens_map.json`` that tell ``AutoTokenizer`` which tokenizer this
    is and which tokens end a text or pad -- without them it falls back to GPT-2's defaults and adds an
    ``<|endoftext|>`` past the vocabulary. A special token typed in a text stays text (``split_special_tokens``),
    as in ``BPETokenizer.encode``, so the same text gives the same ids."""
    tokenizer.save(directory / "tokenizer.json")
    tokenizer.save_gpt2_files(directory)
    special = _special_tokens(tokenizer)
    config = dict(tokenizer_class="PreTrainedTokenizerFast", model_max_length=max_len, split_special_tokens=True,
                  clean_up_tokenization_spaces=False, **special)
    for name, data in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        (directory / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def to_gpt2(model: DecoderOnlyTransformer, path: str | os.PathLike | None = None, *, tokenizer=None,
            **gpt2_kwargs):
    """A Hugging Face ``GPT2LMHeadModel`` with our model's weights; written to ``path`` if given.

    The directory gets ``config.json`` and ``model.safetensors`` (via ``save_pretrained``), and with a
    byte-level BPE ``tokenizer`` (``BPETokenizer``) GPT-2's tokenizer files too (``tokenizer.json``,
    ``vocab.json``, ``merges.txt``, ``tokenizer_config.json``, ``special_tokens_map.json``) and the
    tokenizer's ``<EOS>`` / ``<PAD>`` ids in the config (``eos_token_id``, ``bos_token_id``, ``pad_token_id``),
    so that the directory is a whole model for Hugging Face -- ``AutoTokenizer`` gives our ids for the same
    text, ``GPT2LMHeadModel.generate`` stops at ``<EOS>`` -- and for ``decoderlab generate --checkpoint``
    (:func:`decoderlab.chat.load_model`). It is written to a temporary
    directory next to ``path`` and renamed into place (an existing directory is replaced).
    ``bias=False`` models are written with zero biases (same function; read back as ``bias=True``).
    Extra keyword arguments go to ``GPT2Config`` (e.g. ``attn_implementation="eager"``).

    Returns the ``GPT2LMHeadModel`` (in eval mode if ours is, float32 as ours).

    Raises:
        ValueError: a ModelConfig field GPT-2 cannot express (rope, sinusoidal or no positions; rmsnorm or no
            norm; no MLP; no attention output projection; a bias in the LM head), naming field and value; a
            ``tokenizer`` that is not a byte-level BPE, or whose vocabulary size is not the model's.
        ImportError: transformers is not installed (``pip install 'decoderlab[hf]'``).
    """
    model = unwrap_model(model)
    if not isinstance(model, DecoderOnlyTransformer):
        raise TypeError(f"to_gpt2 takes a DecoderOnlyTransformer, got {type(model).__name__}")
    if tokenizer is not None:
        if not (isinstance(tokenizer, BPETokenizer) and tokenizer.byte_level):
            raise ValueError(f"GPT-2's tokenizer files hold a byte-level BPE; a {getattr(tokenizer, 'kind', '?')} "
                             "tokenizer has none (leave tokenizer= out to write the model alone)")
        if tokenizer.vocab_size != model.config.num_tokens:
            raise ValueError(f"tokenizer vocabulary size {tokenizer.vocab_size} does not match the model's "
                             f"num_tokens {model.config.num_tokens}")
    gpt2_config = model_config_to_gpt2_config(model.config, **{**_special_ids(tokenizer), **gpt2_kwargs})
    _, GPT2LMHeadModel = _require_transformers()
    hf = GPT2LMHeadModel(gpt2_config)
    state = {k: v.detach().clone() for k, v in ours_to_gpt2_state(model).items()}
    own = hf.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:  # a transformers version with other names
        raise ValueError(f"GPT2LMHeadModel tensor names differ: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        hf.load_state_dict(state, strict=True)
    hf.to(model.we.weight.dtype)
    hf.train(model.training)
    if path is not None:
        directory = Path(path)
        check_output_dir(directory, allowed=HF_FILES, what="a Hugging Face GPT-2 directory")
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_directory(directory)  # an error names directory, not the temporary name
        try:
            hf.save_pretrained(str(tmp), safe_serialization=True)
            if tokenizer is not None:
                write_tokenizer_files(tmp, tokenizer, model.config.max_len)
            for f in tmp.iterdir():  # safetensors creates model.safetensors 0600: all files get the usual mode
                usual_mode(f)
            replace_directory(tmp, directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return hf


# ----------------------------------------------------------------------------------------------------------
# Any checkpoint directory: decoderlab's or Hugging Face GPT-2's
# ----------------------------------------------------------------------------------------------------------


def is_gpt2_directory(directory: str | os.PathLike) -> bool:
    """True when ``directory`` holds a Hugging Face GPT-2 ``config.json`` (``model_type`` "gpt2", or GPT-2's
    ``n_embd``) rather than a decoderlab one (``d_model``)."""
    config_file = Path(directory) / CONFIG_FILE
    if not config_file.is_file():
        return False
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return False
    return isinstance(config, dict) and "d_model" not in config and (
        config.get("model_type") == "gpt2" or "n_embd" in config)


def gpt2_tokenizer(directory: str | os.PathLike) -> BPETokenizer:
    """The byte-level BPE tokenizer of a Hugging Face GPT-2 directory: its ``tokenizer.json``, or else its
    ``vocab.json`` + ``merges.txt`` (``BPETokenizer.from_gpt2_files``).

    Raises:
        FileNotFoundError: neither is there; the message names what is missing and how to go on.
        ValueError: a tokenizer file that cannot be read (named).
    """
    directory = Path(directory)
    if (directory / "tokenizer.json").is_file():
        tok = Tokenizer.load(directory / "tokenizer.json")
        if not isinstance(tok, BPETokenizer):
            raise ValueError(f"{directory / 'tokenizer.json'} holds a {tok.kind} tokenizer, not GPT-2's byte-level "
                             "BPE")
        return tok
    vocab, merges = directory / "vocab.json", directory / "merges.txt"
    if vocab.is_file() and merges.is_file():
        return BPETokenizer.from_gpt2_files(vocab, merges)
    missing = " and ".join(f.name for f in (vocab, merges) if not f.is_file())
    raise FileNotFoundError(
        f"GPT-2 directory {directory} has weights but no tokenizer: it needs tokenizer.json, or vocab.json and "
        f"merges.txt ({missing} missing). Copy the tokenizer files of the model next to its weights, or load "
        f"the weights alone in Python with decoderlab.hf.from_gpt2({str(directory)!r}) and a tokenizer of "
        "your own"
    )


def load_gpt2_directory(directory: str | os.PathLike, map_location: str | torch.device = "cpu", dtype=None, *,
                        device: str | torch.device | None = None):
    """``(model, tokenizer)`` of a Hugging Face GPT-2 directory (``config.json`` with GPT-2's fields,
    ``model.safetensors`` / sharded safetensors / ``pytorch_model.bin``, and ``tokenizer.json`` or
    ``vocab.json`` + ``merges.txt``: :func:`from_gpt2` and :func:`gpt2_tokenizer`): GPT-2's format, as
    :func:`decoderlab.checkpoint.load_checkpoint` reads decoderlab's. The one loader,
    :func:`decoderlab.chat.load_model` (and ``decoderlab.load`` above it), reads either. The model is in eval
    mode, its weights in ``dtype`` for inference (None: float32; see :mod:`decoderlab.dtypes`), read on the CPU
    and moved to ``device`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``; None: ``map_location``).

    Raises:
        FileNotFoundError: the directory, its weights or its tokenizer files are missing (named).
        ValueError: a file that cannot be read; a tokenizer whose vocabulary size is not the model's; an unknown
            dtype or a device this machine lacks (before any file is read).
    """
    target = torch.device(map_location) if device is None else resolve_device(device)
    check_dtype(dtype, target)  # an unknown dtype, or one the device cannot run, fails before any file is read
    tokenizer = gpt2_tokenizer(directory)  # before the weights: a missing tokenizer is found at once
    model = from_gpt2(directory).to(target)
    if tokenizer.vocab_size != model.config.num_tokens:
        raise ValueError(f"GPT-2 directory {directory}: the tokenizer has {tokenizer.vocab_size} tokens but the "
                         f"model's vocab_size is {model.config.num_tokens}")
    return to_inference_dtype(model, dtype), tokenizer


def checkpoint_reader(directory: str | os.PathLike):
    """The reader of ``directory``'s format: :func:`load_gpt2_directory` for a Hugging Face GPT-2 directory
    (:func:`is_gpt2_directory`), else :func:`decoderlab.checkpoint.load_checkpoint` (which names a missing
    directory or missing files)."""
    return load_gpt2_directory if is_gpt2_directory(directory) else load_checkpoint


def load_any_checkpoint(directory: str | os.PathLike, map_location: str | torch.device = "cpu", dtype=None, *,
                        device: str | torch.device | None = None):
    """Deprecated (kept for one release): ``(model, tokenizer)`` of a decoderlab checkpoint or a Hugging Face
    GPT-2 directory. Use ``decoderlab.load(path)`` (a :class:`decoderlab.Model`) or
    :func:`decoderlab.chat.load_model` (model, tokenizer, template, meta), the one loader; this warns
    (``DeprecationWarning``) and reads as they do (:func:`checkpoint_reader`)."""
    warnings.warn("decoderlab.hf.load_any_checkpoint is deprecated: use decoderlab.load(path) (a Model) or "
                  "decoderlab.chat.load_model(path), the one loader", DeprecationWarning, stacklevel=2)
    return checkpoint_reader(directory)(directory, map_location=map_location, dtype=dtype, device=device)
