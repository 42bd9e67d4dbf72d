"""Fine-tuning says loudly when most conversations do not fit the model's context (their ends would be cut), and
stays quiet when they fit."""

import warnings

import pytest
from tiny_runs import chat_pair, conv, one_thread  # noqa: F401  (one_thread: an autouse fixture)

from decoderlab.chat import get_template
from decoderlab.finetuning.sft import sft_examples

LONG = [conv("tell me a long story please", "once upon a time " * 6) for _ in range(6)]
SHORT = [conv("hi", "yo") for _ in range(6)]


def test_most_conversations_cut_is_a_loud_warning():
    _, tok = chat_pair()
    with pytest.warns(UserWarning, match=r"MOST CONVERSATIONS DO NOT FIT: 7 of 8 are longer than the model's "
                                         r"context \(max_len=32 tokens\)"):
        sft_examples(LONG + SHORT[:1], LONG[:1], tok, get_template("decoderlab"), 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sft_examples(SHORT + LONG[:2], None, tok, get_template("decoderlab"), 32)  # a few cut: the count line only
