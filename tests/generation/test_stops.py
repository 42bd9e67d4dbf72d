"""Stops: token-id stops, stop strings matched on the text however the model spells it (also when a stop
begins inside a token), and control tokens: <PAD> never sampled, the end-of-text tokens end the text."""

import pytest
import torch
from tiny_models import (CHARS, biased_char_model, end_of_turn_model, make_model, one_thread,  # noqa: F401
                         pieces_of)

import decoderlab as dl
from decoderlab.generation import StopMatcher, generate, generate_batch, stream, stream_text
from decoderlab.generation.stops import Stops, TextStopMatcher
from decoderlab.tokenizers import CharTokenizer


def test_stop_matcher_holds_back_prefixes():
    m = StopMatcher([(7, 8, 9), (3,)])
    assert m.push(1) == ([1], None)
    assert m.push(7) == ([], None)
    assert m.push(8) == ([], None)
    assert m.push(7) == ([7, 8], None)  # 7 8 7: "7" may still start 7 8 9
    assert m.push(8) == ([], None)
    assert m.push(9) == ([], (7, 8, 9))
    m = StopMatcher([(7, 8, 9)])
    m.push(7)
    assert m.flush() == [7]


def test_stop_tokens_and_strings():
    text = "abcabcabd ab cd"
    tok = CharTokenizer.from_text(text)
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=16,
                                                n_layer=1, n_head=2, max_len=16)).double()
    # no control tokens in this stream (the model would sample them: it is random)
    kw = dict(seed=9, tokenizer=tok, suppress_tokens=(tok.pad_id, tok.eos_id))
    full = generate(model, tok.encode("ab"), 40, **kw)
    assert len(full) == 40 and min(full) > 1
    # a single stop id: everything before its first occurrence
    t = full[len(full) // 2]
    got = generate(model, tok.encode("ab"), 40, stop=[t], **kw)
    assert got == full[: full.index(t)]
    # a two-token stop sequence (as ids, or as text through the tokenizer)
    j = next(i for i in range(3, len(full) - 1) if min(full[i:i + 2]) > 1)  # no <PAD>/<EOS> in the pair
    pair = tuple(full[j:j + 2])
    first = next(i for i in range(len(full) - 1) if tuple(full[i:i + 2]) == pair)
    assert generate(model, tok.encode("ab"), 40, stop=pair, **kw) == full[:first]
    s = tok.decode(list(pair))
    assert list(stream(model, "ab", 40, stop=s, **kw)) == full[:first]
    assert generate(model, "ab", 40, stop=[s], **kw) == full[:first]
    # the streaming generator returns the stop sequence it matched
    gen = stream(model, "ab", 40, stop=s, **kw)
    with pytest.raises(StopIteration) as end:
        while True:
            next(gen)
    assert end.value.value == pair


def test_stop_strings_the_tokenizer_cannot_encode():
    model = make_model("statquest", "explicit")
    words = dl.lesson_tokenizer()
    with pytest.raises(ValueError, match="stop string 'hello' cannot be encoded by the tokenizer"):
        generate(model, [0], 3, stop="hello", tokenizer=words)
    chars = CharTokenizer.from_text("abc")
    m2 = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", num_tokens=chars.vocab_size, d_model=8,
                                             n_layer=1, n_head=2, max_len=8))
    with pytest.raises(ValueError, match="stop string 'xyz' cannot be encoded"):
        generate(m2, [2], 3, stop=["a", "xyz"], tokenizer=chars)
    with pytest.raises(TypeError, match="needs the tokenizer"):
        generate(model, [0], 3, stop="awesome")
    with pytest.raises(ValueError, match="must not be empty"):
        generate(model, [0], 3, stop="", tokenizer=words)
    with pytest.raises(ValueError, match="stop token id 9 is out of range"):
        generate(model, [0], 3, stop=9)
    assert generate(model, [0], 3, temperature=0, stop="<EOS>", tokenizer=words) == \
        generate(model, [0], 3, temperature=0, stop=words.eos_id)


def test_stop_string_matches_the_text_however_the_model_spells_it(newline_bpe):
    tok, model, ids = newline_bpe
    nl, a = ids["nl"], ids["a"]
    # the reported input: the model writes single "\n" tokens; the stop "\n\n" is one token of the vocabulary
    assert generate(model, "p", 6, temperature=0, tokenizer=tok) == [a] + [nl] * 5  # (no stop: six tokens)
    assert generate(model, "a", 6, temperature=0, stop="\n\n", tokenizer=tok) == []  # was six "\n"
    assert generate(model, "p", 6, temperature=0, stop="\n\n", tokenizer=tok) == [a]
    assert "".join(stream_text(model, "p", tok, 6, temperature=0, stop="\n\n")) == "a"
    assert list(stream(model, "p", 6, temperature=0, stop=["zz", "\n\n"], tokenizer=tok)) == [a]
    gen = stream(model, "p", 6, temperature=0, stop="\n\n", tokenizer=tok)
    assert next(gen) == a
    with pytest.raises(StopIteration) as end:
        next(gen)
    assert end.value.value == (nl, nl)  # the tokens that spelled the stop
    # with and without the cache, and in a batch (rows stop at different places)
    assert generate(model, "p", 6, temperature=0, stop="\n\n", tokenizer=tok, use_cache=False) == [a]
    assert generate_batch(model, ["p", "a", "ab"], 6, temperature=0, stop="\n\n", tokenizer=tok) == \
        [[a], [], [ids["c"]]]
    # token-id stops keep working next to text stops
    assert generate(model, "p", 6, temperature=0, stop=[a], tokenizer=tok) == []
    assert generate(model, "p", 6, temperature=0, stop=(a, nl), tokenizer=tok) == []
    assert generate(model, "p", 6, temperature=0, stop=[(nl, nl), "zz"], tokenizer=tok) == [a]


def test_stop_string_that_begins_inside_a_token(newline_bpe):
    """"ab" then "c": the stop "bc" begins inside the token "ab". The ids end before that token; the text ends
    exactly before the stop."""
    tok, model, ids = newline_bpe
    prompt = [ids["p"], ids["ab"]]  # continues "c", "\n", "\n", ...
    assert generate(model, prompt, 5, temperature=0, tokenizer=tok) == [ids["c"]] + [ids["nl"]] * 4
    assert generate(model, prompt, 5, temperature=0, stop="c\n\n", tokenizer=tok) == []
    assert "".join(stream_text(model, prompt, tok, 5, temperature=0, stop="\n\n")) == "c"
    # a stop that begins in the prompt's last token's text is not looked for in the prompt
    assert "".join(stream_text(model, prompt, tok, 5, temperature=0, stop="bc")) == "c\n\n\n\n"
    # "x" -> "ab", "c": the stop "bc" begins inside the generated token "ab"
    assert generate(model, "x", 5, temperature=0, tokenizer=tok)[:2] == [ids["ab"], ids["c"]]
    assert generate(model, "x", 5, temperature=0, stop="bc", tokenizer=tok) == []
    assert "".join(stream_text(model, "x", tok, 5, temperature=0, stop="bc")) == "a"
    assert "".join(stream_text(model, "x", tok, 5, temperature=0, stop="c\n")) == "ab"
    gen = stream(model, "x", 5, temperature=0, stop="bc", tokenizer=tok)
    with pytest.raises(StopIteration) as end:
        next(gen)
    assert end.value.value == (ids["ab"], ids["c"])
    # the matcher itself: "ab" is held ("b" may start "bc"); "c" completes the stop; the tail is "a"
    stops = Stops((), ["bc"], tok.decode)
    assert stops.push(ids["ab"]) == ([], None)
    assert stops.push(ids["c"]) == ([], (ids["ab"], ids["c"]))
    assert stops.tail == "a"


def test_control_tokens_are_never_sampled_or_written_as_text():
    tok = CharTokenizer.from_text("hello world\n")
    pad, eos = tok.pad_id, tok.eos_id
    model = biased_char_model(tok, {pad: 3.0, eos: -1.0})  # <PAD> is the most probable token
    # without a tokenizer the engine cannot know <PAD> (24 in 2,000 were reported; far fewer than here)
    assert generate(model, [2], 2000, seed=0).count(pad) > 500
    ids = generate(model, [2], 2000, seed=0, tokenizer=tok, stop_at_eos=False)
    assert len(ids) == 2000 and pad not in ids and ids.count(eos) > 5
    assert generate(model, [2], 50, seed=0, suppress_tokens=[pad, eos]).count(pad) == 0
    assert generate(model, [2], 50, temperature=0, tokenizer=tok, stop_at_eos=False)[0] != pad  # greedy too
    # <EOS> ends the text: the ids stop before it
    ids = generate(model, [2], 2000, seed=0, tokenizer=tok)
    assert eos not in ids and len(ids) < 2000
    full = generate(model, [2], 2000, seed=0, tokenizer=tok, stop_at_eos=False)
    assert ids == full[: full.index(eos)]
    # text output never shows a control token as text
    text = "".join(stream_text(model, [2], tok, 2000, seed=0, stop_at_eos=False))
    assert "<EOS>" not in text and "<PAD>" not in text
    assert text == tok.decode(full, skip_special=True)
    assert "".join(pieces_of(tok, [eos, 3, pad, 4, eos])) == tok.decode([3, 4])
    words = dl.lesson_tokenizer()
    assert words.decode([3, 4], skip_special=True) == "awesome" and words.special_ids == {4}


def test_a_chat_templates_end_of_turn_ends_the_text():
    """A model of a chat checkpoint writes "bc", then <|end|>: the end of turn is a control token that ends
    the text (as <EOS> does) in generate, stream, stream_text and batches -- not text to go on after."""
    tok, model, ids = end_of_turn_model()
    b, c, end = ids["b"], ids["c"], ids["end"]
    assert tok.end_of_text_ids[0] == tok.eos_id and end in tok.end_of_text_ids
    assert generate(model, "a", 10, temperature=0, tokenizer=tok) == [b, c]
    gen = stream(model, "a", 10, temperature=0, tokenizer=tok)
    assert [next(gen), next(gen)] == [b, c]
    with pytest.raises(StopIteration) as stopped:
        next(gen)
    assert stopped.value.value == (end,)  # swallowed: it ended the text
    assert "".join(stream_text(model, "a", tok, 10, temperature=0)) == "bc"
    assert generate_batch(model, ["a", "b"], 10, temperature=0, tokenizer=tok) == [[b, c], [c]]
    assert generate(model, "a", 10, temperature=0.5, seed=3, tokenizer=tok) == [b, c]  # sampled too
    # stop_at_eos=False lets the end-of-text tokens through as ids (and text output leaves them out)
    assert generate(model, "a", 5, temperature=0, tokenizer=tok, stop_at_eos=False) == [b, c, end, ids["a"], b]
    assert "".join(stream_text(model, "a", tok, 5, temperature=0, stop_at_eos=False)) == "bcab"


def test_text_stop_holds_back_and_cuts():
    """The scheduler's stop strings are generation.stops' (one implementation): what could become a stop is
    held back, and the text ends exactly before it."""
    tok = CharTokenizer.from_text(CHARS)

    def push(s, text):
        ids, matched = s.feed(tok.encode(text))
        return tok.decode(ids), matched is not None

    s = TextStopMatcher(["ab", "xyz"], tok.decode)
    assert push(s, "qa") == ("q", False)  # "a" could start "ab"
    assert push(s, "c") == ("ac", False)
    assert push(s, "xy") == ("", False)
    assert push(s, "zzz") == ("", True)  # ends exactly before "xyz"
    s = TextStopMatcher(["ab"], tok.decode)
    assert push(s, "xa") == ("x", False) and tok.decode(s.flush()) == "a"
