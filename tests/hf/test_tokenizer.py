"""The tokenizer of a Hugging Face directory (decoderlab.hf.tokenizer): ids equal to AutoTokenizer's on 200 strings
(unicode, digits, spaces, special tokens) for tokenizers built here the way each family's are (GPT-2's, Qwen2's
byte-level BPE, Llama's SentencePiece BPE with byte fallback and a start token, Llama 3's template
post-processor), and every decoderlab tokenizer written so that AutoTokenizer reads it with our ids.

Nothing is downloaded: each tokenizer is trained here on a few lines and saved with transformers' own classes.
"""

import json

import pytest

transformers = pytest.importorskip("transformers")

import decoderlab as dl  # noqa: E402
from decoderlab.hf import read_tokenizer  # noqa: E402
from decoderlab.hf.tokenizer import write_tokenizer  # noqa: E402
from decoderlab.tokenizers import (BPETokenizer, CharTokenizer, WordTokenizer,  # noqa: E402
                                   encode_with_special_tokens)

from .families import CORPUS, gpt2_tokenizer, llama3_tokenizer, llama_tokenizer, qwen2_tokenizer, strings  # noqa: E402

FAMILIES = {"gpt2": gpt2_tokenizer, "qwen2": qwen2_tokenizer, "llama": llama_tokenizer, "llama3": llama3_tokenizer}


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_equal_auto_tokenizer_on_200_strings(tmp_path, family):
    FAMILIES[family]().save_pretrained(tmp_path)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = read_tokenizer(tmp_path, len(auto))
    assert ours.vocab_size == len(auto)
    specials = [t for t in auto.all_special_tokens if t]
    texts = strings(specials)
    assert len(texts) == 200 and sum(any(s in t for s in specials) for t in texts) > 30
    for text in texts:
        want = auto(text)["input_ids"]
        assert ours.with_special_tokens(ours.encode(text, allow_special=True)) == want, (family, text)
        plain = auto(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        assert ours.encode(text) == plain, (family, text)  # a special token typed as text stays text
        # a prompt: its start token, and typed special tokens those tokens -- as AutoTokenizer(text) reads it
        assert encode_with_special_tokens(ours, text) == want, (family, text)
        assert ours.decode(ours.encode(text)) == auto.decode(plain), (family, text)
    assert (ours.bos_id, ours.eos_id, ours.add_bos_token) == (
        auto.bos_token_id, auto.eos_token_id, family in ("llama", "llama3"))


def test_byte_fallback_tokens_stream_as_their_bytes(tmp_path):
    llama_tokenizer().save_pretrained(tmp_path)
    tok = read_tokenizer(tmp_path, 10_000)
    ids = tok.encode("to be 😀")
    assert b"".join(tok.token_bytes(i) for i in ids) == " to be 😀".encode()  # the word start is a space
    assert tok.decode(ids) == "to be 😀"


def test_a_smaller_vocabulary_is_padded_to_the_embedding_and_a_larger_one_refused(tmp_path):
    qwen2_tokenizer().save_pretrained(tmp_path)
    n = len(transformers.AutoTokenizer.from_pretrained(tmp_path))
    tok = read_tokenizer(tmp_path, n + 3)
    assert tok.vocab_size == n + 3 and tok.tokens([n, n + 2]) == [f"[PAD{n}]", f"[PAD{n + 2}]"]
    assert {n, n + 1, n + 2} <= tok.special_ids
    with pytest.raises(ValueError, match=rf"tokenizer\.json: the tokenizer has {n} tokens, more than the model's "
                                         rf"embedding has rows \(vocab_size {n - 1} in config.json\); allowed: at "
                                         rf"most {n - 1} tokens"):
        read_tokenizer(tmp_path, n - 1)


def test_a_special_token_outside_the_vocabulary_is_named(tmp_path):
    gpt2_tokenizer().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|nowhere|>"}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: eos_token '<\|nowhere\|>' is not in the vocabulary"):
        read_tokenizer(tmp_path, 10_000)


@pytest.mark.parametrize("template", [None, "{{ messages }}"])
@pytest.mark.parametrize("kind", ["char", "word", "bpe"])
def test_every_decoderlab_tokenizer_is_written_for_auto_tokenizer_and_read_back(tmp_path, kind, template):
    """Without a chat template a special token typed in a text stays text, as decoderlab's ``encode`` keeps it;
    with one it is parsed (the template's text holds them), as ``encode(text, allow_special=True)`` does."""
    samples = [line for line in CORPUS[:3]] + ["to be <EOS> or not", "the question <|user|> whether"]
    text = "\n".join(CORPUS[:3]) + " <|EOS>"  # the characters of the special tokens' text too
    tok = {"char": lambda: CharTokenizer.from_text(text), "word": lambda: WordTokenizer.from_texts([text], unk=True),
           "bpe": lambda: BPETokenizer.train(CORPUS, 350)}[kind]()
    tok = tok.add_special_tokens(["<|user|>", "<|end|>"])
    write_tokenizer(tmp_path, tok, 64, chat_template=template)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert len(auto) == tok.vocab_size and (auto.eos_token_id, auto.pad_token_id) == (tok.eos_id, tok.pad_id)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()).get("chat_template") == template
    for sample in samples:
        parsed = template is not None or kind == "word"  # a word vocabulary's specials are words (the lesson's)
        assert auto(sample)["input_ids"] == tok.encode(sample, allow_special=parsed), (kind, sample)
        assert auto.decode(tok.encode(sample)) == tok.decode(tok.encode(sample)), (kind, sample)
    back = read_tokenizer(tmp_path, tok.vocab_size)
    assert back.kind == kind and back.to_dict() == tok.to_dict()


def test_read_back_through_the_one_loader(tmp_path):
    """A BPE of a Hugging Face model keeps its names through a decoderlab checkpoint (saved and loaded)."""
    llama_tokenizer().save_pretrained(tmp_path / "hf")
    tok = read_tokenizer(tmp_path / "hf", 10_000)
    tok.save(tmp_path / "tokenizer.json")
    back = dl.Tokenizer.load(tmp_path / "tokenizer.json")
    assert (back.bos_id, back.eos_id, back.add_bos_token) == (tok.bos_id, tok.eos_id, True)
    assert back.with_special_tokens(back.encode("to be")) == tok.with_special_tokens(tok.encode("to be"))
