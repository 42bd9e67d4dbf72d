"""The tool loop: a call the model writes runs here and its result is in the next step's prompt; the most calls
per turn ends the loop with its finish reason; a malformed call (an unknown tool, arguments that are not JSON,
a tool that fails) comes back to the model as an error result; a result longer than the context left is cut
with a marker."""

import string

import pytest
import torch

import decoderlab as dl
from decoderlab.chat import TOOLS, Tool, add_chat_tokens, calculate, get_template, run_tool_turn, run_tool_turns
from decoderlab.chat.tool_loop import TRUNCATED, fit_result

ASK = [{"role": "user", "content": "What is 4821 * 377?"}]
TEMPLATE = get_template("tools")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    _, tok, _ = add_chat_tokens(None, dl.CharTokenizer(set(string.printable)), "tools")
    cfg = dl.preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=16, n_layer=1, n_head=2, max_len=400)
    return dl.DecoderOnlyTransformer(cfg).eval(), tok


def pushed(tok, token, bias=100.0):
    return {tok.token_to_id[token]: bias}


def test_a_call_runs_and_its_result_is_in_the_next_prompt(tiny):
    model, tok = tiny
    seen = []
    turn = run_tool_turn(model, tok, ASK, TEMPLATE, TOOLS, temperature=0, max_new_tokens=40, max_calls=2,
                         logit_bias=pushed(tok, "<|tool_call|>"), on_call=seen.append)
    # the bias opens a call at every step: two calls, then the third is refused by max_calls
    assert turn.finish_reason == "max_tool_calls" and len(turn.calls) == 2 and seen == turn.calls
    for call in turn.calls:
        assert call.name == "calculator" and call.result == calculate(call.arguments)
    roles = [m["role"] for m in turn.messages]
    assert roles == ["assistant", "tool", "assistant", "tool", "assistant"]
    # the second step's prompt is the conversation with the first call and its result, as the template renders it
    first = ASK + turn.messages[:2]
    ids, _ = TEMPLATE.render(first, tok, add_generation_prompt=True)
    assert tok.decode(ids).endswith(f"<|tool|>{turn.calls[0].result}<|end|><|assistant|>")


QUESTIONS = ["What is 4821 * 377?", "What is 12 + 7?", "Add 3 and 9.", "How much is 60 / 4?", "Hello!",
             "What is 2 * 3 * 4?", "Compute 100 - 58."]


@pytest.mark.parametrize("sampling, call, end", [(dict(temperature=0), 0.2, 0.2),
                                                  (dict(temperature=1, seed=5), 3.0, 2.0)])
def test_many_turns_batched_are_each_turn_alone(tiny, sampling, call, end):
    """run_tool_turns steps every conversation's generations together (two rows a batch here): each turn --
    its text, calls, results, messages and finish reason -- is run_tool_turn's on that conversation alone.
    A slight push towards the call token and the end of turn gives turns that answer, call once, call to the
    limit and run out of tokens, so a batch holds rows at different rounds."""
    model, tok = tiny
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    bias = {**pushed(tok, "<|tool_call|>", call), **pushed(tok, "<|end|>", end)}
    settings = dict(max_new_tokens=30, max_calls=2, logit_bias=bias, **sampling)
    batched = run_tool_turns(model, tok, convs, TEMPLATE, TOOLS, batch_size=2, **settings)
    alone = [run_tool_turn(model, tok, c, TEMPLATE, TOOLS, **settings) for c in convs]
    assert batched == alone
    assert len({len(t.calls) for t in alone}) > 1 and len({t.finish_reason for t in alone}) > 1


def test_many_turns_refuse_a_batch_size_under_one(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        run_tool_turns(model, tok, [ASK], TEMPLATE, TOOLS, batch_size=0)


def test_no_call_is_an_answer_and_zero_calls_allowed_ends_at_the_first(tiny):
    model, tok = tiny
    turn = run_tool_turn(model, tok, ASK, TEMPLATE, TOOLS, temperature=0, max_new_tokens=12,
                         logit_bias=pushed(tok, "<|tool_call|>", -100))
    assert turn.calls == [] and turn.finish_reason in ("stop", "length")
    assert turn.messages == [{"role": "assistant", "content": turn.content}]
    turn = run_tool_turn(model, tok, ASK, TEMPLATE, TOOLS, temperature=0, max_new_tokens=12, max_calls=0,
                         logit_bias=pushed(tok, "<|tool_call|>"))
    assert turn.calls == [] and turn.finish_reason == "max_tool_calls"


def test_malformed_calls_are_error_results_not_exceptions(tiny):
    model, tok = tiny

    def broken(arguments):
        raise RuntimeError("disk on fire")

    # unconstrained, the random model writes whatever name and arguments: each an error result for the model
    turn = run_tool_turn(model, tok, ASK, TEMPLATE, {"broken": broken}, temperature=0, max_new_tokens=10,
                         max_calls=1, constrain=False, logit_bias=pushed(tok, "<|tool_call|>"))
    (call,) = turn.calls
    if call.name == "broken":
        assert call.result == "error: the tool 'broken' failed: RuntimeError: disk on fire"
    else:
        assert call.result == f"error: unknown tool {call.name!r}; tools: broken"
    turn = run_tool_turn(model, tok, ASK, TEMPLATE, {"calculator": TOOLS["calculator"].run}, temperature=0,
                         max_new_tokens=10, max_calls=1, constrain=False, logit_bias=pushed(tok, "<|tool_call|>"))
    assert turn.calls[0].result.startswith("error: ")
    with pytest.raises(ValueError, match="max_calls must be an integer >= 0, got -1"):
        run_tool_turn(model, tok, ASK, TEMPLATE, TOOLS, max_calls=-1)


def test_a_result_over_the_context_left_is_cut_with_a_marker(tiny):
    model, tok = tiny
    assert fit_result("12345", tok, 10) == "12345"
    cut = fit_result("9" * 500, tok, 40)
    assert cut.endswith(TRUNCATED) and len(tok.encode(cut)) == 40
    huge = {"calculator": Tool(TOOLS["calculator"].definition, lambda arguments: "7" * 5000)}
    turn = run_tool_turn(model, tok, ASK, TEMPLATE, huge, temperature=0, max_new_tokens=30, max_calls=1,
                         logit_bias=pushed(tok, "<|tool_call|>"))
    result = turn.calls[0].result
    assert result.endswith(TRUNCATED) and result.startswith("777")
    ids, _ = TEMPLATE.render(ASK + turn.messages[:2], tok, add_generation_prompt=True)
    assert len(ids) < model.config.max_len  # room left for the answer


def test_the_chat_session_shows_each_call_and_its_result(tiny):
    from decoderlab.chat import ToolChatSession

    model, tok = tiny
    session = ToolChatSession(model, tok, TEMPLATE, TOOLS, temperature=0, max_new_tokens=40, max_calls=1,
                              logit_bias=pushed(tok, "<|tool_call|>"))
    lines = "".join(session.reply(ASK[0]["content"])).split("\n")
    call = next(m for m in session.messages if m.get("tool_calls"))["tool_calls"][0]["function"]
    result = next(m for m in session.messages if m["role"] == "tool")["content"]
    assert lines[0] == f"[calculator {call['arguments']} -> {result}]" and result == calculate(call["arguments"])
    assert "1 tool calls" in session.notice and [m["role"] for m in session.messages][-1] == "assistant"


def test_chat_with_an_unknown_tool_is_one_error_line():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "decoderlab.cli", "chat", "--checkpoint", "runs/none", "--tools",
                        "calculator,search"], capture_output=True, text=True, input="")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == ["decoderlab: error: unknown tool 'search'; built-in tools: calculator"]


# -- calls written as text, between <tool_call> and </tool_call> (chatml-tools, Qwen2.5's) -------------------------

ADDER = Tool({"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}},
    lambda arguments: str(sum(__import__("json").loads(arguments).values())))


def hermes_model(plain=()):
    """A random model on a byte-level BPE with ChatML's control tokens; ``plain``: <tool_call> and </tool_call>
    as ordinary added tokens (Qwen's tokenizer) -- without them the opener is spelled in pieces (SmolLM2's)."""
    from hf_chat_templates import CHATML_TOKENS, bpe_pair

    tok, _ = bpe_pair(CHATML_TOKENS, plain)
    torch.manual_seed(0)
    cfg = dl.preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=16, n_layer=1, n_head=2, max_len=2048)
    return dl.DecoderOnlyTransformer(cfg).eval(), tok


def forced(text):
    """A grammar that makes any model write ``text``."""
    from decoderlab.generation import Grammar

    return Grammar.lark("start: " + __import__("json").dumps(text))


def test_a_call_in_the_models_own_template_runs_and_its_result_is_in_the_next_prompt():
    model, tok = hermes_model(("<tool_call>", "</tool_call>"))
    seen = []
    turn = run_tool_turn(model, tok, ASK, "chatml-tools", {"add": ADDER}, temperature=0, max_new_tokens=80, max_calls=2,
                         logit_bias=pushed(tok, "<tool_call>"), on_call=seen.append)
    # the bias opens a call at every step, the grammar writes it: two calls, then max_calls ends the turn
    assert turn.finish_reason == "max_tool_calls" and len(turn.calls) == 2 and seen == turn.calls
    for call in turn.calls:
        args = __import__("json").loads(call.arguments)
        assert call.name == "add" and set(args) == {"a", "b"} and call.result == str(args["a"] + args["b"])
    assert [m["role"] for m in turn.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert turn.messages[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": turn.calls[0].arguments}
    # the second step's prompt: the tools offered, the call as the template writes it, its result in a user turn
    # (Qwen2.5's layout)
    from decoderlab.chat import arguments_as_objects

    ids, _ = get_template("chatml-tools").render(arguments_as_objects(ASK + turn.messages[:2]), tok,
                                                 add_generation_prompt=True, tools=[ADDER.definition])
    text = tok.decode(ids)
    assert "<tools>\n" in text and text.endswith(
        f'<|im_start|>assistant\n<tool_call>\n{{"name": "add", "arguments": {turn.calls[0].arguments}}}\n'
        f'</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{turn.calls[0].result}\n</tool_response>'
        f'<|im_end|>\n<|im_start|>assistant\n')


def test_the_opener_spelled_in_pieces_is_found_and_the_text_before_it_kept():
    """SmolLM2's tokenizer has no <tool_call> token: the model writes it in pieces, a stop string finds it."""
    model, tok = hermes_model()
    assert "<tool_call>" not in tok.token_to_id and len(tok.encode("<tool_call>")) > 1
    turn = run_tool_turn(model, tok, ASK, "chatml-tools", {"add": ADDER}, temperature=0, max_new_tokens=80, max_calls=1,
                         grammar=forced("Let me add.\n<tool_call>"))
    (call,) = turn.calls
    assert call.name == "add" and call.result == str(sum(__import__("json").loads(call.arguments).values()))
    assert turn.messages[0]["content"] == "Let me add." and turn.finish_reason == "max_tool_calls"


def test_many_turns_in_a_template_that_writes_calls_as_text_are_each_turn_alone():
    """Hermes calls stop on the text <tool_call>: run_tool_turns runs those generations one at a time, and each
    turn is still run_tool_turn's alone."""
    model, tok = hermes_model(("<tool_call>", "</tool_call>"))
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS[:3]]
    settings = dict(temperature=0, max_new_tokens=40, max_calls=1, logit_bias=pushed(tok, "<tool_call>", 3.0))
    batched = run_tool_turns(model, tok, convs, "chatml-tools", {"add": ADDER}, **settings)
    assert batched == [run_tool_turn(model, tok, c, "chatml-tools", {"add": ADDER}, **settings) for c in convs]
    assert any(t.calls for t in batched)


def test_calls_written_freely_are_read_back_and_bad_ones_answered_with_errors():
    """Unconstrained: a reply with several calls -- a good one, an unknown tool, JSON that is not JSON -- gets a
    result for each, the errors saying what was wrong, and the conversation goes on."""
    model, tok = hermes_model()
    reply = ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
             '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "add", "arguments": {"a": 2,,}}\n</tool_call>')
    turn = run_tool_turn(model, tok, ASK, "chatml-tools", {"add": ADDER}, temperature=0, max_new_tokens=200,
                         max_calls=3, constrain=False, grammar=forced(reply))
    assert [(c.name, c.result) for c in turn.calls] == [
        ("add", "5"), ("search", "error: unknown tool 'search'; tools: add"),
        ("add", "error: the tool call is not valid JSON (Expecting property name enclosed in double quotes at "
                'character 37): {"name": "add", "arguments": {"a": 2,,}}')]
    assert [m["role"] for m in turn.messages] == ["assistant", "tool", "tool", "tool", "assistant"]
    # the second step wrote the same three calls: beyond max_calls, so the turn ended there
    assert turn.finish_reason == "max_tool_calls"


def test_smollm2s_own_template_is_given_chatml_tools_and_its_call_runs_the_calculator():
    """SmolLM2-Instruct's ChatML writes no calls: the loop renders with chatml-tools (the same text without
    tools), the model -- made to write a call in its tokenizer's pieces, as SmolLM2 spells <tool_call> -- calls
    the calculator, whose result is in the next prompt as Qwen2.5's layout writes it."""
    from hf_chat_templates import SMOLLM2

    from decoderlab.chat import JinjaChatTemplate, arguments_as_objects, tools_template

    smollm2 = JinjaChatTemplate(SMOLLM2, name="smollm2")
    assert smollm2.tool_call_format is None and tools_template(smollm2) == get_template("chatml-tools")
    model, tok = hermes_model()
    reply = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "4821 * 377"}}\n</tool_call>'
    turn = run_tool_turn(model, tok, ASK, smollm2, TOOLS, temperature=0, max_new_tokens=120, max_calls=1,
                         constrain=False, grammar=forced(reply))
    (call,) = turn.calls
    assert (call.name, call.result) == ("calculator", str(4821 * 377))
    assert call.result == calculate('{"expression": "4821 * 377"}')
    ids, _ = get_template("chatml-tools").render(arguments_as_objects(ASK + turn.messages[:2]), tok,
                                                 add_generation_prompt=True, tools=[TOOLS["calculator"].definition])
    assert tok.decode(ids).endswith("<|im_start|>user\n<tool_response>\n1817517\n</tool_response><|im_end|>\n"
                                    "<|im_start|>assistant\n")
