"""GGUF files in: the file llama.cpp and ollama run, opened as decoderlab's model, tokenizer and chat template.

    contents = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")   # fields, state dict, tokenizer, template, report
    model, tokenizer, info = load_gguf(path, dtype="bfloat16")

What is read, each step checked before the next (every error one line naming the file and what is wrong):

1. the header (:mod:`.reader`): a GGUF v2/v3 file, not truncated, every tensor's data inside it;
2. the architecture and shape (:mod:`.architecture`, its family's module): ``llama``, ``qwen2``, ``qwen3`` or
   ``gpt2``, with no feature the model class lacks; the tensors exactly those the metadata implies (names, count
   and shapes);
3. the tokenizer (:mod:`.tokenizer`): a byte-level BPE with its merges and llama.cpp's named pre-tokenizer, or a
   SentencePiece vocabulary;
4. the weights (:mod:`.weights`): every GGML type one the ``gguf`` package dequantizes, dequantized to float32
   (then ``dtype``), llama's query/key rows put back in rotate-half order.

The model (:class:`~decoderlab.model.DecoderOnlyTransformer`) is built with its initialisers skipped and the
weights put in place, as a checkpoint is loaded. ``info`` (:class:`GGUFInfo`) carries the chat template
(``tokenizer.chat_template``), the control ids (bos, eos, end of turn), the context length and the report of what
was dequantized and what it cost.

Source: ggml's GGUF format; llama.cpp's converter and vocabulary code for what each key and tensor holds.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..kernels.pages import collapse_in_background
from .architecture import check_architecture, check_tensors, family_of, model_fields
from .reader import GGUFFile
from .tokenizer import check_tokenizer, hf_tokenizer, special_flags, special_ids
from .weights import DequantReport, check_types, state_dict

#: the file name ending of a GGUF file (how ``--checkpoint`` tells one from a directory)
SUFFIX = ".gguf"


def is_gguf_file(path: str | os.PathLike) -> bool:
    """True when ``path`` names a GGUF file (a ``.gguf`` name that is not a directory); the file need not
    exist yet -- reading it names what is missing."""
    p = Path(path)
    return p.suffix.lower() == SUFFIX and not p.is_dir()


@dataclass
class GGUFInfo:
    """What a GGUF file says besides its weights.

    Attributes:
        path: the file.  architecture: llama.cpp's name (``llama``, ``qwen2``, ``qwen3``, ``gpt2``).
        name: ``general.name`` ("" when absent).
        chat_template: ``tokenizer.chat_template`` (a Jinja template, Hugging Face's), or None.
        special_ids: control ids by role: ``bos``, ``eos``, ``eot`` (end of turn), ``eom``, ``pad``, ``unk``
            (those the file states, else llama.cpp's defaults: :data:`~.tokenizer.VOCAB_DEFAULTS`).
        special_tokens: the same roles -> the tokens' text (``{"eos": "<|im_end|>", ...}``).
        add_bos: whether llama.cpp puts ``bos`` before a text (``tokenizer.ggml.add_bos_token``, else llama.cpp's
            default: true for SentencePiece and Llama 3's BPE).
        add_eos: whether llama.cpp puts ``eos`` after a text (``tokenizer.ggml.add_eos_token``, default false).
        context_length: ``<arch>.context_length`` (tokens).
        report: what was dequantized and the bytes it cost (:class:`~.weights.DequantReport`).
    """

    path: Path
    architecture: str
    name: str = ""
    chat_template: str | None = None
    special_ids: dict[str, int] = field(default_factory=dict)
    special_tokens: dict[str, str] = field(default_factory=dict)
    add_bos: bool = False
    add_eos: bool = False
    context_length: int = 0
    report: DequantReport = field(default_factory=DequantReport)

    def to_meta(self) -> dict:
        """The JSON-ready summary kept in a loaded model's ``meta`` under ``"gguf"``."""
        return dict(path=str(self.path), architecture=self.architecture, name=self.name,
                    special_ids=dict(self.special_ids), special_tokens=dict(self.special_tokens), add_bos=self.add_bos,
                    add_eos=self.add_eos,
                    context_length=self.context_length,
                    dequantized=self.report.to_dict())


@dataclass
class GGUFContents:
    """A GGUF file read into decoderlab's terms (:func:`read_gguf`): ``fields`` (ModelConfig fields, a dict),
    ``state`` (our state dict, float32 tensors by our names), ``tokenizer`` (a ``tokenizers.Tokenizer``),
    ``info`` (:class:`GGUFInfo`) and ``blocks`` (layer name -> ``decoderlab.quant.BlockWeight``: the matrices
    of the block type asked, kept in their blocks; those layers' weights are not in ``state``)."""

    fields: dict
    state: dict[str, torch.Tensor]
    tokenizer: object
    info: GGUFInfo
    blocks: dict = field(default_factory=dict)


def open_checked(path: str | os.PathLike) -> tuple[GGUFFile, str, dict]:
    """The opened file, its architecture and its ModelConfig fields, after every check that reads no weight:
    header, architecture, shape metadata, tokenizer, tensor names and shapes, GGML types.

    Raises:
        FileNotFoundError: no file.  ValueError: any check failing (one line naming the file and the fault).
    """
    gf = GGUFFile(path)
    arch = check_architecture(gf.metadata, gf.path)
    check_tokenizer(gf.metadata, gf.path)
    num_tokens = len(gf.metadata["tokenizer.ggml.tokens"])
    fields = model_fields(gf.metadata, gf.tensors, num_tokens, gf.path)
    check_tensors(gf.path, arch, fields, {n: t.shape for n, t in gf.tensors.items()})
    check_types(gf)
    return gf, arch, fields


def _tokenizer(meta: dict, path):
    """:func:`hf_tokenizer` of the file; a SentencePiece vocabulary's merges kept in the cache once derived
    (``<cache>/gguf-tokenizers/``, an int32 (merges, 2) array of token ids, keyed by the file's path, size and
    modification time and by the converter's source): deriving them from the pieces' scores took ~2 s of Gemma 3's
    262,144 pieces, most of the file's load. A cache that cannot be written or a damaged entry: derived, as
    without one."""
    if meta.get("tokenizer.ggml.model") != "llama":
        return hf_tokenizer(meta, path)
    import numpy as np

    from ..waiting import cache_root
    from . import tokenizer as converter

    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|".encode()
                         + Path(converter.__file__).read_bytes()).hexdigest()[:24]
    kept, tokens = cache_root() / "gguf-tokenizers" / f"{key}.npy", meta["tokenizer.ggml.tokens"]
    try:
        pairs = np.load(kept, allow_pickle=False).tolist()
        return hf_tokenizer(meta, path, [(tokens[a], tokens[b]) for a, b in pairs])
    except (OSError, ValueError, IndexError, TypeError):  # not kept yet, or damaged: derived again
        pass
    index = {t: i for i, t in enumerate(tokens)}
    merges = converter.score_merges(index, dict(zip(tokens, meta["tokenizer.ggml.scores"])))
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_name(f"{kept.stem}.{os.getpid()}.tmp.npy")
        np.save(tmp, np.array([(index[a], index[b]) for a, b in merges], dtype=np.int32).reshape(-1, 2))
        os.replace(tmp, kept)  # whole or not at all
    except OSError:
        pass
    return hf_tokenizer(meta, path, merges)


def read_gguf(path: str | os.PathLike, *, keep: str | None = None, huge_pages: bool = False) -> GGUFContents:
    """Read a GGUF file of a carried architecture into decoderlab's terms (module docstring), float32 -- but for,
    with ``keep`` a block dtype (``q8_0``, ``q4_0``, ``q4_1``), the linear layers' matrices of that very type, kept
    in their blocks (``blocks``). ``huge_pages``: the weights' pages collapsed into 2 MiB ones as the tokenizer is
    built (for weights the model will hold as they are read).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: not a GGUF file, truncated or corrupt; an architecture not carried (named, with those
            allowed) or a feature the model lacks; tensors disagreeing with the metadata (count, names, shapes);
            a GGML type ``gguf`` cannot dequantize; a tokenizer not rebuilt (SentencePiece, an unknown
            pre-tokenizer) -- each one line naming the file.
    """
    with _collector_paused():
        gf, arch, fields = open_checked(path)
        info = _info(gf, arch)
        family = family_of(arch)
        orders = family.qkv_orders(arch, fields) if family.SPLIT_QKV else None
        state, blocks, info.report = state_dict(gf, fields, keep, orders)
        # the weights' pages made huge (decoderlab.kernels.pages) while the tokenizer is built: for Gemma 3, 0.8 s
        # of the kernel's work beside 1.6 s of ours
        weights = [*state.values(), *(w.packed for v in blocks.values() for w in (v if isinstance(v, list) else [v]))]
        collapsed = collapse_in_background(weights) if huge_pages else (lambda: None)
        tokenizer = _tokenizer(gf.metadata, gf.path)
        collapsed()
    return GGUFContents(fields, state, tokenizer, info, blocks)


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector paused while a file is read, then as it was: the vocabulary's strings,
    its merges and the tokenizer's tables are millions of small objects made in a burst, and every few hundred
    allocations started a pass over all of them so far (Gemma 3's 262,144 pieces: load 2.7 -> 2.2 s on an Intel
    Xeon, 2026-12-07). None of them forms a cycle; whatever does is collected at the next pass after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _info(gf: GGUFFile, arch: str) -> GGUFInfo:
    meta = gf.metadata
    ids = special_ids(meta)
    template = meta.get("tokenizer.chat_template")
    return GGUFInfo(path=gf.path, architecture=arch, name=str(meta.get("general.name", "")),
                    chat_template=template if isinstance(template, str) else None, special_ids=ids,
                    special_tokens={k: meta["tokenizer.ggml.tokens"][i] for k, i in ids.items()},
                    **special_flags(meta),
                    context_length=int(meta.get(f"{arch}.context_length", 0) or 0))


def read_info(path: str | os.PathLike) -> GGUFInfo:
    """What a GGUF file says besides its weights (:class:`GGUFInfo`, no report), from its header alone: for a
    chat template or the control tokens without loading the model.

    Raises:
        FileNotFoundError, ValueError: as :func:`read_gguf` for the header, the architecture and the tokenizer.
    """
    gf = GGUFFile(path)
    arch = check_architecture(gf.metadata, gf.path)
    check_tokenizer(gf.metadata, gf.path)
    return _info(gf, arch)


def load_gguf(path: str | os.PathLike, map_location: str | torch.device = "cpu", dtype=None, *,
              device: str | torch.device | None = None):
    """``(model, tokenizer, info)`` of a GGUF file: the ``DecoderOnlyTransformer`` in eval mode, on ``device``
    (None: ``map_location``); its tokenizer as a :class:`~decoderlab.tokenizers.BPETokenizer`; ``info`` as
    :class:`GGUFInfo`. The weights, by ``dtype``:

    * ``None`` or ``"auto"`` (the default): the file's own types -- every matrix of a block type the kernels
      multiply (Q8_0 ... Q6_K, :mod:`decoderlab.kernels`) kept in its blocks, no float copy (memory close to the
      file's size); a matrix of another block type (Q2_K, IQ...) dequantized to float32. The read line starts
      "weights as in the file". An F16 or BF16 matrix stays in its 16 bits (:mod:`decoderlab.half`: the model's
      activations float32, as llama.cpp's, not 16-bit ones a CPU without AVX512-BF16 / FP16 emulates). On a
      device other than the CPU (where the kernels are not): float32, as ``"float32"``.
    * a float dtype: every weight dequantized, then cast to it (:mod:`decoderlab.dtypes`).
    * a block dtype (``q8_0`` ... ``q6_k``): what every linear layer then holds: the file's matrices of that type
      kept as they are; every other matrix dequantized and quantized to ``dtype``
      (:func:`decoderlab.quant.quantize_model`), which the read line says (``info.report.requantized``) -- for
      the types quantized here (q8_0, q4_0, q4_1, q5_0, q5_1); a K-quant the file's matrices are not all in is
      refused, naming the file's types.

    Raises:
        as :func:`read_gguf`; ValueError: an unknown dtype or a device this machine lacks, before the file is
        read; a K-quant dtype the file cannot be held in (its types named).
    """
    from ..checkpoint import load_weights
    from ..devices import resolve_device
    from ..dtypes import dtype_name, to_inference_dtype
    from ..model import DecoderOnlyTransformer, ModelConfig, initialisers_skipped
    from ..tokenizers import BPETokenizer

    from ..config.names import AUTO_DTYPE, BLOCK_DTYPES, QUANTIZABLE_BLOCK_DTYPES
    from ..half import HALF, use_half_weights
    from ..quant import use_block_weights
    from .weights import KEEP_ALL

    auto = dtype is None or dtype == AUTO_DTYPE
    name = AUTO_DTYPE if auto else dtype_name(dtype)
    target = torch.device(map_location) if device is None else resolve_device(device)
    if auto and target.type != "cpu":  # the kernels are the CPU's: elsewhere the file's weights dequantized
        auto, name = False, "float32"
    contents = read_gguf(path, keep=KEEP_ALL if auto else name if name in BLOCK_DTYPES else None,
                         huge_pages=target.type == "cpu" and (auto or name == "float32"))
    config = ModelConfig.from_dict(contents.fields)
    with initialisers_skipped():  # every weight comes from the file
        model = DecoderOnlyTransformer(config)
    state = dict(contents.state)
    if contents.blocks:  # their planes are the layers' own buffers: put in place, then loaded as they are
        use_block_weights(model, contents.blocks)
        state.update({k: v for k, v in model.state_dict().items() if k.rsplit(".", 1)[-1].startswith("packed_")})
    state = {k: v.to(target) for k, v in state.items()}
    halves = [k for k, t in state.items() if t.dtype in HALF]  # a float file's 16-bit matrices, kept as they are
    for k in halves:  # (load_weights casts to the parameter's dtype: give it theirs, as a view of one element)
        model.get_parameter(k).data = torch.empty((), dtype=state[k].dtype).expand(state[k].shape)
    load_weights(model, state, source=str(contents.info.path), assign=True)
    if halves:
        use_half_weights(model)
    model.to(target).eval()
    report = contents.info.report
    floats = any(type(m) is torch.nn.Linear for m in model.modules())
    if auto:
        report.own = True
        if not contents.blocks and not report.kept:  # a file of float32 matrices, said
            report.own_float = _float_type(path)
    elif name in BLOCK_DTYPES and floats:
        if name not in QUANTIZABLE_BLOCK_DTYPES:
            raise ValueError(f"{path}: --dtype {name} needs every matrix in {name} blocks, and this file's are "
                             f"{', '.join(sorted(report.types))}: {name} has no quantizer here (llama.cpp's "
                             f"llama-quantize writes it); use --dtype auto (the file's own types) or one of "
                             f"{', '.join(QUANTIZABLE_BLOCK_DTYPES)}")
        report.requantized = name  # said on the read line: these are not the file's own blocks
        to_inference_dtype(model, dtype)
    elif name not in BLOCK_DTYPES:
        to_inference_dtype(model, dtype)
        report.cast = name if name != "float32" else None  # the read line's float32 is then not what is held
    return model, BPETokenizer(contents.tokenizer, special_tokens=_named_tokens(contents.info)), contents.info


def _float_type(path) -> str:
    """The GGML type of most of a float file's matrices, lower case (``"f16"``)."""
    import collections

    counts = collections.Counter(t.type.name for t in GGUFFile(path).tensors.values() if len(t.shape) == 2)
    return (counts.most_common(1)[0][0] if counts else "F32").lower()


def _named_tokens(info: GGUFInfo) -> dict:
    """The file's control tokens under the names a ``BPETokenizer`` keeps (Hugging Face's): its end of text is
    ``tokenizer.ggml.eos_token_id`` (SmolLM2's ``<|im_end|>``), not a guess from the vocabulary."""
    named = {f"{role}_token": text for role, text in info.special_tokens.items()
             if role in ("bos", "eos", "pad", "unk")}
    return {**named, "add_bos_token": info.add_bos, "add_eos_token": info.add_eos}
