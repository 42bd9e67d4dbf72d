"""The one JSON Lines reader (decoderlab.jsonl) and its three users -- chat conversations, DPO's preference pairs,
RL's prompts: a UTF-8 byte-order mark, CRLF line ends, blank lines and a raw U+2028 / U+0085 inside a string are
accepted alike by all three, and a bad line is named by the number an editor shows, in the library and on the
command line."""

from __future__ import annotations

import json

import pytest

from decoderlab import cli
from decoderlab.chat import load_conversations
from decoderlab.finetuning.dpo import load_preferences
from decoderlab.jsonl import jsonl_rows
from decoderlab.reinforcement.prompts import load_prompts
from reinforcement.letters import letter_checkpoint

#: a separator Python's str.splitlines splits at, raw inside a JSON string (valid JSON, one JSON Lines line)
ODD = "a\u2028b\x85c"

ROWS = {
    "chat": [{"messages": [{"role": "user", "content": ODD}, {"role": "assistant", "content": "ok"}]},
             {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ODD}]}],
    "dpo": [{"prompt": ODD, "chosen": "yes", "rejected": "no"}, {"prompt": "hi", "chosen": ODD, "rejected": "no"}],
    "rl": [{"prompt": ODD, "pattern": "^a"}, {"prompt": "b", "pattern": "^b"}],
}
LOADERS = {"chat": load_conversations, "dpo": load_preferences, "rl": load_prompts}


def windows_file(path, rows, bad: bool = False) -> tuple:
    """``rows`` as a Windows editor saves them: a byte-order mark, CRLF, a blank line and one of spaces between
    the rows; with ``bad`` a malformed line after them. Returns ``(path, the rows' line numbers, the bad line's)``."""
    lines = [json.dumps(rows[0], ensure_ascii=False), "", "   ", json.dumps(rows[1], ensure_ascii=False)]
    if bad:
        lines.append('{"prompt": ')
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode("utf-8") + b"\r\n")
    return path, [1, 4], 5


def test_the_reader_counts_lines_at_newlines_only(tmp_path):
    path, lines, _ = windows_file(tmp_path / "x.jsonl", ROWS["rl"])
    assert [(n, obj) for n, obj in jsonl_rows(path, "x file")] == list(zip(lines, ROWS["rl"]))
    (tmp_path / "empty.jsonl").write_bytes(b"\xef\xbb\xbf\r\n  \r\n")
    with pytest.raises(ValueError, match=r"x file .*empty\.jsonl holds no rows \(it is empty\)"):
        list(jsonl_rows(tmp_path / "empty.jsonl", "x file"))


@pytest.mark.parametrize("kind", ["chat", "dpo", "rl"])
def test_every_reader_takes_a_byte_order_mark_crlf_blank_lines_and_raw_separators(tmp_path, kind):
    path, lines, _ = windows_file(tmp_path / f"{kind}.jsonl", ROWS[kind])
    got = LOADERS[kind](path)
    assert len(got) == 2
    if kind == "chat":
        assert got.lines == lines and got[0][0]["content"] == ODD and got[1][1]["content"] == ODD
    elif kind == "dpo":
        assert [p.line for p in got] == lines and got[0].prompt[0]["content"] == ODD
        assert got[1].chosen == [{"role": "assistant", "content": ODD}]
    else:
        assert [p.line for p in got] == lines and got[0].messages == [{"role": "user", "content": ODD}]
        assert got[1].row == ROWS["rl"][1]


@pytest.mark.parametrize("kind", ["chat", "dpo", "rl"])
def test_every_reader_names_a_bad_line_by_its_number(tmp_path, kind):
    path, _, bad = windows_file(tmp_path / f"{kind}.jsonl", ROWS[kind], bad=True)
    with pytest.raises(ValueError, match=rf"{kind}\.jsonl, line {bad}: malformed JSON: Expecting value"):
        LOADERS[kind](path)


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("decoderlab: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_finetune_names_the_bad_line_of_a_windows_file(tmp_path, capsys, method):
    path, _, bad = windows_file(tmp_path / "data.jsonl", ROWS["chat" if method == "sft" else "dpo"], bad=True)
    assert cli.main(["finetune", "--method", method, "--preset", "statquest", "--data", str(path), "--out",
                     str(tmp_path / "o"), "--max-steps", "1", "--no-progress-bar"]) == 2
    assert _one_error(capsys) == (f"decoderlab: error: {path}, line {bad}: malformed JSON: Expecting value "
                                  f"(column 12)")


def test_rl_names_the_bad_line_of_a_windows_prompts_file(tmp_path, capsys):
    path, _, bad = windows_file(tmp_path / "prompts.jsonl", ROWS["rl"], bad=True)
    checkpoint = letter_checkpoint(tmp_path / "base")
    assert cli.main(["rl", "--checkpoint", str(checkpoint), "--prompts", str(path), "--out", str(tmp_path / "o"),
                     "--reward", "regex", "--max-steps", "1", "--no-progress-bar"]) == 2
    assert _one_error(capsys) == (f"decoderlab: error: {path}, line {bad}: malformed JSON: Expecting value "
                                  f"(column 12)")
