"""Tokenizers: fixed special ids, exact round trips, save/load for every kind, clear errors."""

import json
import random

import numpy as np
import pytest

from decoderlab.data import read_corpus
from decoderlab.tokenizers import (
    EOS, PAD, TOKENIZERS, UNK, BPETokenizer, CharTokenizer, Tokenizer, WordTokenizer, _bytes_to_unicode,
    build_tokenizer,
)

HAND_PICKED = [
    "",
    "hello world",
    "  two leading spaces and a trailing one ",
    "line one\nline two\n\n\n  indented\tTab\r\nwindows line",
    "emoji 😀🎉👩‍👩‍👧 and flags 🇫🇷",
    "CJK 漢字かなカナ 한국어",
    "combining e\u0301 vs precomposed \u00e9, a\u0308\u0301",
    "zero\u200bwidth, nbsp\u00a0, bidi \u202eabc\u202c, BOM \ufeff",
    "\x00\x01\x7f control bytes",
    "<EOS> <PAD> <unk> <|endoftext|> look like specials",
    "Ωmega ∑ ∞ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0010fffd",
]


def random_unicode(rng: random.Random, n: int) -> str:
    """n random code points from all planes, skipping surrogates (not encodable in UTF-8)."""
    out = []
    while len(out) < n:
        cp = rng.choice([rng.randrange(0x20, 0x80), rng.randrange(0x80, 0x800), rng.randrange(0x800, 0x10000),
                         rng.randrange(0x10000, 0x110000), rng.choice([0x0A, 0x20, 0x09])])
        if not 0xD800 <= cp <= 0xDFFF:
            out.append(chr(cp))
    return "".join(out)


@pytest.fixture(scope="module")
def shakespeare() -> str:
    return read_corpus(None)


@pytest.fixture(scope="module")
def bpe(shakespeare) -> BPETokenizer:
    return BPETokenizer.train([shakespeare[:60_000]], vocab_size=400)


# -- char ---------------------------------------------------------------------------------------------------------

def test_char_vocabulary_of_tinyshakespeare(shakespeare):
    tok = CharTokenizer.from_text(shakespeare)
    assert tok.vocab_size == 67
    assert (tok.pad_id, tok.eos_id, tok.unk_id) == (0, 1, None)
    assert [tok.id_to_token[i] for i in range(2, 67)] == sorted(set(shakespeare))
    ids = tok.encode(shakespeare)
    assert len(ids) == len(shakespeare)
    assert tok.decode(ids) == shakespeare
    assert np.array_equal(tok.encode_array(shakespeare), np.array(ids))
    assert tok.encode("\n !") == [2, 3, 4]  # newline, space, "!" are the first characters in sorted order


def test_char_unknown_character_names_character_and_position():
    tok = CharTokenizer.from_text("abc\nabc")
    with pytest.raises(ValueError) as e:
        tok.encode("ab\ncaXb")
    msg = str(e.value)
    assert "'X'" in msg and "U+0058" in msg and "position 5" in msg and "line 2, column 3" in msg
    assert "unk=True" in msg
    with pytest.raises(ValueError, match=r"'é' \(U\+00E9\) at position 0"):
        tok.encode("é")
    with pytest.raises(ValueError, match=r"'X' \(U\+0058\) at position 5 \(line 2, column 3\)"):
        tok.encode_array("ab\ncaXb")
    with pytest.raises(ValueError, match=r"'😀' \(U\+1F600\) at position 1"):
        tok.encode_array("a😀")
    with pytest.raises(TypeError, match="str"):
        tok.encode(["a"])


def test_char_unk_maps_unknown_characters():
    tok = CharTokenizer.from_text("banana", unk=True)
    assert [tok.id_to_token[i] for i in range(tok.vocab_size)] == [PAD, EOS, "a", "b", "n", UNK]
    assert tok.unk_id == 5
    assert tok.encode("bandana!") == [3, 2, 4, 5, 2, 4, 2, 5]
    assert tok.encode_array("bandana!😀\U0010ffff").tolist() == [3, 2, 4, 5, 2, 4, 2, 5, 5, 5]
    assert tok.decode(tok.encode("nab")) == "nab"


def test_char_specials_are_text_unless_allowed():
    tok = CharTokenizer.from_text("<EOS><PAD>ab")
    plain = tok.encode("a<EOS>")
    assert len(plain) == 6 and tok.eos_id not in plain and tok.decode(plain) == "a<EOS>"
    special = tok.encode("a<EOS>b<PAD>", allow_special=True)
    assert special == [tok.token_to_id["a"], 1, tok.token_to_id["b"], 0]
    assert tok.decode(special) == "a<EOS>b<PAD>"
    assert tok.decode(special, skip_special=True) == "ab"
    with pytest.raises(ValueError, match="position 7"):  # positions count the whole text, specials included
        CharTokenizer.from_text("ab").encode("a<EOS>bz", allow_special=True)


def test_char_bad_inputs():
    with pytest.raises(ValueError, match="non-empty"):
        CharTokenizer.from_text("")
    with pytest.raises(ValueError, match="1-character"):
        CharTokenizer(["ab"])
    with pytest.raises(ValueError, match="out of range"):
        CharTokenizer.from_text("ab").decode([4])


# -- word ---------------------------------------------------------------------------------------------------------

def test_word_tokenizer_keeps_the_lessons_ids():
    tok = WordTokenizer(["what", "is", "statquest", "awesome", "is"])
    assert tok.token_to_id == {"what": 0, "is": 1, "statquest": 2, "awesome": 3, EOS: 4}
    assert WordTokenizer(["a", EOS, "b"], pad=True).token_to_id == {"a": 0, EOS: 1, "b": 2, PAD: 3}


def test_build_word_tokenizer():
    tok = build_tokenizer("word", "the cat sat\non the mat")
    assert [tok.id_to_token[i] for i in range(tok.vocab_size)] == \
        ["the", "cat", "sat", "on", "mat", EOS, PAD, UNK]
    assert tok.encode("the dog sat") == [0, 7, 2]
    assert tok.decode([0, 1, 5]) == "the cat <EOS>"


# -- bpe ----------------------------------------------------------------------------------------------------------

def test_bpe_special_ids_and_size(bpe):
    assert (bpe.pad_id, bpe.eos_id) == (0, 1)
    assert bpe.id_to_token[0] == PAD and bpe.id_to_token[1] == EOS
    assert bpe.vocab_size == 400
    # the 256 byte tokens follow the specials; every token's bytes are distinct
    assert sorted(bpe.token_bytes(i) for i in range(2, 258)) == [bytes([b]) for b in range(256)]
    assert len({bpe.token_bytes(i) for i in range(2, bpe.vocab_size)}) == bpe.vocab_size - 2
    assert bpe.token_bytes(1) == b"<EOS>"


def test_bytes_to_unicode_is_the_hf_alphabet():
    from tokenizers.pre_tokenizers import ByteLevel

    table = _bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert set(table.values()) == set(ByteLevel.alphabet())
    assert table[ord("A")] == "A" and table[ord(" ")] == "\u0120" and table[ord("\n")] == "\u010a"


@pytest.mark.parametrize("text", HAND_PICKED)
def test_bpe_round_trips_hand_picked_text(bpe, text):
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert b"".join(bpe.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert bpe.eos_id not in ids and bpe.pad_id not in ids  # literal "<EOS>" is text by default


def test_bpe_round_trips_random_unicode(bpe):
    rng = random.Random(1234)
    for n in (1, 2, 7, 50, 400):
        for _ in range(5):
            text = random_unicode(rng, n)
            ids = bpe.encode(text)
            assert bpe.decode(ids) == text, repr(text)
            assert b"".join(bpe.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_bpe_compresses_the_training_text(bpe, shakespeare):
    text = shakespeare[:60_000]
    # learned merges: fewer tokens than UTF-8 bytes on text like the training text
    assert len(bpe.encode(text)) < 0.6 * len(text.encode("utf-8"))


def test_bpe_allow_special(bpe):
    ids = bpe.encode("hi<EOS>there<PAD>", allow_special=True)
    assert ids.count(1) == 1 and ids[-1] == 0
    assert ids[:ids.index(1)] == bpe.encode("hi")
    assert bpe.decode(ids) == "hi<EOS>there<PAD>"
    assert bpe.decode(ids, skip_special=True) == "hithere"
    assert bpe.tokens(bpe.encode(" the")) == [" the"]


def test_bpe_chunked_encoding_equals_whole(bpe, shakespeare):
    text = shakespeare[:40_000] + "\n\n  x\n y \n\nz" + HAND_PICKED[3] * 3 + shakespeare[-20_000:]
    whole = bpe.encode(text)
    for chunk in (500, 4_000):
        assert bpe.encode_array(text, chunk_chars=chunk).tolist() == whole


def one_call(bpe, text):
    return bpe.hf_tokenizer.encode(text, add_special_tokens=False).ids


def test_bpe_chunks_any_text_and_gives_the_ids_of_one_call(bpe, shakespeare):
    """BPE corpus chunking: CRLF, CR and no line ends at all are cut too (they were encoded in one call: +1.4 GB of
    peak memory for 8 MB of CRLF text), and every cut keeps the ids of one call -- on every kind of
    boundary (forced small pieces: a cut is tried after every few characters)."""
    import random

    base = shakespeare[:6_000]
    rng = random.Random(0)
    pool = list("ab Z'sltdmrve0129\n\r\t\x0b\x0c\x1c\x85\xa0\u2028\u3000.,;!?-_()'\"") + [
        "й", "Ж", "ё", "漢", "字", "か", "。", "，", "\u0301", "\u0308", "٣", "²", "Ⅻ", "一", "😀", "\u200d", "🇫",
        "\ufeff", "\u0378", "\U000e0001", "  ", "\r\n", "'ll", "'S", " 12", "x\u0301y"]
    texts = {
        "CRLF": base.replace("\n", "\r\n"),
        "CR": base.replace("\n", "\r"),
        "no line end": base.replace("\n", " "),
        "no space either": "".join(base.split()),
        "hand-picked": "".join(HAND_PICKED) * 3,
        "soup": "".join(rng.choice(pool) for _ in range(4_000)),
        "Cyrillic and CJK": "Съешь же ещё этих мягких булок, да выпей чаю.\r\n漢字かなカナ、한국어。123٣²" * 40,
    }
    for name, text in texts.items():
        whole = one_call(bpe, text)
        for chunk in (1, 3, 7, 64):
            pieces = list(bpe.encode_chunks(text, chunk_chars=chunk))
            assert np.concatenate(pieces).tolist() == whole, (name, chunk)
            if name != "no space either":
                assert len(pieces) > len(text) // (4 * chunk + 64), (name, chunk)  # really cut
        assert bpe.encode_array(text, chunk_chars=5).tolist() == whole
        assert bpe.encode_array(text, chunk_chars=5).dtype == np.int64


def test_bpe_chunks_bounded_without_line_ends(bpe):
    """No newline in 300,000 characters: pieces of about chunk_chars, not one call on the whole."""
    text = ("word, and 12 more words; " * 12_000)
    sizes = [len(bpe.decode(p.tolist())) for p in bpe.encode_chunks(text, chunk_chars=10_000)]
    assert len(sizes) == 30 and max(sizes) < 10_010
    with pytest.raises(ValueError, match="chunk_chars must be an integer >= 1, got 0"):
        next(bpe.encode_chunks("abc", chunk_chars=0))


def test_bpe_vocab_size_too_small():
    with pytest.raises(ValueError, match=r"vocab_size 258 .* minimum is 259"):
        BPETokenizer.train(["some text"], vocab_size=258)
    with pytest.raises(ValueError, match="vocab_size 10 "):
        build_tokenizer("bpe", "some text", vocab_size=10)
    with pytest.raises(TypeError, match="int"):
        BPETokenizer.train(["some text"], vocab_size="512")


# -- build_tokenizer, save / load -----------------------------------------------------------------------------------

def test_build_tokenizer_bad_inputs():
    with pytest.raises(ValueError, match=r"'sentencepiece'.*char, word, bpe|'sentencepiece'.*word, char, bpe"):
        build_tokenizer("sentencepiece", "abc")
    with pytest.raises(ValueError, match="only applies to the bpe"):
        build_tokenizer("char", "abc", vocab_size=300)
    with pytest.raises(ValueError, match="empty"):
        build_tokenizer("char", " \n")
    with pytest.raises(TypeError, match="str"):
        build_tokenizer("char", b"abc")


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
@pytest.mark.parametrize("as_dir", [False, True])
def test_save_load_round_trip(tmp_path, shakespeare, kind, as_dir):
    text = shakespeare[:20_000]
    tok = build_tokenizer(kind, text, vocab_size=300 if kind == "bpe" else None)
    where = tmp_path if as_dir else tmp_path / "tok.json"
    path = tok.save(where)
    assert path.name == ("tokenizer.json" if as_dir else "tok.json")
    loaded = Tokenizer.load(where)
    assert type(loaded) is type(tok)
    assert loaded.to_dict() == tok.to_dict()
    assert (loaded.vocab_size, loaded.eos_id, loaded.pad_id) == (tok.vocab_size, tok.eos_id, tok.pad_id)
    sample = shakespeare[30_000:31_000]
    if kind == "word":
        sample = " ".join(w for w in sample.split())
    assert loaded.encode(sample) == tok.encode(sample)
    assert loaded.decode(tok.encode(sample)) == tok.decode(tok.encode(sample))


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_eos_ids_end_a_text_and_are_saved_with_every_kind(tmp_path, shakespeare, kind):
    """A model's own end ids (Hugging Face's eos_token_id list) join end_of_text_ids -- an ordinary token too --
    and survive save / load and add_special_tokens; an id outside the vocabulary is refused by name."""
    tok = build_tokenizer(kind, shakespeare[:20_000], vocab_size=300 if kind == "bpe" else None)
    plain = tok.end_of_text_ids
    word = tok.encode("the")[0]
    assert word not in plain and tok.eos_ids == ()
    ends = tok.with_eos_ids([word, tok.eos_id, word])
    assert ends.eos_ids == (word, tok.eos_id) and tok.eos_ids == ()  # a copy; each id once, in order
    assert ends.end_of_text_ids == (tok.eos_id, *sorted(set(plain[1:]) | {word}))
    loaded = Tokenizer.load(ends.save(tmp_path / "tok.json"))
    assert loaded.eos_ids == ends.eos_ids and loaded.end_of_text_ids == ends.end_of_text_ids
    assert Tokenizer.load(tok.save(tmp_path / "plain.json")).to_dict() == tok.to_dict()  # no key without them
    assert ends.add_special_tokens(["<|user|>"]).eos_ids == ends.eos_ids
    with pytest.raises(ValueError, match=f"token id {tok.vocab_size} is out of range"):
        tok.with_eos_ids([tok.vocab_size])


def test_saved_bpe_is_a_plain_hf_file(tmp_path, bpe):
    from tokenizers import Tokenizer as HFTokenizer

    path = bpe.save(tmp_path / "tokenizer.json")
    hf = HFTokenizer.from_file(str(path))
    hf.encode_special_tokens = True
    text = "O Romeo, Romeo! wherefore art thou Romeo? 😀"
    assert hf.encode(text).ids == bpe.encode(text)


def test_load_bare_hf_tokenizer_json(tmp_path, shakespeare):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator([shakespeare[:20_000]], trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.load(tmp_path)
    assert isinstance(tok, BPETokenizer)
    assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (0, None, 300)
    text = "To be, or not to be 🎭 漢字"
    assert tok.encode(text) == hf.encode(text).ids
    assert tok.decode(tok.encode(text)) == text


def test_load_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Tokenizer.load(tmp_path / "nowhere.json")
    (tmp_path / "odd.json").write_text(json.dumps({"decoderlab_tokenizer": "morse"}))
    with pytest.raises(ValueError, match="'morse'"):
        Tokenizer.load(tmp_path / "odd.json")
    (tmp_path / "badchar.json").write_text(json.dumps({"decoderlab_tokenizer": "char", "vocab": ["a", "b"]}))
    with pytest.raises(ValueError, match="not a CharTokenizer vocabulary"):
        Tokenizer.load(tmp_path / "badchar.json")
    (tmp_path / "badhf.json").write_text(json.dumps({"model": {"type": "Nonsense"}}))
    with pytest.raises(ValueError, match="not a valid Hugging Face tokenizer.json"):
        Tokenizer.load(tmp_path / "badhf.json")


def test_bpe_smaller_than_asked_says_so_with_both_numbers():
    with pytest.warns(UserWarning) as record:
        tok = BPETokenizer.train("abab abab abab", 5000)
    assert str(record[0].message) == (f"the BPE vocabulary has {tok.vocab_size} tokens, fewer than the vocab_size 5000 "
                                      "asked for: the text offers no more merges (a larger corpus would)")


def test_bpe_gpt2_files_round_trip(tmp_path, bpe):
    """vocab.json + merges.txt (GPT-2's tokenizer files) hold the same byte-level BPE."""
    names = sorted(p.name for p in bpe.save_gpt2_files(tmp_path))
    assert names == ["merges.txt", "vocab.json"]
    back = BPETokenizer.from_gpt2_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    text = "To be, or not to be \u00e9\U0001F600\n\n  x"
    assert back.encode(text) == bpe.encode(text) and back.decode(back.encode(text)) == text
    assert (back.vocab_size, back.eos_id, back.pad_id) == (bpe.vocab_size, bpe.eos_id, bpe.pad_id)
    assert back.byte_level


def test_every_tokenizer_refuses_invalid_unicode_the_same_way():
    """"ab\\udcffcd": a lone surrogate, as Python makes from the byte 0xff in a command-line argument."""
    from decoderlab.tokenizers import BPETokenizer, CharTokenizer, WordTokenizer, build_tokenizer

    bad = "ab\udcffcd"
    want = (r"text is not valid Unicode: U\+DCFF at position 2 is a lone surrogate, Python's stand-in for the "
            r"byte 0xff")
    bpe = BPETokenizer.train(["abcd abcd ab cd"], 262)
    calls = [bpe.encode, lambda t: bpe.encode(t, allow_special=True), bpe.encode_array,
             lambda t: bpe.encode_array("x" * 50 + t, chunk_chars=8),
             CharTokenizer.from_text("abcd").encode, CharTokenizer.from_text("abcd", unk=True).encode,
             CharTokenizer.from_text("abcd", unk=True).encode_array,
             WordTokenizer(["ab", "cd"], unk=True).encode]
    for encode in calls:
        with pytest.raises(ValueError, match=want.replace("position 2", "position (2|52)")):
            encode(bad)
    for kind in ("char", "word", "bpe"):
        with pytest.raises(ValueError, match="the corpus is not valid Unicode: U\\+DCFF at position 2"):
            build_tokenizer(kind, bad)
    with pytest.raises(ValueError, match="training text 1 is not valid Unicode: U\\+D800 at position 0"):
        BPETokenizer.train(["ok", "\ud800"], 262)
    # control tokens are named, and left out of text by decode(skip_special=True), by every kind
    char, words = CharTokenizer.from_text("abcd", unk=True), WordTokenizer(["ab"], pad=True, unk=True)
    assert char.special_ids == {0, 1, char.unk_id} and words.special_ids == {1, 2, 3} and bpe.special_ids == {0, 1}
    for tok in (char, words, bpe):
        assert tok.decode([tok.eos_id, *tok.encode("ab"), tok.pad_id], skip_special=True) == "ab"


@pytest.mark.parametrize("kind", ["char", "word", "bpe"])
def test_added_special_tokens_are_control_tokens_and_unicode_is_still_checked(kind):
    """Chat tokens added with add_special_tokens are in special_ids (never text), typed look-alikes stay text,
    and a lone surrogate is refused as before (the invalid-Unicode check survives the added tokens)."""
    from decoderlab.tokenizers import BPETokenizer, CharTokenizer, WordTokenizer

    text = "hi <|user|> there"
    base = {"char": lambda: CharTokenizer.from_text(text), "word": lambda: WordTokenizer(["hi", "there"], unk=True),
            "bpe": lambda: BPETokenizer.train([text * 5], 262)}[kind]()
    tok = base.add_special_tokens(["<|user|>", "<|end|>"])
    user, end = tok.token_to_id["<|user|>"], tok.token_to_id["<|end|>"]
    assert (user, end) == (base.vocab_size, base.vocab_size + 1)
    assert {user, end} <= tok.special_ids and base.special_ids <= tok.special_ids
    hi = tok.encode("hi")
    assert tok.decode(hi + [user, end], skip_special=True) == tok.decode(hi)
    typed = tok.encode(text, allow_special=False)
    assert user not in typed and end not in typed  # the text "<|user|>" is not the token
    with pytest.raises(ValueError, match=r"U\+DCFF at position 2 is a lone surrogate"):
        tok.encode("ab\udcffcd")


def test_encode_with_special_tokens_adds_nothing_for_decoderlab_s_own_tokenizers():
    from decoderlab.tokenizers import encode_with_special_tokens

    text = "to be or not to be"
    for tok in (CharTokenizer.from_text(text), WordTokenizer.from_texts([text]), BPETokenizer.train([text] * 5, 262)):
        assert (tok.bos_id, tok.add_bos_token, tok.add_eos_token) == (None, False, False)
        assert encode_with_special_tokens(tok, text) == tok.encode(text) and tok.encode(text)

    class Bytes:  # a duck-typed tokenizer (encode and decode only): its ids as they are
        def encode(self, text):
            return list(text.encode("utf-8"))

        def decode(self, ids):
            return bytes(ids).decode("utf-8")

    assert encode_with_special_tokens(Bytes(), "é!") == [0xC3, 0xA9, 0x21]


def test_encode_with_special_tokens_puts_the_start_token_first_with_add_bos_token():
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from decoderlab.tokenizers import encode_with_special_tokens

    hf = HFTokenizer.from_str(BPETokenizer.train(["to be or not to be"] * 5, 262).hf_tokenizer.to_str())
    hf.add_special_tokens([AddedToken("<s>", special=True, normalized=False)])
    bos = hf.token_to_id("<s>")
    for add_bos, want in ((True, [bos]), (False, [])):
        tok = BPETokenizer(HFTokenizer.from_str(hf.to_str()), {"bos_token": "<s>", "add_bos_token": add_bos})
        assert encode_with_special_tokens(tok, "to be") == want + tok.encode("to be")
        assert encode_with_special_tokens(tok, "") == want
        # typed: the token, as transformers' tokenizer(text), vLLM and llama.cpp read a prompt; a message's
        # content (encode's default) keeps it text
        assert encode_with_special_tokens(tok, "<s>to be") == want + [bos] + tok.encode("to be")
        assert bos not in tok.encode("<s>")
