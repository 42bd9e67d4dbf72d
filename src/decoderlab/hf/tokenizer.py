"""The tokenizer of a Hugging Face directory, read and written: ``tokenizer.json`` with ``tokenizer_config.json``
(its special tokens, ``add_bos_token`` / ``add_eos_token``), or GPT-2's ``vocab.json`` + ``merges.txt``. The
Jinja ``chat_template`` is written here and read by :func:`decoderlab.chat.read_chat_template`.

Reading gives a :class:`~decoderlab.tokenizers.BPETokenizer` over the file's own pipeline (Hugging Face
``tokenizers`` runs it: byte-level BPE, SentencePiece's BPE with byte fallback, ...), with the names of the
config, so that ``tok.with_special_tokens(tok.encode(text, allow_special=True))`` are ``AutoTokenizer``'s ids.
Whether a text starts with the start token follows transformers 5: ``add_bos_token`` / ``add_eos_token`` when
tokenizer_config.json says (or tokenizer.json has no post-processor), else the post-processor's template. A
vocabulary smaller than the model's embedding (Qwen's 151,665 tokens for 151,936 rows) is padded with special
``[PAD{id}]`` tokens, as llama.cpp's converter does; a larger one is refused.

Writing gives every decoderlab tokenizer a ``tokenizer.json`` that ``AutoTokenizer`` reads with the same ids: a
BPE as it is (and GPT-2's ``vocab.json`` / ``merges.txt`` for a byte-level one), a character vocabulary as a BPE
without merges (each character its own token), a word vocabulary as a word-level model split on whitespace --
which the reader recognises and gives back as decoderlab's own kind.

Source: Hugging Face ``tokenizers`` (the tokenizer.json format), transformers 5's ``TokenizersBackend``
(special tokens, ``update_post_processor``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..tokenizers import EOS, PAD, UNK, BPETokenizer, CharTokenizer, Tokenizer, WordTokenizer

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GPT2_FILES = ("vocab.json", "merges.txt")
#: every tokenizer file a Hugging Face directory may hold (what the writer writes, and may replace)
TOKENIZER_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, CHAT_TEMPLATE_FILE, *GPT2_FILES)
_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


def _json(path: Path, text: str | None = None) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8") if text is None else text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(data).__name__}")
    return data


def _content(token) -> str | None:
    """A special token of tokenizer_config.json: a string, or an ``AddedToken``'s dict ({"content": ...})."""
    return token.get("content") if isinstance(token, dict) else token


def read_tokenizer(directory: str | os.PathLike, num_tokens: int) -> Tokenizer:
    """The tokenizer of a Hugging Face directory for a model of ``num_tokens`` embedding rows (module docstring).

    Raises:
        FileNotFoundError: neither tokenizer.json nor vocab.json + merges.txt (naming what is missing).
        ValueError: a file that cannot be read (named); a vocabulary larger than the embedding (naming the
            file, its size and num_tokens); a special token of tokenizer_config.json not in the vocabulary.
    """
    directory = Path(directory)
    path = directory / TOKENIZER_JSON
    config = _json(directory / TOKENIZER_CONFIG) if (directory / TOKENIZER_CONFIG).is_file() else {}
    if path.is_file():
        text = path.read_text(encoding="utf-8")
        data = _json(path, text)
        own = _own_kind(data)
        tok = own if own is not None else _from_hf(text, data, config, path)
    elif all((directory / f).is_file() for f in GPT2_FILES):
        path = directory / GPT2_FILES[0]
        tok = BPETokenizer.from_gpt2_files(*(directory / f for f in GPT2_FILES))
    else:
        missing = " and ".join(f for f in GPT2_FILES if not (directory / f).is_file())
        raise FileNotFoundError(
            f"{directory} has weights but no tokenizer: it needs {TOKENIZER_JSON}, or vocab.json and merges.txt "
            f"({missing} missing). Copy the tokenizer files of the model next to its weights, or load the weights "
            f"alone in Python with decoderlab.hf.from_hf({str(directory)!r}) and a tokenizer of your own")
    if tok.vocab_size > num_tokens:
        raise ValueError(f"{path}: the tokenizer has {tok.vocab_size} tokens, more than the model's embedding has "
                         f"rows (vocab_size {num_tokens} in config.json); allowed: at most {num_tokens} tokens")
    if tok.vocab_size < num_tokens:  # the embedding's spare rows, as llama.cpp's converter names them
        tok = tok.add_special_tokens([f"[PAD{i}]" for i in range(tok.vocab_size, num_tokens)])
    return tok


def _from_hf(text: str, data: dict, config: dict, path: Path) -> BPETokenizer:
    """A ``BPETokenizer`` of a Hugging Face tokenizer.json (its ``text``, and ``data`` parsed) and its
    tokenizer_config.json's names."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    try:
        hf = HFTokenizer.from_str(text)
    except Exception as e:  # tokenizers raises its own Exception type for malformed files
        raise ValueError(f"{path}: not a valid Hugging Face tokenizer.json ({e})") from None
    extra = config.get("added_tokens_decoder") or {}
    new = [AddedToken(t["content"], special=bool(t.get("special", True)), normalized=bool(t.get("normalized", False)),
                      lstrip=bool(t.get("lstrip", False)), rstrip=bool(t.get("rstrip", False)))
           for _, t in sorted(extra.items(), key=lambda kv: int(kv[0])) if isinstance(t, dict)
           and hf.token_to_id(t.get("content")) is None]
    if new:  # listed in tokenizer_config.json only: transformers adds them too
        hf.add_tokens(new)
    vocab = _Vocabulary(hf)
    named = {k: _content(config.get(k)) for k in _NAMES if _content(config.get(k)) is not None}
    for key, token in named.items():
        if token not in vocab:
            raise ValueError(f"{path.parent / TOKENIZER_CONFIG}: {key} {token!r} is not in the vocabulary of "
                             f"{path.name}; allowed: one of its tokens")
    explicit = "add_bos_token" in config or "add_eos_token" in config or data.get("post_processor") is None
    if explicit:
        named.update(add_bos_token=bool(config.get("add_bos_token")), add_eos_token=bool(config.get("add_eos_token")))
    else:
        named.update(_template_specials(data.get("post_processor"), named))
    if named == _own_names(vocab):  # decoderlab's own BPE, as the writer wrote it
        named = {}
    return BPETokenizer(hf, named)


class _Vocabulary:
    """``token in vocab`` of a ``tokenizers.Tokenizer`` without building its whole vocabulary dict."""

    def __init__(self, hf):
        self.hf = hf

    def __contains__(self, token) -> bool:
        return isinstance(token, str) and self.hf.token_to_id(token) is not None


def _template_specials(post: dict, named: dict) -> dict:
    """add_bos_token / add_eos_token (and the tokens, when the config names none) read from a post-processor's
    template for one text (``TemplateProcessing``, alone or in a ``Sequence``): its special tokens before and
    after the text."""
    steps = post.get("processors", []) if post.get("type") == "Sequence" else [post]
    for step in steps:
        if step.get("type") != "TemplateProcessing":
            continue
        single = step.get("single") or []
        at = next((k for k, p in enumerate(single) if "Sequence" in p), None)
        if at is None:
            continue
        before = [p["SpecialToken"]["id"] for p in single[:at] if "SpecialToken" in p]
        after = [p["SpecialToken"]["id"] for p in single[at + 1:] if "SpecialToken" in p]
        out = {"add_bos_token": bool(before), "add_eos_token": bool(after)}
        if before:
            out["bos_token"] = named.get("bos_token", before[0])
        if after:
            out["eos_token"] = named.get("eos_token", after[-1])
        return out
    return {"add_bos_token": False, "add_eos_token": False}


# ----------------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------------


def hf_tokenizer_json(tokenizer: Tokenizer) -> str:
    """``tokenizer`` as a Hugging Face ``tokenizer.json`` (module docstring: a character vocabulary as a BPE
    without merges, a word vocabulary as a word-level model). A BPE that puts a start (end) token around a text
    but has no post-processor to say so -- a GGUF file's SentencePiece vocabulary with ``add_bos_token``, Gemma's
    and Llama 2's -- gets one (a ``TemplateProcessing``): transformers 5 reads no ``add_bos_token`` of a
    ``PreTrainedTokenizerFast``, its post-processor puts the tokens there."""
    if isinstance(tokenizer, BPETokenizer):
        return _with_template(tokenizer)
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {tokenizer.id_to_token[i]: i for i in range(tokenizer.vocab_size)}
    unk = UNK if UNK in vocab else None
    if isinstance(tokenizer, CharTokenizer):
        hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token=unk))
        hf.decoder = decoders.Fuse()
    elif isinstance(tokenizer, WordTokenizer):
        hf = HFTokenizer(models.WordLevel(vocab=vocab, unk_token=unk or UNK))
        hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    else:
        raise ValueError(f"a {tokenizer.kind} tokenizer has no Hugging Face form; allowed: bpe, char, word")
    specials = [t for t in (PAD, EOS, UNK, *tokenizer.added_special_tokens) if t in vocab]
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return hf.to_str()


def _with_template(tokenizer: BPETokenizer) -> str:
    """The BPE's ``tokenizer.json``, with a post-processor putting its start / end tokens around a text where it
    adds them and has none (:func:`hf_tokenizer_json`)."""
    text = tokenizer.hf_json()
    hf = tokenizer.hf_tokenizer
    bos = tokenizer.bos_id if tokenizer.add_bos_token else None
    eos = tokenizer.eos_id if tokenizer.add_eos_token else None
    if hf.post_processor is not None or (bos is None and eos is None):
        return text
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    ends = [(tokenizer.id_to_token[i], i) for i in (bos, eos) if i is not None]
    first = f"{tokenizer.id_to_token[bos]} " if bos is not None else ""
    last = f" {tokenizer.id_to_token[eos]}" if eos is not None else ""
    out = HFTokenizer.from_str(text)
    out.post_processor = processors.TemplateProcessing(single=f"{first}$A{last}",
                                                       pair=f"{first}$A{last} {first}$B{last}",
                                                       special_tokens=list(dict(ends).items()))
    return out.to_str()


def _own_kind(data: dict) -> Tokenizer | None:
    """decoderlab's char or word tokenizer, when ``data`` is what :func:`hf_tokenizer_json` wrote for one."""
    model, pre = data.get("model") or {}, data.get("pre_tokenizer") or {}
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or sorted(vocab.values()) != list(range(len(vocab))):
        return None
    tokens = sorted(vocab, key=vocab.get)
    specials = [a["content"] for a in data.get("added_tokens") or [] if a.get("special")]
    added = [t for t in specials if t not in (PAD, EOS, UNK)]
    if (model.get("type") == "BPE" and not model.get("merges") and data.get("pre_tokenizer") is None
            and (data.get("decoder") or {}).get("type") == "Fuse" and tokens[:2] == [PAD, EOS]):
        return CharTokenizer.from_dict({"decoderlab_tokenizer": "char", "vocab": tokens, "special_tokens": added})
    if model.get("type") == "WordLevel" and pre.get("type") == "WhitespaceSplit":
        return WordTokenizer.from_dict({"decoderlab_tokenizer": "word", "vocab": tokens, "special_tokens": added})
    return None


def special_tokens_of(tokenizer: Tokenizer) -> dict:
    """tokenizer_config.json's names for ``tokenizer``: a Hugging Face tokenizer's own; for decoderlab's, its
    ``<EOS>`` as the end (and start) of text and ``<PAD>`` as padding, nothing added around a text."""
    named = dict(getattr(tokenizer, "special_tokens", {}) or {})
    return named or _own_names(tokenizer.token_to_id)


def _own_names(vocab) -> dict:
    """The names decoderlab's own tokenizers go by in tokenizer_config.json, for a vocabulary (token -> id): the
    end of text (``<EOS>``, or GPT-2's ``<|endoftext|>``) also as the start, ``<PAD>``, ``<unk>``."""
    out: dict = {"add_bos_token": False, "add_eos_token": False}
    eos = EOS if EOS in vocab else "<|endoftext|>" if "<|endoftext|>" in vocab else None
    if eos is not None:
        out.update(bos_token=eos, eos_token=eos)
    if PAD in vocab:
        out["pad_token"] = PAD
    if UNK in vocab:
        out["unk_token"] = UNK
    return out


def special_ids_of(tokenizer: Tokenizer | None) -> dict:
    """config.json's ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of ``tokenizer`` (None where it has
    none, so no class default stands in), for ``generate`` to stop at the end token."""
    if tokenizer is None:
        return dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    named = special_tokens_of(tokenizer)
    ids = tokenizer.token_to_id
    return {f"{k}_token_id": ids.get(named.get(f"{k}_token")) for k in ("bos", "eos", "pad")}


def write_tokenizer(directory: Path, tokenizer: Tokenizer, max_len: int, chat_template: str | None = None) -> None:
    """``tokenizer``'s files in ``directory``: ``tokenizer.json`` (:func:`hf_tokenizer_json`), GPT-2's
    ``vocab.json`` + ``merges.txt`` for a byte-level BPE, and the ``tokenizer_config.json`` and
    ``special_tokens_map.json`` that tell ``AutoTokenizer`` its special tokens, with the Jinja ``chat_template``
    when given. A base model's own (char, BPE) tokenizer keeps a special token typed in a text as text
    (``split_special_tokens``), as its ``encode`` does; with a chat template special tokens are parsed (the
    template's text holds them: ``apply_chat_template`` must read them), as ``encode(text, allow_special=True)``
    does."""
    (directory / TOKENIZER_JSON).write_text(hf_tokenizer_json(tokenizer), encoding="utf-8")
    if isinstance(tokenizer, BPETokenizer) and tokenizer.byte_level:
        tokenizer.save_gpt2_files(directory)
    named = special_tokens_of(tokenizer)
    own = not getattr(tokenizer, "special_tokens", None)
    split = own and tokenizer.kind != "word" and chat_template is None
    config = dict(tokenizer_class="PreTrainedTokenizerFast", model_max_length=max_len, split_special_tokens=split,
                  clean_up_tokenization_spaces=False, **named)
    if chat_template is not None:
        config["chat_template"] = chat_template
    tokens = {k: v for k, v in named.items() if k in _NAMES}
    for name, data in ((TOKENIZER_CONFIG, config), (SPECIAL_TOKENS_MAP, tokens)):
        (directory / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
