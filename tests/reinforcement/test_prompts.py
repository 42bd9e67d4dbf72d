"""The prompts file of a reinforcement-learning run: both row formats, the fields a reward needs, and bad rows
named by their line."""

import json

import pytest

from decoderlab.reinforcement.prompts import load_prompts
from decoderlab.reinforcement.rewards import load_reward


def write_rows(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_messages_and_trl_prompt_rows_with_their_fields(tmp_path):
    rows = [
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "cat story"}],
         "words": ["cat"]},
        "",
        {"prompt": "dog story", "words": ["dog"], "id": 7},
        {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "owl story"}], "words": ["owl"]},
    ]
    got = load_prompts(write_rows(tmp_path / "p.jsonl", rows), load_reward("contains_words"))
    assert [p.line for p in got] == [1, 3, 4]
    assert got[0].messages[-1] == {"role": "user", "content": "cat story"} and got[0].messages[0]["role"] == "system"
    assert got[1].messages == [{"role": "user", "content": "dog story"}]
    assert got[1].row == rows[2]  # the reward sees the row as written, every field included
    assert len(got[2].messages) == 3


def test_a_row_lacking_the_field_the_reward_needs_names_its_line(tmp_path):
    path = write_rows(tmp_path / "p.jsonl", [{"prompt": "a", "words": ["a"]}, {"prompt": "b", "words": ["b"]},
                                             {"prompt": "c", "reference": "c"}])
    with pytest.raises(ValueError, match=r"p\.jsonl, line 3: the 'contains_words' reward needs a 'words' field in "
                                         r"every row; this row has \['prompt', 'reference'\]"):
        load_prompts(path, load_reward("contains_words"))
    assert len(load_prompts(path)) == 3  # without a reward any fields do


def test_a_user_reward_declares_its_fields(tmp_path):
    def graded(reply, row, ended):
        return float(row["answer"] in reply)

    graded.fields = ("answer",)
    with pytest.raises(ValueError, match=r"row 2: the reward '.*graded' needs the field\(s\) \['answer'\]"):
        load_prompts([{"prompt": "a", "answer": "1"}, {"prompt": "b"}], graded)


@pytest.mark.parametrize("row, match", [
    ({"words": ["a"]}, 'needs "messages" .* or "prompt"'),
    ({"prompt": "a", "messages": []}, "not both"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "must end with a user message"),
    ({"prompt": 3}, "non-empty list of messages"),
    ("[1, 2]", "must be a JSON object"),
    ('{"prompt": "a"', "malformed JSON"),
])
def test_bad_rows_name_their_line(tmp_path, row, match):
    path = write_rows(tmp_path / "p.jsonl", [{"prompt": "fine"}, row])
    with pytest.raises(ValueError, match=rf"line 2: .*{match}"):
        load_prompts(path)


def test_missing_empty_and_non_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no prompts file"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no rows"):
        load_prompts(tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match="not a regular file"):
        load_prompts(tmp_path)
    with pytest.raises(ValueError, match="non-empty list"):
        load_prompts([])
