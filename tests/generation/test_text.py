"""Text out of the engine: pieces that never split a character (byte-level and BPE), stream_text equal to
decode(generate), its checks at the call, and ChatSession's token history."""

import pytest
import torch
from tiny_models import TEXT, ByteTokenizer, make_model, one_thread, pieces_of  # noqa: F401 -- one_thread: autouse

import decoderlab as dl
from decoderlab.cli import chat_command
from decoderlab.generation import ChatSession, SamplingParams, generate, stream_text
from decoderlab.tokenizers import BPETokenizer


def test_text_streamer_never_splits_a_character_byte_level():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    pieces = pieces_of(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert "😀" in pieces and "日" in pieces  # four and three bytes held until complete
    # a character that never completes is written as decode writes it
    cut = tok.encode("ab日")[:-1]
    assert "".join(pieces_of(tok, cut)) == tok.decode(cut) == "ab\ufffd"


def test_text_streamer_with_bpe_tokens_that_split_characters():
    tok = BPETokenizer.train([TEXT * 30], 320)
    ids = tok.encode(TEXT * 2)
    assert tok.decode(ids) == TEXT * 2
    splits = [i for i in ids if tok.decode([i]).endswith("\ufffd") or tok.decode([i]).startswith("\ufffd")]
    assert splits, "the test needs BPE tokens that end or start inside a character"
    pieces = pieces_of(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    # forced sequences: single bytes of a 4-byte character, then continuing text
    emoji = [i for i in range(tok.vocab_size) if tok.token_bytes(i) in (b"\xf0", b"\x9f", b"\x98", b"\x80")]
    forced = tok.encode("a") + sorted(emoji, key=lambda i: b"\xf0\x9f\x98\x80".index(tok.token_bytes(i))) \
        + tok.encode("日本")
    pieces = pieces_of(tok, forced)
    assert "".join(pieces) == tok.decode(forced) == "a😀日本"
    assert "😀" in pieces


def test_stream_text_equals_decode_of_generate():
    tok = BPETokenizer.train([TEXT * 30], 320)
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=16,
                                                n_layer=1, n_head=2, max_len=16))
    ids = generate(model, "日本", 60, seed=2, tokenizer=tok)
    pieces = list(stream_text(model, "日本", tok, 60, seed=2))
    assert "".join(pieces) == tok.decode(ids)
    words = dl.lesson_tokenizer()
    m = make_model("statquest", "explicit")
    ids = generate(m, [0, 1], 8, seed=1)
    assert "".join(stream_text(m, [0, 1], words, 8, seed=1)) == words.decode(ids)  # separators kept


def test_stream_text_takes_the_tokenizer_after_the_prompt_and_says_so():
    """The tokenizer comes after the prompt, as in every public function; the old order (model, tokenizer,
    prompt), kept for a while behind a DeprecationWarning, is a TypeError showing the call to write."""
    words = dl.lesson_tokenizer()
    m = make_model("statquest", "explicit")
    new = "".join(stream_text(m, "what is", words, 6, seed=4))
    with pytest.raises(TypeError, match=r"stream_text\(model, prompt, tokenizer, ...\)"):
        stream_text(m, words, "what is", 6, seed=4)
    assert new == "".join(stream_text(m, prompt="what is", tokenizer=words, params=6, seed=4))
    assert new == words.decode(generate(m, "what is", 6, seed=4, tokenizer=words), skip_special=True)


def test_stream_text_never_writes_what_becomes_a_stop(newline_bpe):
    tok, model, ids = newline_bpe
    for stop in ("\n\n", "a\n\n", "\n\n\n"):
        pieces = list(stream_text(model, "p", tok, 8, temperature=0, stop=stop))
        text = "a\n\n\n\n\n\n\n\n"
        assert "".join(pieces) == text[: text.index(stop)]


def test_stream_text_checks_its_arguments_at_the_call():
    model = make_model("statquest", "explicit")
    words = dl.lesson_tokenizer()
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0, got -1"):
        stream_text(model, "what", words, -1)  # not iterated
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        stream_text(model, "what", words, 3, top_p=2)
    with pytest.raises(KeyError, match="unknown word"):
        stream_text(model, "hello", words, 3)


def test_chat_session_continues_the_conversation(statquest_checkpoint):
    """A language model's session continues its token history (the lesson's word tokenizer reads a typed <EOS>
    as the token); the lesson's own chat renders its template (TemplateChatSession, tests/chat/)."""
    model, tok = dl.load_checkpoint(statquest_checkpoint)
    chat = ChatSession(model, tok, temperature=0, max_new_tokens=model.config.max_len)
    assert "".join(chat.reply("what is statquest <EOS>")) == "awesome"
    assert tok.decode(chat.history) == "what is statquest <EOS> awesome <EOS>"
    # the next turn continues the history (the model sees its last max_len tokens)
    prompt = chat.history + tok.encode("statquest <EOS>")
    want = generate(model, prompt, model.config.max_len, temperature=0, stop=tok.eos_id)
    assert "".join(chat.reply("statquest <EOS>")) == tok.decode(want)
    chat_command(chat, "/reset")
    assert chat.history == []


def test_stream_text_refuses_bytes():
    """b"hi" was read as the token ids 104, 105."""
    model = make_model("statquest", "explicit")
    words = dl.lesson_tokenizer()
    with pytest.raises(TypeError, match=r"prompt is bytes \(b'hi'\); pass text \(a str: decode the bytes first\)"):
        stream_text(model, b"hi", words, 3)
    with pytest.raises(TypeError, match="prompt is bytes"):
        stream_text(model, bytearray(b"hi"), words, 3)


def test_chat_session_settings_are_one_sampling_params(statquest_checkpoint):
    from decoderlab.chat import TEMPLATES, TemplateChatSession

    model, tok = dl.load_checkpoint(statquest_checkpoint)
    chat = TemplateChatSession(model, tok, TEMPLATES["lesson"])  # the lesson's: greedy, its replies end in max_len
    assert chat.params == SamplingParams(temperature=0)
    lm = ChatSession(model, tok, seed=5, top_k=3)
    assert lm.params == SamplingParams(seed=5, top_k=3) and lm.turn_params().seed == 5
    lm.turn = 2
    assert lm.turn_params().seed == 7
    with pytest.raises(ValueError, match="top_p must be in"):
        ChatSession(model, tok, top_p=0)
