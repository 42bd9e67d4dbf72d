"""SamplingParams: checked once when built (messages naming the field and what is allowed), normalised, frozen,
replaced with checks, the keyword conveniences, and bound to a model's vocabulary and tokenizer."""

import dataclasses

import numpy as np
import pytest
import torch

from decoderlab.config import DEFAULT_MAX_NEW_TOKENS
from decoderlab.generation import SamplingParams, SamplingTypeError, SamplingValueError
from decoderlab.tokenizers import CharTokenizer


def test_defaults_and_normalised_values():
    p = SamplingParams()
    assert p.max_new_tokens == DEFAULT_MAX_NEW_TOKENS == 200
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed) == (1.0, None, None, None, None)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.0, 0.0, 0.0)
    assert (p.logit_bias, p.suppress_tokens, p.stop, p.stop_at_eos) == (None, None, None, True)
    q = SamplingParams(top_k=0, min_p=0, temperature=np.float64(0.5), max_new_tokens=torch.tensor(7),
                       logit_bias={"5": -100, 2: 1}, suppress_tokens=torch.tensor([3, 1, 3]), stop=["\n", 4, (1, 2)],
                       seed=np.int64(9))
    assert (q.top_k, q.min_p, q.temperature, q.max_new_tokens, q.seed) == (None, None, 0.5, 7, 9)
    assert type(q.max_new_tokens) is int and type(q.temperature) is float and type(q.seed) is int
    assert q.logit_bias == ((2, 1.0), (5, -100.0)) and q.suppress_tokens == (1, 3) and q.stop == ("\n", 4, (1, 2))
    assert SamplingParams(stop=(1, 2)).stop == ((1, 2),)  # a tuple of ids is one sequence
    assert SamplingParams(stop="\n\n").stop == ("\n\n",) and SamplingParams(stop=[]).stop is None
    assert hash(q) == hash(dataclasses.replace(q))  # hashable: equal settings are bound once
    assert SamplingParams(temperature=0).greedy and not p.greedy
    assert SamplingParams(presence_penalty=0.1).uses_counts and not p.uses_counts


def test_frozen_and_replaced_with_the_same_checks():
    p = SamplingParams(temperature=0.7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 2.0
    assert p.replace(top_k=5) == SamplingParams(temperature=0.7, top_k=5)
    with pytest.raises(ValueError, match="top_k must be an integer >= 0, got -2"):
        p.replace(top_k=-2)
    with pytest.raises(TypeError, match="unknown sampling setting top_n; known: max_new_tokens, temperature"):
        p.replace(top_n=3)
    with pytest.raises(TypeError):
        SamplingParams(50)  # keyword-only: SamplingParams(max_new_tokens=50)


def test_of_is_the_keyword_convenience():
    assert SamplingParams.of(None, temperature=0) == SamplingParams(temperature=0)
    assert SamplingParams.of(50, top_k=3) == SamplingParams(max_new_tokens=50, top_k=3)
    p = SamplingParams(seed=1)
    assert SamplingParams.of(p) is p and SamplingParams.of(p, seed=2) == SamplingParams(seed=2)
    with pytest.raises(TypeError, match="max_new_tokens is given twice"):
        SamplingParams.of(5, max_new_tokens=6)
    for bad in ("50", 5.0, True):
        with pytest.raises(TypeError, match="params must be a SamplingParams or the number of new tokens"):
            SamplingParams.of(bad)


@pytest.mark.parametrize("field, value, error, message", [
    ("max_new_tokens", -1, ValueError, "max_new_tokens must be an integer >= 0, got -1"),
    ("max_new_tokens", 2.5, TypeError, "max_new_tokens must be an integer >= 0, got 2.5"),
    ("temperature", -0.5, ValueError, "temperature must be a finite number >= 0"),
    ("temperature", "hot", TypeError, "temperature must be a number >= 0"),
    ("top_k", -1, ValueError, "top_k must be an integer >= 0, got -1"),
    ("top_p", 1.5, ValueError, r"top_p must be in \(0, 1\]"),
    ("min_p", 2, ValueError, r"min_p must be a number from 0 to 1 \(0 = off\), got 2.0"),
    ("repetition_penalty", -1, ValueError, "repetition_penalty must be a finite number > 0"),
    ("frequency_penalty", 3, ValueError, r"frequency_penalty must be a number from -2 to 2 \(0 = off\), got 3.0"),
    ("presence_penalty", "a", TypeError, "presence_penalty must be a number from -2 to 2"),
    ("logit_bias", {1: -101}, ValueError, r"logit_bias\[1\] must be a number from -100 to 100"),
    ("logit_bias", [1, 2], TypeError, "logit_bias must be a map of token id -> bias"),
    ("suppress_tokens", [1, -2], ValueError, "suppress_tokens id must be an integer >= 0, got -2"),
    ("stop", [""], ValueError, "a stop string must not be empty"),
    ("stop", [1.5], TypeError, "stop must be token ids or strings, got 1.5"),
    ("stop_at_eos", 1, TypeError, "stop_at_eos must be True or False, got 1"),
    ("seed", "abc", TypeError, r"seed must be an integer in 0 \.\. 2\*\*63-1, got 'abc'"),
    ("seed", -1, ValueError, r"seed must be an integer in 0 \.\. 2\*\*63-1, got -1"),
])
def test_every_field_is_checked_when_built_naming_it(field, value, error, message):
    kind = SamplingValueError if error is ValueError else SamplingTypeError
    with pytest.raises(kind, match=message) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field and isinstance(e.value, error)


def test_bind_resolves_what_depends_on_the_model_and_tokenizer():
    tok = CharTokenizer.from_text("ab").add_special_tokens(["<|user|>", "<|end|>"])  # <PAD> 0, <EOS> 1, a, b, ...
    assert tok.end_of_text_ids == (1, 4, 5)  # <EOS>, then the added special tokens; not <PAD>
    b = SamplingParams(stop=["b", 3, (2, 3)]).bind(tok.vocab_size, tok)
    assert b.params.suppress_tokens == (0,)  # the tokenizer's <PAD>
    assert b.stop_ids == ((3,), (2, 3), (1,), (4,), (5,)) and b.stop_texts == ("b",)
    assert SamplingParams(stop_at_eos=False).bind(tok.vocab_size, tok).stop_ids == ()
    assert SamplingParams(suppress_tokens=()).bind(tok.vocab_size, tok).params.suppress_tokens == ()
    assert SamplingParams().bind(9).stop_ids == () and SamplingParams().bind(9).params.suppress_tokens == ()
    assert SamplingParams(stop="<EOS>").bind(tok.vocab_size, tok).stop_ids[0] == (1,)  # a control token's name
    for field, value in (("suppress_tokens", (6,)), ("logit_bias", {6: 1.0})):
        with pytest.raises(SamplingValueError, match=rf"{field}: token id 6 is out of range; allowed ids are 0 \.\. 5"):
            SamplingParams(**{field: value}).bind(tok.vocab_size, tok)
    with pytest.raises(ValueError, match="stop token id 9 is out of range"):
        SamplingParams(stop=9).bind(tok.vocab_size, tok)
    with pytest.raises(TypeError, match="needs the tokenizer"):
        SamplingParams(stop="b").bind(tok.vocab_size)


def test_padding_that_is_also_the_end_of_text_is_not_suppressed():
    """<PAD> is never sampled -- but a tokenizer that pads with its end-of-text token (SmolLM2's and Llama 3's:
    pad_token = eos_token) must still be able to end its text."""
    from tokenizers import Tokenizer, models

    from decoderlab.generation import SamplingParams
    from decoderlab.tokenizers import BPETokenizer

    hf = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    hf.add_special_tokens(["<|endoftext|>", "<|im_end|>"])
    own = BPETokenizer(hf, special_tokens={"pad_token": "<|endoftext|>", "eos_token": "<|im_end|>"})
    shared = BPETokenizer(hf, special_tokens={"pad_token": "<|im_end|>", "eos_token": "<|im_end|>"})
    assert SamplingParams().bind(5, own).params.suppress_tokens == (own.pad_id,)
    assert shared.pad_id == shared.eos_id == 4 and SamplingParams().bind(5, shared).params.suppress_tokens == ()
