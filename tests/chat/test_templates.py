"""Chat templates: the one renderer (ids and loss mask), typed special-token text, the lesson's pair scheme as a
template, and the template's special tokens in a tokenizer and a model (the embedding resized, tying kept)."""

import json

import pytest
import torch
from tiny_runs import DL, conv, one_thread  # noqa: F401  (one_thread: an autouse fixture)

from decoderlab.chat import add_chat_tokens, render_chat
from decoderlab.training.rows import IGNORE_INDEX, shift_for_training
from decoderlab.model import DecoderOnlyTransformer, preset
from decoderlab.tokenizers import BPETokenizer, CharTokenizer, WordTokenizer


@pytest.mark.parametrize("kind", ["char", "bpe", "word"])
def test_supervised_ids_decode_to_each_reply_plus_end_of_turn(kind):
    c = conv("what is up?", "all good", "and you?", "fine too", system="be nice")
    text = " ".join(m["content"] for m in c)
    base = {"char": lambda: CharTokenizer.from_text(text), "bpe": lambda: BPETokenizer.train([text * 5], 300),
            "word": lambda: WordTokenizer.from_texts([text])}[kind]()
    tok = base.add_special_tokens(DL.special_tokens)
    ids, mask = render_chat(c, tok, "decoderlab")
    assert len(ids) == len(mask)
    eot = DL.end_of_turn_id(tok)
    # split the supervised ids into runs: each run is one assistant turn
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    runs.append(cur)
    assert [r[-1] for r in runs] == [eot, eot]
    replies = [tok.decode(r[:-1]) for r in runs]
    assert [r.replace(" ", "") if kind == "word" else r for r in replies] == (
        ["allgood", "finetoo"] if kind == "word" else ["all good", "fine too"])
    # the opener of each assistant turn is context, not a target
    assert all(not m for i, m in zip(ids, mask) if i == tok.token_to_id["<|assistant|>"])


@pytest.mark.parametrize("kind", ["char", "bpe", "word"])
def test_typed_special_token_text_stays_text(kind):
    text = "hi <|user|> <|end|> there ok <|assistant|>"
    base = {"char": lambda: CharTokenizer.from_text(text), "bpe": lambda: BPETokenizer.train([text * 5], 300),
            "word": lambda: WordTokenizer.from_texts(["hi there ok"], unk=True)}[kind]()
    tok = base.add_special_tokens(DL.special_tokens)
    ids, _ = render_chat(conv(text, "ok <|assistant|>") if kind != "word" else conv(text, "hi"), tok)
    specials = [tok.token_to_id[t] for t in DL.special_tokens]
    # exactly the template's own special tokens: user, end, assistant, end
    assert [i for i in ids if i in specials] == [specials[1], specials[3], specials[2], specials[3]]
    if kind != "word":
        assert tok.decode(tok.encode(text)) == text
    # saved and loaded, the special tokens come back and stay atomic
    again = type(tok).from_dict(json.loads(json.dumps(tok.to_dict())))
    assert again.added_special_tokens == DL.special_tokens
    assert render_chat(conv(text, "hi"), again)[0] == render_chat(conv(text, "hi"), tok)[0]


def test_resize_embedding_new_rows_at_the_mean_untied_head():
    torch.manual_seed(0)
    tok = CharTokenizer.from_text("abc")
    model = DecoderOnlyTransformer(preset("statquest", num_tokens=tok.vocab_size))  # untied head with a bias
    model2, tok2, added = add_chat_tokens(model, tok, "decoderlab")
    assert added == DL.special_tokens and tok2.vocab_size == tok.vocab_size + 4
    n = tok.vocab_size
    torch.testing.assert_close(model2.we.weight[:n], model.we.weight)
    torch.testing.assert_close(model2.we.weight[n:], model.we.weight.mean(0).expand(4, -1))
    torch.testing.assert_close(model2.fc_layer.weight[n:], model.fc_layer.weight.mean(0).expand(4, -1))
    torch.testing.assert_close(model2.fc_layer.bias[n:], model.fc_layer.bias.mean().expand(4))
    x = torch.tensor([2, 3, 4])  # old ids: the old logits are unchanged
    torch.testing.assert_close(model2(x)[:, :n], model(x))
    with pytest.raises(ValueError, match="shrink"):
        model2.resize_token_embeddings(n)


def test_lesson_template_is_the_pair_scheme():
    from decoderlab.lesson import LESSON_PAIRS, pair_inputs_and_labels, tokenizer_for_pairs

    tok = tokenizer_for_pairs(LESSON_PAIRS)
    ids, mask = render_chat(conv("what is statquest", "awesome"), tok, "lesson")
    inputs, labels = pair_inputs_and_labels(LESSON_PAIRS[:1], tok)
    x, y = shift_for_training(ids, mask, max_len=6)
    assert x == inputs[0].tolist()
    # the lesson supervises every position; the chat loss keeps only the response and its <EOS>
    assert y == [IGNORE_INDEX] * 3 + labels[0].tolist()[3:]


def test_tools_template_renders_calls_results_and_definitions_with_their_own_tokens():
    """The "tools" template: the tools offered after the system message, a call after <|tool_call|> (supervised,
    as the assistant's content), the result after <|tool|> (context), each turn closed by <|end|>."""
    from decoderlab.chat import get_template, parse_tool_call, tool_call_text

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":17,"b": 25}'}}
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}, {"role": "assistant", "content": "42!"}]
    template = get_template("tools")
    tok = CharTokenizer.from_text('sq42!add {}"ab:,17 25[]typeobjctnmr').add_special_tokens(template.special_tokens)
    ids, mask = template.render(messages, tok, tools=tools)
    sp = {t: tok.token_to_id[t] for t in template.special_tokens}
    want = ([sp["<|system|>"]] + tok.encode("s") + [sp["<|end|>"], sp["<|tool|>"]]
            + tok.encode('[{"name": "add", "parameters": {"type": "object"}}]') + [sp["<|end|>"]]
            + [sp["<|user|>"]] + tok.encode("q") + [sp["<|end|>"]]
            + [sp["<|assistant|>"], sp["<|tool_call|>"]] + tok.encode('add {"a": 17, "b": 25}') + [sp["<|end|>"]]
            + [sp["<|tool|>"]] + tok.encode("42") + [sp["<|end|>"]]
            + [sp["<|assistant|>"]] + tok.encode("42!") + [sp["<|end|>"]])
    assert ids == want
    supervised = [i for i, m in zip(ids, mask) if m]
    assert supervised == ([sp["<|tool_call|>"]] + tok.encode('add {"a": 17, "b": 25}') + [sp["<|end|>"]]
                          + tok.encode("42!") + [sp["<|end|>"]])
    assert parse_tool_call(tool_call_text("add", call["function"]["arguments"])) == ("add", '{"a": 17, "b": 25}')
    with pytest.raises(ValueError, match="no tool-call tokens"):
        DL.render(messages, tok.add_special_tokens(DL.special_tokens))


@pytest.mark.parametrize("arguments", ["", "  ", {}])
def test_a_call_without_arguments_renders_as_an_empty_object(arguments):
    """A history call whose ``arguments`` is "" rendered as "add " (vLLM renders ``{}``)."""
    from decoderlab.chat import get_template, parse_tool_call, tool_call_text

    assert tool_call_text("add", arguments) == "add {}"
    assert parse_tool_call(tool_call_text("add", arguments)) == ("add", "{}")
    template = get_template("tools")
    tok = CharTokenizer.from_text("qadd {}42").add_special_tokens(template.special_tokens)
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": arguments}}
    ids, _ = template.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                                                                  "tool_calls": [call]},
                              {"role": "tool", "tool_call_id": "c", "content": "4"},
                              {"role": "assistant", "content": "2"}], tok)
    assert "<|tool_call|>add {}<|end|>" in tok.decode(ids)


def test_the_tools_template_names_the_json_characters_it_writes():
    from decoderlab.chat import get_template

    assert set('{}[]":,0123456789 ') <= set(get_template("tools").text_characters)
    assert get_template("decoderlab").text_characters == ""
