"""llama.cpp's architectures decoderlab carries, over one table of families (:data:`FAMILIES`: :mod:`.llama`,
:mod:`.gpt2`, :mod:`.gemma3`): a file's metadata -> ``ModelConfig`` fields and the tensors that shape has (what every file is
checked against before a weight is read), and a model -> the architecture that computes it exactly (what every
file is written as).

Architectures (``general.architecture``): ``gpt2`` (GPT-2's shape), ``llama``, ``qwen2`` and ``qwen3`` (the llama
family), ``gemma3`` (Gemma 3's text model: sliding windows, sandwich norms). Metadata every one has (``<arch>.`` prefix): ``context_length`` -> max_len, ``embedding_length`` ->
d_model, ``block_count`` -> n_layer, ``feed_forward_length`` -> d_ff, ``attention.head_count`` -> n_head;
``tokenizer.ggml.tokens``' length -> num_tokens; the output layer tied when the file has no ``output.weight``.
What the model class does not carry -- rotary scaling, partial rotary dimensions, sliding windows, experts, an
architecture not listed -- is refused, named (a family lists the keys it carries: gemma3 its sliding window).

Source: llama.cpp's ``llama-arch.cpp`` (the names) and ``convert_hf_to_gguf.py`` (what each key holds).
"""

from __future__ import annotations

from . import gemma3, gpt2, llama
from .metadata import positive

#: the families, each a module: its ARCHITECTURES, their metadata and tensors both ways, the models it computes
FAMILIES = (llama, gpt2, gemma3)
#: llama.cpp's architectures decoderlab's model class carries (``general.architecture``)
ARCHITECTURES = tuple(a for f in FAMILIES for a in f.ARCHITECTURES)
#: metadata keys (after ``<arch>.``) naming a feature the model class does not carry, and what it is
_NOT_CARRIED = {
    "rope.scaling.type": "rotary position scaling",
    "rope.scaling.factor": "rotary position scaling",
    "attention.sliding_window": "sliding-window attention",
    "expert_count": "a mixture of experts",
    "attention.clamp_kqv": "clamped q/k/v",
    "logit_scale": "scaled logits",
    "attention.logit_softcapping": "soft-capped attention logits",
    "final_logit_softcapping": "soft-capped logits",
}


class ExportError(ValueError):
    """A model no llama.cpp architecture computes exactly; ``field`` names the first ModelConfig field in the way."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def family_of(arch: str):
    """The family module of a carried architecture."""
    return next(f for f in FAMILIES if arch in f.ARCHITECTURES)


def check_architecture(meta: dict, path="") -> str:
    """The file's ``general.architecture``, or ``ValueError`` naming it and those carried (or the feature the
    model lacks)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not one decoderlab's model carries; allowed: "
                         f"{', '.join(ARCHITECTURES)}")
    carried = getattr(family_of(arch), "CARRIED", ())
    for key, what in _NOT_CARRIED.items():
        if key in carried:
            continue
        value = meta.get(f"{arch}.{key}")
        if value not in (None, 0, "none", 1.0):  # absent, or stated as off
            raise ValueError(f"{path}: GGUF metadata {arch}.{key} = {value!r} asks for {what}, which decoderlab's "
                             f"model does not carry")
    return arch


def model_fields(meta: dict, tensor_names, num_tokens: int, path="") -> dict:
    """The ``ModelConfig`` fields (a dict) of a file of a carried architecture.

    Args:
        meta: the file's metadata.  tensor_names: the names of its tensors (``output.weight`` absent = tied).
        num_tokens: the tokenizer's vocabulary size (``tokenizer.ggml.tokens``).

    Raises:
        ValueError: an architecture not carried (named, with those allowed); a missing or non-numeric size; a
            feature the model does not carry (partial rotary dimensions, rope scaling, ...), each naming the key.
    """
    arch = check_architecture(meta, path)
    names = set(tensor_names)
    common = dict(num_tokens=num_tokens, d_model=positive(meta, arch, "embedding_length", path),
                  n_layer=positive(meta, arch, "block_count", path),
                  n_head=positive(meta, arch, "attention.head_count", path),
                  max_len=positive(meta, arch, "context_length", path),
                  d_ff=positive(meta, arch, "feed_forward_length", path), attention="sdpa",
                  tie_weights="output.weight" not in names, dropout=0.0)
    return dict(common, **family_of(arch).fields(meta, arch, common, names, path))


def expected_shapes(arch: str, fields: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a file of ``arch`` with these ModelConfig ``fields`` has: llama.cpp's name -> logical shape
    (rows, cols), in llama.cpp's order."""
    family = family_of(arch)
    d, v = fields["d_model"], fields["num_tokens"]
    out = {"token_embd.weight": (v, d)}
    if family.LEARNED_POSITIONS:
        out["position_embd.weight"] = (fields["max_len"], d)
    for i in range(fields["n_layer"]):
        out.update({f"blk.{i}.{k}": s for k, s in family.block_shapes(arch, fields).items()})
    out["output_norm.weight"] = (d,)
    if family.NORM_BIAS:
        out["output_norm.bias"] = (d,)
    if not fields["tie_weights"]:
        out["output.weight"] = (v, d)
    return out


def check_tensors(path, arch: str, fields: dict, shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise ``ValueError`` (one line) when the file's tensors (name -> logical shape) are not exactly those its
    metadata implies: a tensor missing, one the architecture does not have, or one of another shape -- each
    named, with the metadata that sets its shape."""
    want = expected_shapes(arch, fields)
    missing = [n for n in want if n not in shapes]
    extra = [n for n in shapes if n not in want]
    if missing:
        raise ValueError(f"{path}: tensor {missing[0]} is missing ({len(missing)} missing): the metadata says "
                         f"{fields['n_layer']} blocks of the {arch} architecture, {len(want)} tensors; the file has "
                         f"{len(shapes)}")
    if extra:
        raise ValueError(f"{path}: tensor {extra[0]} is not one of the {arch} architecture's tensors for this "
                         f"metadata ({fields['n_layer']} blocks); decoderlab's model has no place for it")
    for name, shape in want.items():
        if tuple(shapes[name]) != shape:
            raise ValueError(f"{path}: tensor {name} has shape {tuple(shapes[name])}, but the metadata (d_model "
                             f"{fields['d_model']}, {fields['n_head']} heads, d_ff {fields['d_ff']}, "
                             f"{fields['num_tokens']} tokens) says {shape}")


def gguf_architecture(config) -> str:
    """llama.cpp's architecture that computes exactly the model of ``config``: ``gpt2`` (GPT-2's shape), ``llama``
    (rope, RMSNorm, SwiGLU, grouped-query attention), ``qwen2`` (with q/k/v biases) or ``qwen3`` (with a QK-norm).

    Raises:
        ExportError (a ValueError): none does -- one line naming each field in the way against the nearest
            architecture (value, the option that sets it, why); ``field`` is the first.
    """
    faults = {family: family.shape_faults(config) for family in FAMILIES}
    for family, bad in faults.items():
        if not bad:
            return family.architecture(config)
    family = min(FAMILIES, key=lambda f: len(faults[f]))  # (llama's before gpt2's and gemma3's on a tie)
    gpt2_nearest = family is gpt2
    bad, nearest = faults[family], " / ".join(family.ARCHITECTURES)
    has = ", ".join(f"{f}={getattr(config, f)!r} ({f'{opt} {getattr(config, f)}' if opt else 'ModelConfig.' + f})"
                    for f, _, opt, _ in bad)
    how = f"; train with {gpt2.how(bad)} to export it" if gpt2_nearest else ""
    raise ExportError(f"--format gguf writes the models a llama.cpp architecture computes exactly "
                      f"({', '.join(ARCHITECTURES)}); the nearest is {nearest}, where "
                      f"{'; '.join(w for *_, w in bad)}; this model has {has}{how}", bad[0][0])
