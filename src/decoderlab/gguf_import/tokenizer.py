"""A GGUF file's tokenizer (``tokenizer.ggml.*``) rebuilt as a Hugging Face ``tokenizers`` byte-level BPE: the
vocabulary, the merges in order, and the pre-tokenizer llama.cpp names in ``tokenizer.ggml.pre`` -- the same
regular expressions llama.cpp splits text with, applied one after the other, then GGUF's bytes-as-characters
alphabet. Control tokens (type 3) are special tokens, user-defined ones (type 4) tokens matched whole.

Pre-tokenizers (``tokenizer.ggml.pre`` -> llama.cpp's split): ``gpt-2`` and its aliases (GPT-2's regex);
``smollm`` / ``starcoder`` / ``refact`` / ``command-r`` / ``codeshell`` / ``exaone`` / ``minerva-7b`` (each
digit alone, then GPT-2's); ``llama-bpe`` / ``llama3`` / ... (Llama 3's, with its merges skipped for a word
that is a token); ``qwen2`` / ``deepseek-r1-qwen`` / ``stablelm2`` (Qwen2's); ``gpt-4o`` / ``llama4``;
``default``. Another name is refused in one line.

SentencePiece vocabularies (``tokenizer.ggml.model`` ``llama``: Llama 2, TinyLlama, Mistral's files -- pieces with
scores, ``<0x0A>``-style byte tokens, no merges) become a BPE whose merges are the vocabulary's pairs ranked by
the score of the piece they make (as SentencePiece's BPE merges, and as ``transformers`` rebuilds them), with
byte fallback, spaces as ``▁`` and one ``▁`` before the text (``tokenizer.ggml.add_space_prefix``, default on).
WordPiece (``bert``) and Unigram (``t5``) vocabularies are refused.

Source: llama.cpp's ``llama-vocab.cpp`` (``llm_tokenizer_bpe``: the name -> regex table) and
``convert_hf_to_gguf.py`` (what the keys hold).
"""

from __future__ import annotations

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
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4


def check_tokenizer(meta: dict, path="") -> None:
    """Raise ``ValueError`` (one line) for a tokenizer this module does not rebuild: no vocabulary, a model
    other than byte-level BPE (``gpt2``), a pre-tokenizer name not in :data:`PRE_TOKENIZERS`, no merges."""
    model = meta.get("tokenizer.ggml.model")
    if not meta.get("tokenizer.ggml.tokens"):
        raise ValueError(f"{path}: the GGUF file has no tokenizer (tokenizer.ggml.tokens); decoderlab needs the "
                         "vocabulary to read and write text")
    if model == "llama":
        if not meta.get("tokenizer.ggml.scores"):
            raise ValueError(f"{path}: the SentencePiece vocabulary has no scores (tokenizer.ggml.scores) to rank "
                             "its merges by")
        return
    if model != "gpt2":
        kind = {"bert": "a WordPiece vocabulary", "t5": "a Unigram vocabulary"}.get(model, f"tokenizer model {model!r}")
        raise ValueError(f"{path}: tokenizer.ggml.model {model!r} is {kind}; decoderlab rebuilds byte-level BPE "
                         "('gpt2') and SentencePiece BPE ('llama') vocabularies only")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{path}: tokenizer.ggml.pre {pre!r} is not a pre-tokenizer decoderlab rebuilds; allowed: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))}")
    if not meta.get("tokenizer.ggml.merges"):
        raise ValueError(f"{path}: the byte-level BPE tokenizer has no merges (tokenizer.ggml.merges)")


def hf_tokenizer(meta: dict, path=""):
    """The ``tokenizers.Tokenizer`` of a checked file (:func:`check_tokenizer`): BPE with the file's vocabulary
    and merges, its pre-tokenizer's splits then byte-level bytes, the byte-level decoder (a SentencePiece
    vocabulary: :func:`sentencepiece_tokenizer`); control tokens added as special tokens, user-defined ones as
    whole tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    if meta.get("tokenizer.ggml.model") == "llama":
        return _added(sentencepiece_tokenizer(meta, path), meta, unknown_special=True)

    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{path}: tokenizer.ggml.tokens names a token twice")
    merges = []
    for m in meta["tokenizer.ggml.merges"]:
        cut = m.find(" ", 1)  # as llama.cpp splits a merge: at the first space after its first character
        if cut < 0:
            raise ValueError(f"{path}: tokenizer.ggml.merges holds {m!r}, not two tokens joined by a space")
        merges.append((m[:cut], m[cut + 1:]))
    regexes, ignore_merges = PRE_TOKENIZERS[meta.get("tokenizer.ggml.pre", "default")]
    try:
        tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    except Exception as e:  # tokenizers' own exception type: a merge of tokens not in the vocabulary
        raise ValueError(f"{path}: the tokenizer's merges do not fit its vocabulary: {e}") from None
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regexes == (GPT2_SPLIT,))
    splits = [] if regexes == (GPT2_SPLIT,) else [pre_tokenizers.Split(Regex(r), "isolated") for r in regexes]
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level]) if splits else byte_level
    tok.decoder = decoders.ByteLevel()
    return _added(tok, meta)


def _added(tok, meta: dict, unknown_special: bool = False):
    """Control tokens (and the unknown token, for SentencePiece) as special tokens, user-defined ones as tokens
    matched whole."""
    from tokenizers import AddedToken

    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    special = (_CONTROL, _UNKNOWN) if unknown_special else (_CONTROL,)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
                    if k == _USER_DEFINED])
    return tok


def score_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """A SentencePiece vocabulary's merges: every split of a piece into two pieces of the vocabulary, ranked by
    the score of the piece they make (higher first; then the longer left part; a piece's splits in the order
    of their parts' ids) -- the order SentencePiece's BPE merges in, and transformers' ``generate_merges``."""
    found = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        found += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def sentencepiece_tokenizer(meta: dict, path=""):
    """A SentencePiece BPE vocabulary (``tokenizer.ggml.model`` ``llama``) as a ``tokenizers.Tokenizer``: BPE
    with :func:`score_merges`, byte fallback (``<0x0A>``) and fused unknowns; ``▁`` for spaces and one before
    the text when ``tokenizer.ggml.add_space_prefix`` (default true), the decoder undoing both -- Llama 2's own
    ``tokenizer.json``, and llama.cpp's tokenizer (transformers' GGUF loader adds no ``▁`` before a text that
    starts with a space)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{path}: tokenizer.ggml.tokens names a token twice")
    merges = score_merges(vocab, dict(zip(tokens, meta["tokenizer.ggml.scores"])))
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # a space before the text, always (as SentencePiece's add_dummy_prefix and llama.cpp: " hi" is "▁▁hi"), not
    # Metaspace's "first" scheme, which adds none to a text that starts with a space
    spaces = [normalizers.Prepend("\u2581")] if prefix else []
    tok.normalizer = normalizers.Sequence([*spaces, normalizers.Replace(" ", "\u2581")])
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def special_ids(meta: dict) -> dict[str, int]:
    """The file's control ids that exist in its vocabulary: bos, eos, eot (end of turn), eom, pad, unk."""
    n = len(meta["tokenizer.ggml.tokens"])
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "eot": "eot_token_id", "eom": "eom_token_id",
            "pad": "padding_token_id", "unk": "unknown_token_id"}
    out = {}
    for ours, key in keys.items():
        value = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n:
            out[ours] = value
    return out
