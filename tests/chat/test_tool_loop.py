"""The tool loop: a call the model writes runs here and its result is in the next step's prompt; the most calls
per turn ends the loop with its finish reason; a malformed call (an unknown tool, arguments that are not JSON,
a tool that fails) comes back to the model as an error result; a result longer than the context left is cut
with a marker."""

import string

import pytest
import torch

import decoderlab as dl
from decoderlab.chat import TOOLS, Tool, add_chat_tokens, calculate, get_template, run_tool_turn
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
