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


def test_a_file_that_starts_with_a_byte_order_mark_is_read(tmp_path):
    """A JSONL file saved with a UTF-8 byte-order mark (Windows editors) was refused with "Unexpected UTF-8 BOM
    (decode using utf-8-sig)"; it is read as the corpus reader reads text files."""
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + (GOOD + "\n" + json.dumps({"messages": conv("a", "b")}) + "\n").encode("utf-8"))
    convs = load_conversations(p)
    assert convs == [conv("hi", "ho"), conv("a", "b")] and convs.format == "messages" and convs.lines == [1, 2]
    p.write_bytes(b"\xff\xfe" + GOOD.encode("utf-16-le"))
    with pytest.raises(ValueError, match=r"bom\.jsonl is not UTF-8 text: .*it is UTF-16 text"):
        load_conversations(p)
