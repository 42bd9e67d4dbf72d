"""The front door: ``decoderlab.load(path)`` -> a :class:`Model`, one object that takes text and gives text.

A :class:`Model` holds what :func:`decoderlab.chat.load_model` reads from a checkpoint directory (the
``DecoderOnlyTransformer``, its tokenizer, its chat template and ``meta.json``) and offers the library's free
functions as methods, each a thin call of the function it names (the same arguments, the same result)::

    m = decoderlab.load("runs/statquest")
    m.generate("what is statquest <EOS>", temperature=0)   # 'awesome'  (decoderlab.generate, decoded)
    m.chat("what is statquest")                            # 'awesome'  (decoderlab.chat_reply)
    m.verify("what is statquest <EOS>").ok                 # True       (decoderlab.verify)

An in-memory model goes through the same door: ``Model(module, tokenizer, template="lesson")`` (the model
``decoderlab.train_pairs()`` returns, for one). The methods stay thin on purpose: a new capability of the
library becomes one more method calling its function.

The tokenizer is never passed: every method hands the model's own to the function it calls.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch

from .chat import CHAT_TEMPLATE_KEY, ChatTemplate, chat_reply, get_template, load_model, stream_chat_reply
from .chat.calculator import get_tools
from .chat.tool_loop import DEFAULT_MAX_CALLS, run_tool_turn
from .checkpoint import save_checkpoint, unwrap_model
from .config import PRESETS
from .dtypes import model_dtype
from .generation import SamplingParams, generate, stream, stream_text
from .glassbox import explain, run_with_cache, trace, verify
from .export import to_gguf, to_hf
from .glassbox.features import token_features
from .glassbox.sae import load_sae
from .model import DecoderOnlyTransformer
from .quant import block_weights
from .tokenizers import encode_with_special_tokens

__all__ = ["Model", "load"]

#: ModelConfig fields that say what family a model is (the rest are its sizes)
_DESIGN = ("norm", "position", "mlp", "bias", "tie_weights", "attn_out_proj", "lm_head_bias", "qk_norm")


def load(path: str | os.PathLike, *, device: str | torch.device | None = None, dtype=None) -> "Model":
    """Load a checkpoint as a :class:`Model`: a decoderlab checkpoint or run directory (``model.safetensors``,
    ``config.json``, ``tokenizer.json``, ``meta.json``), a LoRA run's directory (its base, checked, with the adapter
    merged in), a Hugging Face directory (GPT-2, Llama, Mistral, Qwen2, Qwen3, ...:
    :func:`decoderlab.hf.load_hf_directory`) or a GGUF file of llama.cpp / ollama (:func:`decoderlab.gguf.load_gguf`)
    -- what every ``--checkpoint`` of the command line takes.

    Args:
        path: the directory or ``.gguf`` file.
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps`` or a ``torch.device`` (None: the CPU);
            see :func:`decoderlab.devices.resolve_device`.
        dtype: the weights for inference: None (float32, as trained; a GGUF file's own block types, ``"auto"``),
            ``"float32"``, ``torch.bfloat16`` / ``"bfloat16"``, ``torch.float16``, or GGUF's blocks ``"q8_0"`` ...
            ``"q6_k"``; see :mod:`decoderlab.dtypes`. The glass box reads float weights: a GGUF file for it is
            loaded with ``dtype="float32"``.

    This is :func:`decoderlab.chat.load_model` (the one loader of the command line, chat and the server)
    wrapped in a :class:`Model`.

    Raises:
        FileNotFoundError: ``path`` is none of those -- it does not exist, is a file but no ``.gguf`` one, or a
            directory without ``config.json`` (one message, :func:`decoderlab.chat.checkpoint_kind`'s) -- or a
            checkpoint lacks a file (the message names the path and what is missing).
        ValueError: a file that cannot be read (named); an unknown dtype or a device this machine lacks.
    """
    loaded = load_model(path, device=device, dtype=dtype)
    return Model(loaded.model, loaded.tokenizer, loaded.template, meta=loaded.meta, path=path)


class Model:
    """A model with its tokenizer and chat template, and the library's functions as methods.

    Args:
        model: a ``DecoderOnlyTransformer`` (compiled or wrapped is fine: the bare module is kept).
        tokenizer: its tokenizer (its vocabulary size must be the model's ``num_tokens``).
        template: the chat template (a ``ChatTemplate`` or a name of ``decoderlab.chat.TEMPLATES``:
            ``"lesson"`` for the lesson's pair model); None: a base language model (no :meth:`chat`).
        meta: the checkpoint's ``meta.json`` ({} for an in-memory model); path: where it was loaded from.

    Attributes: ``model`` (the ``nn.Module``), ``tokenizer``, ``template``, ``config`` (the ``ModelConfig``),
    ``meta``, ``path``; ``device`` and ``dtype`` (of the weights) as properties.

    Raises:
        TypeError: ``model`` is not a ``DecoderOnlyTransformer``.
        ValueError: the tokenizer's vocabulary size is not the model's; an unknown template name.
    """

    def __init__(self, model, tokenizer, template: str | ChatTemplate | None = None, *, meta: dict | None = None,
                 path: str | os.PathLike | None = None):
        model = unwrap_model(model)
        if not isinstance(model, DecoderOnlyTransformer):
            raise TypeError(f"Model wraps a DecoderOnlyTransformer, got {type(model).__name__}")
        if tokenizer.vocab_size != model.config.num_tokens:
            raise ValueError(f"tokenizer vocabulary size {tokenizer.vocab_size} does not match the model's "
                             f"num_tokens {model.config.num_tokens}")
        self.model, self.tokenizer = model, tokenizer
        self.template = None if template is None else get_template(template)
        self.meta = dict(meta or {})
        self.path = None if path is None else Path(path)

    load = staticmethod(load)

    # -- what it is -------------------------------------------------------------------------------------------

    @property
    def config(self):
        """The ``ModelConfig`` (the checkpoint's ``config.json``)."""
        return self.model.config

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the word embedding (float32 unless loaded with another ``dtype``)."""
        return self.model.we.weight.dtype

    def preset(self) -> str:
        """The preset this model is (``"statquest"``), ``"<name>-like"`` for a preset's design at other sizes,
        else ``"custom"``."""
        mine = self.config.to_dict()
        for name, fields in PRESETS.items():
            if all(mine.get(k) == v for k, v in fields.items() if k not in ("dropout", "attention", "init")):
                return name
        for name, fields in PRESETS.items():
            if all(mine.get(k) == fields.get(k, mine.get(k)) for k in _DESIGN):
                return f"{name}-like"
        return "custom"

    def __repr__(self) -> str:
        c = self.config
        template = self.template.name if self.template is not None else None
        where = f", path={str(self.path)!r}" if self.path is not None else ""
        dtype, held = model_dtype(self.model), block_weights(self.model)
        blocks = f" ({held:,} in {dtype} blocks)" if held else ""
        return (f"Model({self.preset()}: d_model={c.d_model}, n_layer={c.n_layer}, n_head={c.n_head}, "
                f"num_tokens={c.num_tokens}, max_len={c.max_len}; {self.model.num_parameters():,} parameters"
                f"{blocks}; tokenizer={self.tokenizer.kind}, template={template!r}, device={self.device}, "
                f"dtype={dtype}{where})")

    # -- text <-> ids -----------------------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids (T,) of a text as :meth:`generate` and :meth:`trace` read it: with the start token the
        tokenizer puts first (Llama's ``<s>``; :func:`~decoderlab.tokenizers.encode_with_special_tokens`), as
        ``transformers``' ``tokenizer.encode(text)``; ``add_special_tokens=False``: ``tokenizer.encode(text)``
        alone. The same for decoderlab's own tokenizers, which add nothing."""
        if not isinstance(add_special_tokens, bool):
            raise TypeError(f"add_special_tokens must be True or False, got {add_special_tokens!r}")
        return encode_with_special_tokens(self.tokenizer, text) if add_special_tokens else list(
            self.tokenizer.encode(text))

    def detokenize(self, ids: Sequence[int] | torch.Tensor, *, skip_special: bool = False) -> str:
        """``tokenizer.decode(ids)``: the text of token ids (``skip_special`` leaves out ``<EOS>``, ``<PAD>``)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.tokenizer.decode(list(ids), skip_special=skip_special)

    # -- generation -------------------------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int] | torch.Tensor, params: SamplingParams | int | None = None, *,
                 use_cache: bool = True, keep: int | None = None, compile: bool | str = False,
                 **sampling) -> str | list[int]:
        """Continue ``prompt``: text in, text out (``"".join(stream_text(...))``, whole characters, control
        tokens left out); token ids in, the new ids out (:func:`decoderlab.generation.generate`).

        ``params`` / ``**sampling``: :class:`~decoderlab.generation.SamplingParams` or its fields by name
        (temperature, top_k, top_p, min_p, max_new_tokens, seed, stop, stop_at_eos, repetition_penalty, ...;
        an int ``params`` is max_new_tokens). Defaults as ``SamplingParams`` (temperature 1.0: a sample).
        ``compile``: decode through the compiled step (:meth:`DecoderOnlyTransformer.compile_decode`, compiled
        once on first use and kept; the same greedy tokens as eager); ``compile="aot"``: through the
        ahead-of-time package (:meth:`compile` with ``mode="aot"``).

        Raises:
            TypeError: an unknown sampling keyword (naming it and listing the known ones); ValueError: a value
                out of range (named) -- as :func:`decoderlab.generation.stream`.
        """
        if isinstance(compile, str):
            if compile != "aot":
                raise ValueError(f"compile must be False, True or 'aot', got {compile!r}")
            self.compile(mode="aot")
        elif compile:
            self.compile()
        if isinstance(prompt, str):
            return "".join(self.stream(prompt, params, use_cache=use_cache, keep=keep, **sampling))
        return generate(self.model, prompt, params, tokenizer=self.tokenizer, use_cache=use_cache, keep=keep,
                        **sampling)

    def compile(self, **options) -> "Model":
        """Decode through the compiled step from now on (:meth:`DecoderOnlyTransformer.compile_decode`: Inductor,
        fullgraph, a static KV cache; on a CPU through Inductor's C++ wrapper; ``options`` as ``compile_decode``'s).
        ``mode="aot"`` (and optionally ``cache_dir``): ahead of time instead, torch.export + AOTInductor, a
        ``.pt2`` package written once to ``~/.cache/decoderlab/aot`` and loaded by later processes
        (:class:`decoderlab.aot.AOTDecodeStep`). Compiles once; returns self."""
        from .aot import AOTDecodeStep

        current = getattr(self.model, "compiled_decode", None)
        if current is None or (options.get("mode") == "aot") != isinstance(current, AOTDecodeStep):
            self.model.compile_decode(**options)
        return self

    def stream(self, prompt: str | Sequence[int] | torch.Tensor, params: SamplingParams | int | None = None, *,
               use_cache: bool = True, keep: int | None = None, **sampling) -> Iterator[str] | Iterator[int]:
        """Stream the continuation: text in, text pieces out (:func:`decoderlab.generation.stream_text`); ids
        in, ids out one at a time (:func:`decoderlab.generation.stream`). Arguments and errors as
        :meth:`generate`; every argument is checked at the call."""
        if isinstance(prompt, str):
            return stream_text(self.model, prompt, self.tokenizer, params, use_cache=use_cache, keep=keep,
                               **sampling)
        return stream(self.model, prompt, params, tokenizer=self.tokenizer, use_cache=use_cache, keep=keep,
                      **sampling)

    def chat(self, messages: str | Sequence[dict], params: SamplingParams | int | None = None, *, tools=None,
             max_tool_calls: int = DEFAULT_MAX_CALLS, info: dict | None = None, **sampling) -> str:
        """The assistant's reply (:func:`decoderlab.chat.chat_reply`) to ``messages`` (OpenAI's
        ``[{"role": "user", "content": ...}, ...]``, ending with a user message) or to one user text, rendered
        with the model's chat template. Sampling as :meth:`generate`; the default temperature is the
        template's (greedy for the lesson's, as ``decoderlab chat``). ``info``: see ``chat_reply``.

        Raises:
            ValueError: the model has no chat template (a base language model: use :meth:`generate`); bad
                messages or sampling values (as ``chat_reply``).
            ValueError: ``tools`` naming an unknown built-in tool (the known ones listed).

        ``tools``: the built-in tools by name (``"calculator"`` or a list) or a mapping name -> tool; the turn then
        runs the calls the model makes and feeds their results back, at most ``max_tool_calls`` of them
        (:func:`decoderlab.chat.run_tool_turn`); ``info`` receives ``tool_calls`` (the
        :class:`~decoderlab.chat.ToolCallRecord` list), ``messages`` (what the turn added) and ``finish_reason``.
        """
        template, messages, sampling = self._chat_args(messages, params, sampling)
        if tools is not None:
            tools = tools if isinstance(tools, Mapping) else get_tools(tools)
            turn = run_tool_turn(self.model, self.tokenizer, messages, template, tools, params,
                                 max_calls=max_tool_calls, **sampling)
            if info is not None:
                info.update(tool_calls=turn.calls, messages=turn.messages, finish_reason=turn.finish_reason)
            return turn.content
        return chat_reply(self.model, messages, self.tokenizer, template, params, info=info, **sampling)

    def stream_chat(self, messages: str | Sequence[dict], params: SamplingParams | int | None = None, *,
                    info: dict | None = None, **sampling) -> Iterator[str]:
        """:meth:`chat`'s reply as text pieces (:func:`decoderlab.chat.stream_chat_reply`)."""
        template, messages, sampling = self._chat_args(messages, params, sampling)
        return stream_chat_reply(self.model, messages, self.tokenizer, template, params, info=info, **sampling)

    def _chat_args(self, messages, params, sampling: dict) -> tuple[ChatTemplate, list[dict], dict]:
        if self.template is None:
            raise ValueError(f"{self._name()} has no chat template (a base language model): continue text with "
                             ".generate(text), or fine-tune it on conversations (decoderlab finetune)")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if params is None and "temperature" not in sampling:
            sampling = {"temperature": self.template.default_temperature, **sampling}
        return self.template, list(messages), sampling

    def _name(self) -> str:
        return f"the model at {self.path}" if self.path is not None else "this model"

    # -- the glass box ----------------------------------------------------------------------------------------

    def trace(self, text: str | Sequence[int] | torch.Tensor, layers=None, heads=None, top_k: int = 5):
        """Every number of one forward pass (:func:`decoderlab.glassbox.trace`): a ``Trace``, e.g.
        ``.layers[0].percents`` (B, H, T, T)."""
        return trace(self.model, text, self.tokenizer, layers=layers, heads=heads, top_k=top_k)

    def run_with_cache(self, text: str | Sequence[int] | torch.Tensor, names_filter=None):
        """``(logits (B, T, num_tokens), ActivationCache)`` of one pass, keyed by TransformerLens's hook names
        (:func:`decoderlab.glassbox.run_with_cache`)."""
        return run_with_cache(self.model, text, names_filter, tokenizer=self.tokenizer)

    def verify(self, text: str | Sequence[int] | torch.Tensor, tol: float = 1e-5):
        """The pass recomputed in float64 NumPy, step by step (:func:`decoderlab.glassbox.verify`): a
        ``VerifyReport`` (``.ok``, ``.table()``)."""
        return verify(self.model, text, tol, tokenizer=self.tokenizer)

    def explain(self, text: str | Sequence[int] | torch.Tensor, **options) -> str:
        """The step-by-step story of a pass, as the lesson prints it (:func:`decoderlab.glassbox.explain`;
        ``options``: layer, head, top_k, png, html)."""
        return explain(self.model, text, self.tokenizer, **options)

    # -- writing it out ---------------------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> Path:
        """Write a decoderlab checkpoint directory (:func:`decoderlab.checkpoint.save_checkpoint`) with the
        chat template in its ``meta.json``, so :func:`load` gives this model back; returns its path.

        Raises: ``FileExistsError`` for a directory holding other files (named, nothing deleted)."""
        meta = {k: v for k, v in self.meta.items() if k != "decoderlab_version"}
        if self.template is not None:
            meta.update(task="chat", **{CHAT_TEMPLATE_KEY: self.template.to_dict()})
        return save_checkpoint(directory, self.model, self.tokenizer, meta=meta)

    def to_gguf(self, path: str | os.PathLike, *, dtype: str = "float32", force: bool = False) -> dict:
        """Write one GGUF file for llama.cpp and ollama and a Modelfile beside it (:func:`decoderlab.export.to_gguf`:
        the llama.cpp architecture that computes the model -- gpt2, llama, qwen2, qwen3 --, the tokenizer and
        this model's chat template inside; ``dtype`` "float32", "bfloat16", "float16", "q8_0", "q4_0" or "q4_1"; LoRA adapters merged); returns its
        summary (architecture, bytes, tensors, types, Modelfile).

        Raises: ``ValueError`` for a shape or tokenizer the format cannot carry or a weight float16 cannot hold
        (named), or an unknown dtype; ``FileExistsError`` for an existing file without ``force``."""
        name = Path(self.path).resolve().stem if self.path is not None else None
        return to_gguf(self.model, self.tokenizer, path, dtype=dtype, name=name, template=self.template,
                       force=force)

    # -- sparse autoencoders ----------------------------------------------------------------------------------

    def load_sae(self, directory: str | os.PathLike):
        """A sparse autoencoder saved in SAELens's format (``decoderlab sae --out DIR``;
        :func:`decoderlab.glassbox.sae.load_sae`), on this model's device."""
        return load_sae(directory).to(self.device)

    def features(self, sae, hook: str, text: str | Sequence[int] | torch.Tensor, *, top: int = 8):
        """Each position's most active features of ``sae`` (a loaded SAE or its directory) at ``hook``
        (:func:`decoderlab.glassbox.features.token_features`) for ``text``."""
        if not hasattr(sae, "encode"):
            sae = self.load_sae(sae)
        ids = self.tokenize(text) if isinstance(text, str) else text
        return token_features(self.model, sae, hook, ids, top=top, tokenizer=self.tokenizer)

    def to_hf(self, directory: str | os.PathLike) -> dict:
        """Write a Hugging Face directory (:func:`decoderlab.export.to_hf`: the transformers class whose forward
        equals the model's, the tokenizer's files, the chat template as Jinja, LoRA merged first); returns its
        summary (architecture, bytes, tensors, chat_template).

        Raises: ``ValueError`` for a model no Hugging Face class computes (named: the lesson's model has
        sinusoidal positions), before anything is written."""
        return to_hf(self.model, self.tokenizer, directory, self.template)
