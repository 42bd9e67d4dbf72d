"""Structured output: the grammar's token mask for char, word and BPE vocabularies against a reference
computed from the tokens' bytes, the masked logits equal to the unmasked ones on the allowed tokens, a row
ending when its grammar is complete, per-row grammars in a batch, and on a small trained model every sampled
reply under a JSON schema parses and validates (50 seeds)."""

import json

import pytest
import torch
from tiny_models import PERSON_SCHEMA, one_thread, trained_json_model  # noqa: F401 -- one_thread: autouse

import decoderlab as dl
from decoderlab.generation import (GrammarMask, Sampler, SamplingParams, SamplingValueError, TokenCounts,
                                   generate, generate_batch, stream_text)
from decoderlab.generation.grammar import Grammar, bind_grammar

jsonschema = pytest.importorskip("jsonschema")

WORDS = ["cat", "car", "dog", "do", "c", "a", "t", "r", "o", "g"]


def allowed_ids(state, v):
    return set(state.allowed(v).nonzero().flatten().tolist())


def reference_allowed(tok, choices, prefix: bytes, sep: bytes = b"") -> set[int]:
    """The tokens that begin some spelling, in this vocabulary, of the rest of a choice after ``prefix``
    (each token's bytes after ``sep``, a word vocabulary's separator) -- what a choice grammar must allow,
    computed from the vocabulary alone by searching the spellings."""
    spell = {i: sep + tok.token_bytes(i) for i in range(tok.vocab_size) if i not in tok.special_ids}

    def spellable(rest: bytes) -> bool:
        return rest == b"" or any(rest.startswith(b) and spellable(rest[len(b):]) for b in spell.values())

    return {i for i, b in spell.items() for c in choices
            if c.startswith(prefix + b) and spellable(c[len(prefix) + len(b):])}


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_the_mask_is_the_tokens_that_continue_the_grammar(kind):
    """At every prefix of a choice, the allowed tokens are exactly those whose bytes lead on to a choice;
    the end-of-text token only once the text is one of them."""
    choices = [b"cat", b"car", b"dog", b"do"]
    if kind == "char":
        tok = dl.CharTokenizer(set("catrdogx"))
    else:
        tok = dl.BPETokenizer.train(["cat car dog do " * 40], 270)
    g = bind_grammar(Grammar.choice([c.decode() for c in choices]), tok, tok.vocab_size)
    for target in ("cat", "do"):
        state, prefix = g.state(), b""
        for t in tok.encode(target):
            got = allowed_ids(state, tok.vocab_size)
            want = reference_allowed(tok, choices, prefix)
            if prefix in choices:
                want.add(tok.eos_id)
            assert got == want, (target, prefix)
            state.advance(t)
            prefix += tok.token_bytes(t)
        assert state.accepting
    assert state.complete is False  # "do" may still become "dog"


def test_a_word_vocabulary_is_masked_with_its_separator():
    tok = dl.WordTokenizer(WORDS)
    g = bind_grammar(Grammar.choice(["cat dog", "cat do", "car"]), tok, tok.vocab_size)
    state = g.state()
    choices = [b" cat dog", b" cat do", b" car"]
    prefix = b""
    for w in ["cat", "dog"]:
        assert allowed_ids(state, tok.vocab_size) == reference_allowed(tok, choices, prefix, b" ")
        state.advance(tok.encode(w)[0])
        prefix += b" " + w.encode()
    assert state.complete  # "cat dog" is a whole choice and nothing extends it
    assert allowed_ids(state, tok.vocab_size) == {tok.eos_id}


def test_masked_logits_equal_the_unmasked_ones_on_the_allowed_tokens():
    tok = dl.CharTokenizer(set('{}[]":, 0123456789abc'))
    bound = bind_grammar(Grammar.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                              "required": ["a"]}), tok, tok.vocab_size)
    counts = TokenCounts.for_prompts([[0], [0]], tok.vocab_size, grammars=[bound, None])
    counts.add(tok.encode("{"))  # row 0 (grammar) takes "{", row 1 (no grammar) the same token id
    torch.manual_seed(0)
    logits = torch.randn(2, tok.vocab_size, dtype=torch.float64)
    out = GrammarMask.per_row([bound.grammar, None])(logits.clone(), counts)
    allowed = counts.grammars[0].allowed(tok.vocab_size)
    assert allowed.sum() == 1 and bool(allowed[tok.encode('"')[0]])  # after "{" only the key's quote
    assert torch.equal(out[0][allowed], logits[0][allowed])
    assert bool(torch.isneginf(out[0][~allowed]).all())
    assert torch.equal(out[1], logits[1])  # the row without a grammar is untouched


def test_the_sampler_applies_the_mask_to_greedy_and_sampled_rows():
    tok = dl.CharTokenizer(set("ab"))
    bound = bind_grammar(Grammar.regex("b+"), tok, tok.vocab_size)
    a, b = tok.encode("ab")
    logits = torch.full((2, tok.vocab_size), -1.0, dtype=torch.float64)
    logits[:, a] = 5.0  # "a" is the most probable token
    for temp in (0.0, 0.8):
        counts = TokenCounts.for_prompts([[a], [a]], tok.vocab_size, grammars=[bound, None])
        sampler = Sampler([SamplingParams(temperature=temp, grammar=bound.grammar), SamplingParams(temperature=0)])
        gens = [torch.Generator().manual_seed(1), None] if temp else []
        assert sampler(logits, gens, counts).tolist() == [b, a]


def test_generation_ends_when_the_grammar_is_complete():
    """A model that would write "aaaa..." forever under the regex "a{3}": three tokens, then the end (the
    stream returns () -- a stop that took no token), with or without the cache, in a batch and as text."""
    tok = dl.CharTokenizer(set("ab"))
    a = tok.encode("a")[0]
    from tiny_models import bigram_model

    model = bigram_model(tok.vocab_size, {i: a for i in range(tok.vocab_size)})
    tok_no_eos = type("NoEOS", (dl.CharTokenizer,), {"eos_id": property(lambda self: None),
                                                     "end_of_text_ids": property(lambda self: ())})(set("ab"))
    for t in (tok, tok_no_eos):
        for cache in (True, False):
            gen = dl.stream(model, [a], 50, tokenizer=t, temperature=0, grammar=Grammar.regex("a{3}"),
                            use_cache=cache)
            got = []
            with pytest.raises(StopIteration) as end:
                while True:
                    got.append(next(gen))
            assert got == [a, a, a] and end.value.value == ()
    out = generate_batch(model, [[a], [a, a]], [SamplingParams(max_new_tokens=50, grammar=Grammar.regex("a{2}")),
                                                SamplingParams(max_new_tokens=5)], tokenizer=tok, temperature=0)
    assert out == [[a, a], [a] * 5]  # the second row has no grammar: its own limit
    # how each row ended, as stream returns it: () a complete grammar, None the limit, the stop's tokens
    rows = [SamplingParams(max_new_tokens=50, grammar=Grammar.regex("a{2}")), SamplingParams(max_new_tokens=5),
            SamplingParams(max_new_tokens=5, stop=[a])]
    ends = generate_batch(model, [[a], [a, a], [a]], rows, tokenizer=tok, temperature=0, return_stops=True)
    assert ends == [([a, a], ()), ([a] * 5, None), ([], (a,))]
    assert "".join(stream_text(model, [a], tok, 50, temperature=0, grammar=Grammar.regex("a{4}"))) == "aaaa"


def test_each_row_of_a_batch_has_its_own_grammar():
    tok = dl.CharTokenizer(set('{}[]":, 0123456789abcdefghijklmnopqrstuvwxyz'))
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=16,
                                                n_layer=1, n_head=2, max_len=64)).eval()
    rows = [SamplingParams.of(max_new_tokens=40, seed=1, json_schema={"enum": ["yes", "no"]}),
            SamplingParams(max_new_tokens=40, seed=2, grammar=Grammar.regex("[0-9]{4}")),
            SamplingParams(max_new_tokens=8, seed=3)]
    out = generate_batch(model, ["x", "yy", "zzz"], rows, tokenizer=tok)
    alone = [generate(model, p, r, tokenizer=tok) for p, r in zip(["x", "yy", "zzz"], rows)]
    assert out == alone
    texts = [tok.decode(o) for o in out]
    assert texts[0] in ('"yes"', '"no"') and len(texts[1]) == 4 and texts[1].isdigit()


def test_a_grammar_that_cannot_compile_names_the_problem():
    with pytest.raises(ValueError, match="Invalid type: nonsense"):
        Grammar.json_schema({"type": "nonsense"})
    with pytest.raises(ValueError, match="unclosed group"):
        Grammar.regex("a(b")
    with pytest.raises(SamplingValueError) as e:
        SamplingParams.of(json_schema={"type": "object", "properties": {"a": {"type": "string", "format": "x-y"}}})
    assert e.value.field == "grammar" and "Unknown format" in str(e.value)
    lenient = Grammar.json_schema({"type": "string", "format": "x-y"}, strict=False)  # strict: false ignores it
    assert lenient.kind == "json_schema"
    with pytest.raises(TypeError, match="grammar must be a Grammar"):
        SamplingParams(grammar="[0-9]+")
    with pytest.raises(SamplingValueError, match="needs the tokenizer"):
        SamplingParams(grammar=Grammar.regex("a")).bind(5, None)
    with pytest.raises(TypeError, match="same setting"):
        SamplingParams.of(json_schema={"type": "object"}, grammar=Grammar.regex("a"))


@pytest.fixture(scope="module")
def json_model():
    return trained_json_model()


@pytest.mark.slow
def test_every_sampled_reply_under_a_schema_parses_and_validates(json_model):
    """50 seeds on a small model trained on records of the schema: each reply is valid JSON that validates
    (the schema bounds every string and number, so each reply completes within the token budget)."""
    model, tok = json_model
    validator = jsonschema.Draft202012Validator(PERSON_SCHEMA)
    replies = [tok.decode(generate(model, "\n", 120, tokenizer=tok, seed=s, json_schema=PERSON_SCHEMA))
               for s in range(50)]
    for text in replies:
        validator.validate(json.loads(text))
    assert len(set(replies)) > 10  # sampled, not one reply forced 50 times
