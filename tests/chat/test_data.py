"""Conversation data: JSONL files in three formats, each bad line named with its file and line."""

import json

import pytest
from tiny_runs import GOOD, conv, write

from decoderlab.chat import load_conversations


@pytest.mark.parametrize("bad, match", [
    ('{"messages": [', r"line 2: malformed JSON"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), r"line 2: .*unknown role 'robot'"),
    (json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                              {"role": "assistant", "content": "c"}]}), r"line 2: .*two user turns in a row"),
    (json.dumps({"messages": conv("a", "  ")}), r"line 2: .*empty assistant turn"),
    (json.dumps({"prompt": "a", "completion": "b"}), r"line 2: expected a JSON object|line 2: unexpected key"),
    (json.dumps({"messages": conv("a")}), r"line 2: .*must end with an assistant message"),
])
def test_bad_lines_name_file_and_line(tmp_path, bad, match):
    p = write(tmp_path, GOOD, bad, GOOD)
    with pytest.raises(ValueError, match=match) as e:
        load_conversations(p)
    assert str(p) in str(e.value)


def test_three_formats_are_detected(tmp_path):
    assert load_conversations(write(tmp_path, GOOD)) == [conv("hi", "ho")]
    pc = load_conversations(write(tmp_path, json.dumps({"prompt": "p", "completion": "c"})))
    assert pc.format == "prompt-completion" and pc == [conv("p", "c")]
    al = load_conversations(write(tmp_path, json.dumps({"instruction": "i", "input": "x", "output": "o"}),
                                  json.dumps({"instruction": "j", "input": "", "output": "q"})))
    assert al.format == "alpaca" and al == [conv("i\n\nx", "o"), conv("j", "q")]
