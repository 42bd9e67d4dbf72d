"""A decoderlab tokenizer in GGUF's form (``tokenizer.ggml.*``), as llama.cpp reads it: byte-level BPE
(``model = "gpt2"``) with the pre-tokenizer llama.cpp names (``pre``), every token's text in the byte-level
alphabet, the merges in order, control tokens typed CONTROL and added ordinary tokens USER_DEFINED.

* a byte-level BPE: its pre-tokenizer recognised by name -- decoderlab's own and GPT-2's split is ``gpt-2``; a
  tokenizer read from a GGUF file has the very splits :mod:`decoderlab.gguf_import.tokenizer` builds for its name;
  a Hugging Face ``tokenizer.json`` of SmolLM (digits, then GPT-2's: ``smollm``), Llama 3 (``llama-bpe``) or
  Qwen2 (``qwen2``) as those models write it. Another split is refused (llama.cpp would tokenize otherwise);
* a character vocabulary: one token per character and merges that join the UTF-8 bytes of each multi-byte
  character (so "é" is one token, as in decoderlab); a character outside the vocabulary is lost in llama.cpp,
  where decoderlab raises (or gives ``<unk>``);
* a word vocabulary has no form llama.cpp reads: refused.

Control ids: ``eos`` (``tokenizer.eos_id``), ``bos`` (its ``bos_id``, else the eos as GPT-2 has it; llama.cpp adds
it only with ``add_bos_token``), ``pad``, and ``eot``: the chat template's end of turn.

Source: llama.cpp's ``convert_hf_to_gguf.py`` (``get_vocab_base``, the pre-tokenizer names) and ``llama-vocab.cpp``.
"""

from __future__ import annotations

import json

from ..tokenizers import byte_level_text

#: the pre-tokenizers of the models' own tokenizer.json files (Hugging Face's spellings), by llama.cpp's name
HF_SPLITS = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
}


def _plain(spec) -> object:
    """A pre-tokenizer's JSON without the fields that do not change the split (offsets, the prefix flag left
    at its default)."""
    if isinstance(spec, dict):
        return {k: _plain(v) for k, v in spec.items() if k not in ("trim_offsets",)}
    if isinstance(spec, list):
        return [_plain(v) for v in spec]
    return spec


def _candidates() -> dict[str, list]:
    """Pre-tokenizer JSON -> llama.cpp's name: gguf_import's build of every name, and the Hugging Face forms."""
    from tokenizers import Regex, pre_tokenizers

    from ..gguf_import.tokenizer import PRE_TOKENIZERS, hf_tokenizer

    out: dict[str, list] = {}
    meta = {"tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"]}
    for name in PRE_TOKENIZERS:
        spec = json.loads(hf_tokenizer({**meta, "tokenizer.ggml.pre": name}).to_str())["pre_tokenizer"]
        out.setdefault(name, []).append(_plain(spec))
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


def token_pieces(tokenizer) -> tuple[str, list[str], list[int], list[str]]:
    """``(pre, tokens, token types, merges)`` of ``tokenizer`` in llama.cpp's byte-level BPE form.

    Raises:
        ValueError: a word vocabulary; a BPE whose split llama.cpp has no name for (it would tokenize text
            otherwise) or that is not byte-level.
    """
    import gguf

    kind = getattr(tokenizer, "kind", type(tokenizer).__name__)
    if kind == "bpe":
        pre = pre_tokenizer_name(tokenizer) if tokenizer.byte_level else None
        if pre is None:
            raise ValueError("GGUF export takes a byte-level BPE whose split llama.cpp names (GPT-2's, decoderlab's "
                             "own; SmolLM's, Llama 3's, Qwen2's); this BPE tokenizer splits text otherwise, which "
                             "llama.cpp would tokenize differently")
        merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer.to_dict()["model"]["merges"]]
    elif kind == "char":
        pre, merges = "gpt-2", _char_merges(tokenizer)
    else:
        raise ValueError(f"GGUF export takes a BPE or character tokenizer; a {kind} vocabulary has no form "
                         "llama.cpp reads (it splits text into bytes and merges, not into whitespace-separated "
                         "words): retrain with --tokenizer char or --tokenizer bpe")
    special = tokenizer.special_ids
    added = _added_tokens(tokenizer)
    tokens, types = [], []
    for i in range(tokenizer.vocab_size):
        if i in special or i in added:
            tokens.append(tokenizer.id_to_token[i])
            types.append(int(gguf.TokenType.CONTROL if i in special else gguf.TokenType.USER_DEFINED))
        else:
            tokens.append(byte_level_text(tokenizer.token_bytes(i)))
            types.append(int(gguf.TokenType.NORMAL))
    return pre, tokens, types, merges


def _added_tokens(tokenizer) -> set[int]:
    """Ids of a BPE's added tokens that are not special (a Hugging Face model's ``<think>``): matched whole."""
    if getattr(tokenizer, "kind", None) != "bpe":
        return set()
    return {a["id"] for a in tokenizer.to_dict().get("added_tokens") or [] if not a.get("special")}


def _char_merges(tokenizer) -> list[str]:
    """Merges that join each multi-byte character's UTF-8 bytes left to right (b1 b2, then b1b2 b3, ...)."""
    merges, seen = [], set()
    for i in range(tokenizer.vocab_size):
        if i in tokenizer.special_ids:
            continue
        data = tokenizer.token_bytes(i)
        for k in range(1, len(data)):
            m = f"{byte_level_text(data[:k])} {byte_level_text(data[k:k + 1])}"
            if m not in seen:
                seen.add(m)
                merges.append(m)
    return merges


def write_tokenizer(writer, tokenizer, template=None, chat_template: str | None = None) -> None:
    """``tokenizer.ggml.*`` (and ``tokenizer.chat_template``) of ``tokenizer`` into a ``gguf.GGUFWriter``; the
    end of turn is ``template``'s (:meth:`end_of_turn_id`)."""
    pre, tokens, types, merges = token_pieces(tokenizer)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    eos, bos = tokenizer.eos_id, getattr(tokenizer, "bos_id", None)
    if eos is not None:
        writer.add_eos_token_id(eos)
    if bos is not None or eos is not None:
        writer.add_bos_token_id(eos if bos is None else bos)
    if tokenizer.pad_id is not None:
        writer.add_pad_token_id(tokenizer.pad_id)
    eot = None if template is None else template.end_of_turn_id(tokenizer)
    if eot is not None and eot != eos:
        writer.add_eot_token_id(eot)
    writer.add_add_bos_token(bool(getattr(tokenizer, "add_bos_token", False)))
    writer.add_add_eos_token(False)
    if chat_template:
        writer.add_chat_template(chat_template)
