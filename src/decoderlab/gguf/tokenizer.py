"""A GGUF file's tokenizer (``tokenizer.ggml.*``) in both directions: read as a Hugging Face ``tokenizers``
tokenizer with llama.cpp's special ids and flags, and a decoderlab tokenizer written in the form llama.cpp reads.

In: a byte-level BPE (``tokenizer.ggml.model`` ``gpt2``): the vocabulary, the merges in order and the
pre-tokenizer llama.cpp names in ``tokenizer.ggml.pre`` (:mod:`.pretokenizers`), then GGUF's bytes-as-characters
alphabet. A SentencePiece vocabulary (``llama``: Llama 2, TinyLlama, Mistral's files -- pieces with scores,
``<0x0A>``-style byte tokens, no merges) becomes a BPE whose merges are the vocabulary's pairs ranked by the score
of the piece they make (as SentencePiece's BPE merges, and as ``transformers`` rebuilds them), with byte fallback,
spaces as ``▁`` and one ``▁`` before the text (``tokenizer.ggml.add_space_prefix``, default on). WordPiece
(``bert``) and Unigram (``t5``) vocabularies are refused. Control tokens (type 3) are special tokens,
user-defined ones (type 4) tokens matched whole.

The special ids (bos, eos, unk, ...) and whether a text gets bos first and eos last (``add_bos_token`` /
``add_eos_token``) are what llama.cpp's vocabulary loader makes of the file: a key the file states, else
llama.cpp's default for its kind of vocabulary (:data:`VOCAB_DEFAULTS`: a SentencePiece file starts a text with
``<s>`` = 1 and ends at ``</s>`` = 2 without saying so; a Llama 3 BPE file starts with its bos).

Out (:func:`write_tokenizer`): byte-level BPE (``model = "gpt2"``) with the pre-tokenizer llama.cpp names, every
token's text in the byte-level alphabet, the merges in order, control tokens typed CONTROL and added ordinary
tokens USER_DEFINED, every id and flag stated (no default relied on). A SentencePiece-style BPE (byte fallback,
spaces as ``▁``: Gemma's, Llama 2's) is written as llama.cpp's SentencePiece vocabulary (``model = "llama"``):
the pieces as they are, a score per piece from the rank of the merge that makes it (earlier merges score
higher, so the merges read back rank as they did), ``<0xNN>`` typed BYTE, ``add_space_prefix`` from its
normalizer. A character vocabulary becomes one token per
character and merges that join the UTF-8 bytes of each multi-byte character (so "é" is one token, as in
decoderlab; a character outside the vocabulary is lost in llama.cpp, where decoderlab raises or gives ``<unk>``);
a word vocabulary has no form llama.cpp reads: refused. Control ids written: ``eos`` (``tokenizer.eos_id``),
``bos`` (its ``bos_id``, else the eos as GPT-2 has it), ``pad``, and ``eot``: the chat template's end of turn.

Source: llama.cpp's ``llama-vocab.cpp`` (``llama_vocab::impl::load``: the keys and their defaults;
``tokenize``: bos and eos around a text) and ``convert_hf_to_gguf.py`` (``get_vocab_base``: what the keys hold).
"""

from __future__ import annotations

import json
import re

from .pretokenizers import PRE_TOKENIZERS, pre_tokenizer, pre_tokenizer_name

_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")

#: llama.cpp's defaults where a file states no key, as its vocabulary loader sets them (``llama_vocab::impl::load``
#: in llama.cpp's src/llama-vocab.cpp): by ``tokenizer.ggml.model`` the special ids and the flags (SentencePiece's
#: ``<unk>`` <s> </s> = 0 1 2; byte-level BPE's 11, Falcon's, for both bos and eos), then, for byte-level BPE, the
#: ``tokenizer.ggml.pre`` names whose texts start with bos ("gpt2/<pre>"). A default id outside the vocabulary is
#: no id (llama.cpp: "out of vocab range, disabling"); a key outside it leaves the default ("bad special token").
VOCAB_DEFAULTS: dict[str, dict] = {
    "llama": {"bos": 1, "eos": 2, "unk": 0, "add_bos": True, "add_eos": False},
    "gpt2": {"bos": 11, "eos": 11, "add_bos": False, "add_eos": False},
    **{f"gpt2/{pre}": {"add_bos": True} for pre in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                                                    "pixtral", "midm-2.0", "lfm2", "jina-v5-nano", "tekken",
                                                    "chameleon")},
}
#: our role -> the ``tokenizer.ggml.<key>`` of its id
ID_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "eot": "eot_token_id", "eom": "eom_token_id",
           "pad": "padding_token_id", "unk": "unknown_token_id"}


# -- in -----------------------------------------------------------------------------------------------------------


def vocab_defaults(meta: dict) -> dict:
    """:data:`VOCAB_DEFAULTS` for the file's ``tokenizer.ggml.model`` and ``tokenizer.ggml.pre`` (empty for a model
    llama.cpp gives none)."""
    model = meta.get("tokenizer.ggml.model")
    return {**VOCAB_DEFAULTS.get(model, {}), **VOCAB_DEFAULTS.get(f"{model}/{meta.get('tokenizer.ggml.pre')}", {})}


def special_ids(meta: dict) -> dict[str, int]:
    """The file's control ids by role (bos, eos, eot, eom, pad, unk), as llama.cpp reads them: a stated id inside
    the vocabulary, else llama.cpp's default for the vocabulary (:data:`VOCAB_DEFAULTS`) when inside it; a role
    with neither is absent."""
    n = len(meta["tokenizer.ggml.tokens"])
    defaults = vocab_defaults(meta)
    out = {}
    for role, key in ID_KEYS.items():
        value = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n:
            out[role] = value
        elif defaults.get(role) is not None and 0 <= defaults[role] < n:
            out[role] = defaults[role]
    return out


def special_flags(meta: dict) -> dict[str, bool]:
    """``{"add_bos": ..., "add_eos": ...}``: whether llama.cpp puts bos before a text and eos after it
    (``tokenizer.ggml.add_bos_token`` / ``add_eos_token``, else :data:`VOCAB_DEFAULTS`)."""
    defaults = vocab_defaults(meta)
    return {flag: bool(meta.get(f"tokenizer.ggml.{flag}_token", defaults.get(flag, False)))
            for flag in ("add_bos", "add_eos")}


def check_tokenizer(meta: dict, path="") -> None:
    """Raise ``ValueError`` (one line) for a tokenizer this module does not rebuild: no vocabulary, a model
    other than byte-level BPE (``gpt2``) or SentencePiece (``llama``), a pre-tokenizer name not in
    :data:`~.pretokenizers.PRE_TOKENIZERS`, no merges (no scores) -- or one llama.cpp refuses: a text to start
    (end) with bos (eos) and no such token."""
    model = meta.get("tokenizer.ggml.model")
    if not meta.get("tokenizer.ggml.tokens"):
        raise ValueError(f"{path}: the GGUF file has no tokenizer (tokenizer.ggml.tokens); decoderlab needs the "
                         "vocabulary to read and write text")
    if model == "llama" and not meta.get("tokenizer.ggml.scores"):
        raise ValueError(f"{path}: the SentencePiece vocabulary has no scores (tokenizer.ggml.scores) to rank "
                         "its merges by")
    if model not in ("gpt2", "llama"):
        kind = {"bert": "a WordPiece vocabulary", "t5": "a Unigram vocabulary"}.get(model, f"tokenizer model {model!r}")
        raise ValueError(f"{path}: tokenizer.ggml.model {model!r} is {kind}; decoderlab rebuilds byte-level BPE "
                         "('gpt2') and SentencePiece BPE ('llama') vocabularies only")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if model == "gpt2" and pre not in PRE_TOKENIZERS:
        raise ValueError(f"{path}: tokenizer.ggml.pre {pre!r} is not a pre-tokenizer decoderlab rebuilds; allowed: "
                         f"{', '.join(sorted(PRE_TOKENIZERS))}")
    if model == "gpt2" and not meta.get("tokenizer.ggml.merges"):
        raise ValueError(f"{path}: the byte-level BPE tokenizer has no merges (tokenizer.ggml.merges)")
    ids = special_ids(meta)
    for flag, on in special_flags(meta).items():
        role = flag.removeprefix("add_")
        if on and role not in ids:
            stated = f"tokenizer.ggml.{flag}_token" in meta
            raise ValueError(f"{path}: tokenizer.ggml.{flag}_token is true{'' if stated else ' (by default)'} but "
                             f"the file names no {role} token (tokenizer.ggml.{ID_KEYS[role]} absent or outside its "
                             f"{len(meta['tokenizer.ggml.tokens'])} tokens), as llama.cpp refuses too")


def hf_tokenizer(meta: dict, path="", merges=None):
    """The ``tokenizers.Tokenizer`` of a checked file (:func:`check_tokenizer`): BPE with the file's vocabulary
    and merges, its pre-tokenizer's splits then byte-level bytes, the byte-level decoder (a SentencePiece
    vocabulary: :func:`sentencepiece_tokenizer`); control tokens added as special tokens, user-defined ones as
    whole tokens. ``merges``: a SentencePiece vocabulary's merges when already derived (:func:`score_merges`)."""
    from tokenizers import Tokenizer, decoders, models

    if meta.get("tokenizer.ggml.model") == "llama":
        return _added(sentencepiece_tokenizer(meta, path, merges), meta, unknown_special=True)
    vocab = _vocabulary(meta, path)
    merges = []
    for m in meta["tokenizer.ggml.merges"]:
        cut = m.find(" ", 1)  # as llama.cpp splits a merge: at the first space after its first character
        if cut < 0:
            raise ValueError(f"{path}: tokenizer.ggml.merges holds {m!r}, not two tokens joined by a space")
        merges.append((m[:cut], m[cut + 1:]))
    name = meta.get("tokenizer.ggml.pre", "default")
    try:
        tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=PRE_TOKENIZERS[name][1]))
    except Exception as e:  # tokenizers' own exception type: a merge of tokens not in the vocabulary
        raise ValueError(f"{path}: the tokenizer's merges do not fit its vocabulary: {e}") from None
    tok.pre_tokenizer = pre_tokenizer(name)
    tok.decoder = decoders.ByteLevel()
    return _added(tok, meta)


def _vocabulary(meta: dict, path) -> dict[str, int]:
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{path}: tokenizer.ggml.tokens names a token twice")
    return vocab


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
    # ids instead of strings and no key function per piece: Gemma 3's 262,144 pieces, 1.9 -> 1.5 CPU-s
    get, pieces, found = vocab.get, {i: t for t, i in vocab.items()}, []
    for piece, score in scores.items():
        local = []
        for i in range(1, len(piece)):
            a = get(piece[:i])
            b = None if a is None else get(piece[i:])
            if b is not None:
                local.append((a, b, i))
        local.sort()
        found += [(score, i, len(piece) - i, a, b) for a, b, i in local]
    found.sort(key=lambda m: m[:3], reverse=True)  # stable: a piece's splits keep their id order
    return [(pieces[a], pieces[b]) for _, _, _, a, b in found]


def sentencepiece_tokenizer(meta: dict, path="", merges=None):
    """A SentencePiece BPE vocabulary (``tokenizer.ggml.model`` ``llama``) as a ``tokenizers.Tokenizer``: BPE
    with :func:`score_merges`, byte fallback (``<0x0A>``) and fused unknowns; ``▁`` for spaces and one before
    the text when ``tokenizer.ggml.add_space_prefix`` (default true), the decoder undoing both -- Llama 2's own
    ``tokenizer.json``, and llama.cpp's tokenizer (transformers' GGUF loader adds no ``▁`` before a text that
    starts with a space)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = _vocabulary(meta, path)
    if merges is None:
        merges = score_merges(vocab, dict(zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"])))
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # a space before the text, always (as SentencePiece's add_dummy_prefix and llama.cpp: " hi" is "▁▁hi"), not
    # Metaspace's "first" scheme, which adds none to a text that starts with a space
    spaces = [normalizers.Prepend("\u2581")] if prefix else []
    tok.normalizer = normalizers.Sequence([*spaces, normalizers.Replace(" ", "\u2581")])
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


# -- out ----------------------------------------------------------------------------------------------------------


def token_pieces(tokenizer) -> tuple[str, list[str], list[int], list[str]]:
    """``(pre, tokens, token types, merges)`` of ``tokenizer`` in llama.cpp's byte-level BPE form.

    Raises:
        ValueError: a word vocabulary; a BPE whose split llama.cpp has no name for (it would tokenize text
            otherwise) or that is not byte-level.
    """
    import gguf

    from ..tokenizers import byte_level_text

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
    from ..tokenizers import byte_level_text

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


def sentencepiece_spec(tokenizer) -> dict | None:
    """The ``tokenizer.json`` of a SentencePiece-style BPE (byte fallback, a normalizer writing spaces as ``▁``:
    Gemma's, Llama 2's), else None."""
    if getattr(tokenizer, "kind", None) != "bpe" or tokenizer.byte_level:
        return None
    spec = tokenizer.to_dict()
    model = spec.get("model") or {}
    norm = json.dumps(spec.get("normalizer"), ensure_ascii=False)
    if model.get("type") != "BPE" or not model.get("byte_fallback") or '"content": "▁"' not in norm:
        return None
    return spec


def sentencepiece_pieces(tokenizer, spec: dict) -> tuple[list[str], list[float], list[int], bool]:
    """``(pieces, scores, token types, add_space_prefix)`` of a SentencePiece-style BPE in llama.cpp's form: a
    piece made by merge r scores -(r + 1) (the first merge highest; :func:`score_merges` ranks them back), the
    others 0 (bytes, single characters) or -1000 (control and added tokens, as Gemma's converter writes them)."""
    import gguf

    score: dict[str, float] = {}
    for rank, m in enumerate(spec["model"]["merges"]):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        score.setdefault(a + b, -float(rank + 1))
    special, added = tokenizer.special_ids, _added_tokens(tokenizer)
    unk = tokenizer.token_to_id.get(spec["model"].get("unk_token") or "")
    pieces, scores, types = [], [], []
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.id_to_token[i]
        kind = (gguf.TokenType.UNKNOWN if i == unk else gguf.TokenType.CONTROL if i in special else
                gguf.TokenType.USER_DEFINED if i in added else
                gguf.TokenType.BYTE if _BYTE_PIECE.fullmatch(piece) else gguf.TokenType.NORMAL)
        pieces.append(piece)
        types.append(int(kind))
        scores.append(-1000.0 if kind in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED,
                                          gguf.TokenType.UNKNOWN) else score.get(piece, 0.0))
    prefix = '"Prepend"' in json.dumps(spec.get("normalizer"))
    return pieces, scores, types, prefix


def write_tokenizer(writer, tokenizer, end_of_turn: int | None = None, chat_template: str | None = None) -> None:
    """``tokenizer.ggml.*`` (and ``tokenizer.chat_template``) of ``tokenizer`` into a ``gguf.GGUFWriter``:
    every id and both flags stated, so that llama.cpp applies none of its defaults; ``end_of_turn``: the chat
    template's end-of-turn id (``tokenizer.ggml.eot_token_id`` where it is not the eos)."""
    spec = sentencepiece_spec(tokenizer)
    if spec is not None:
        tokens, scores, types, prefix = sentencepiece_pieces(tokenizer, spec)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_add_space_prefix(prefix)
        unk = next((i for i, t in enumerate(types) if t == 2), None)
        if unk is not None:
            writer.add_unk_token_id(unk)
    else:
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
    if end_of_turn is not None and end_of_turn != eos:
        writer.add_eot_token_id(end_of_turn)
    writer.add_add_bos_token(bool(getattr(tokenizer, "add_bos_token", False)))
    writer.add_add_eos_token(bool(getattr(tokenizer, "add_eos_token", False)))
    if chat_template:
        writer.add_chat_template(chat_template)
