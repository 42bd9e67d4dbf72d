"""llama.cpp's pre-tokenizers by name (``tokenizer.ggml.pre``), both ways: a name -> the splits llama.cpp applies
(:func:`pre_tokenizer`, for a file read), and a byte-level BPE's split -> its name (:func:`pre_tokenizer_name`,
for a file written).

Names (``tokenizer.ggml.pre`` -> llama.cpp's split): ``gpt-2`` and its aliases (GPT-2's regex); ``smollm`` /
``starcoder`` / ``refact`` / ``command-r`` / ``codeshell`` / ``exaone`` / ``minerva-7b`` (each digit alone, then
GPT-2's); ``llama-bpe`` / ``llama3`` / ... (Llama 3's, with its merges skipped for a word that is a token);
``qwen2`` / ``deepseek-r1-qwen`` / ``stablelm2`` (Qwen2's); ``gpt-4o`` / ``llama4``; ``default``. The regular
expressions are llama.cpp's, applied one after the other, then GGUF's bytes-as-characters alphabet.

A split recognised by name when written: decoderlab's own and GPT-2's is ``gpt-2``; a tokenizer read from a GGUF
file has the very splits :func:`pre_tokenizer` builds for its name; a Hugging Face ``tokenizer.json`` of SmolLM
(digits, then GPT-2's: ``smollm``), Llama 3 (``llama-bpe``) or Qwen2 (``qwen2``) as those models write it.

Source: llama.cpp's ``llama-vocab.cpp`` (``llm_tokenizer_bpe``: the name -> regex table; ``llama_vocab::impl::
load``: the names) and ``convert_hf_to_gguf.py`` (``get_vocab_base_pre``: which model writes which name).
"""

from __future__ import annotations

import json

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTION = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTION +
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTION +
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

#: llama.cpp's pre-tokenizer of each ``tokenizer.ggml.pre`` name: (its regexes, in order; ignore_merges)
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    **{n: ((GPT2_SPLIT,), False) for n in ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
                                           "jina-v2-de", "a.x-4.0", "mellum", "mpt", "olmo", "jais", "trillion",
                                           "granite-docling")},
    **{n: ((r"\p{N}", GPT2_SPLIT), False) for n in ("smollm", "starcoder", "refact", "command-r", "codeshell",
                                                    "exaone", "minerva-7b")},
    **{n: ((_LLAMA3,), True) for n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                                       "midm-2.0", "lfm2")},
    **{n: ((_LLAMA3,), False) for n in ("dbrx", "smaug-bpe")},
    **{n: ((_QWEN2,), False) for n in ("qwen2", "deepseek-r1-qwen", "kormo", "stablelm2", "hunyuan")},
    **{n: ((_GPT4O,), False) for n in ("gpt-4o", "llama4", "minimax-m2")},
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"), False),
}

#: the pre-tokenizers of the models' own tokenizer.json files (Hugging Face's spellings), by llama.cpp's name
HF_SPLITS = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
}


def pre_tokenizer(name: str):
    """The ``tokenizers`` pre-tokenizer of llama.cpp's ``name`` (a key of :data:`PRE_TOKENIZERS`): its regexes,
    each an isolated split, then the byte-level alphabet (GPT-2's split alone: ``ByteLevel``'s own regex)."""
    from tokenizers import Regex, pre_tokenizers

    regexes, _ = PRE_TOKENIZERS[name]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regexes == (GPT2_SPLIT,))
    if regexes == (GPT2_SPLIT,):
        return byte_level
    return pre_tokenizers.Sequence([*(pre_tokenizers.Split(Regex(r), "isolated") for r in regexes), byte_level])


def _plain(spec) -> object:
    """A pre-tokenizer's JSON without the fields that do not change the split (offsets, the prefix flag left
    at its default)."""
    if isinstance(spec, dict):
        return {k: _plain(v) for k, v in spec.items() if k not in ("trim_offsets",)}
    if isinstance(spec, list):
        return [_plain(v) for v in spec]
    return spec


def _candidates() -> dict[str, list]:
    """Pre-tokenizer JSON -> llama.cpp's name: :func:`pre_tokenizer` of every name, and the Hugging Face forms."""
    from tokenizers import Regex, pre_tokenizers

    out: dict[str, list] = {name: [_plain(json.loads(pre_tokenizer(name).__getstate__()))]
                            for name in PRE_TOKENIZERS}
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    smollm = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                      pre_tokenizers.ByteLevel(add_prefix_space=False)])
    out["smollm"].append(_plain(json.loads(smollm.__getstate__())))
    for name, regex in HF_SPLITS.items():
        seq = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), "isolated"), byte_level])
        out[name].append(_plain(json.loads(seq.__getstate__())))
    return out


def pre_tokenizer_name(tokenizer) -> str | None:
    """llama.cpp's name (``tokenizer.ggml.pre``) of a byte-level BPE ``tokenizer``'s split, None when it has
    none of theirs (a normalizer, another regex, a prefix space)."""
    spec = tokenizer.to_dict()
    if spec.get("normalizer") is not None:
        return None
    pre = _plain(spec.get("pre_tokenizer"))
    if isinstance(pre, dict) and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and \
            not pre.get("add_prefix_space", False):
        return "gpt-2"
    for name, forms in _candidates().items():
        if pre in forms:
            return name
    return None
