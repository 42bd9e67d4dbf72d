"""DPO's preference rows (TRL's prompt/chosen/rejected, as text or messages), rendered with the chat template
with the loss mask on the completion only; bad rows named by their line."""

import json

import pytest

from decoderlab.chat import TEMPLATES, add_chat_tokens
from decoderlab.finetuning.dpo import load_preferences, render_pair
from decoderlab.tokenizers import CharTokenizer


def write_rows(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def chat_tokenizer():
    return add_chat_tokens(None, CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz .?!"), "decoderlab")[1]


def test_text_and_message_rows_render_with_the_mask_on_the_completion_only(tmp_path):
    rows = [{"prompt": "name a colour", "chosen": "red", "rejected": "seven"},
            {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                        {"role": "user", "content": "name a colour"}],
             "chosen": [{"role": "assistant", "content": "blue"}], "rejected": "cat"}]
    pairs = load_preferences(write_rows(tmp_path / "prefs.jsonl", rows))
    assert [p.line for p in pairs] == [1, 2]
    assert pairs[0].prompt == [{"role": "user", "content": "name a colour"}]
    assert pairs[1].rejected == [{"role": "assistant", "content": "cat"}]
    tok = chat_tokenizer()
    for template in ("decoderlab", "lesson"):
        t = TEMPLATES[template]
        for pair, (chosen, rejected) in zip(pairs, (("red", "seven"), ("blue", "cat"))):
            (cids, cmask), (rids, rmask) = render_pair(pair, tok, t)
            eot = t.end_of_turn_id(tok)
            assert tok.decode([i for i, m in zip(cids, cmask) if m]) == tok.decode(tok.encode(chosen) + [eot])
            assert tok.decode([i for i, m in zip(rids, rmask) if m]) == tok.decode(tok.encode(rejected) + [eot])
            n = len(t.render(pair.prompt, tok, add_generation_prompt=True)[0])
            assert cids[:n] == rids[:n] and not any(cmask[:n])  # the shared prompt (earlier replies too) is context


@pytest.mark.parametrize("row, match", [
    ({"prompt": "a", "rejected": "b"}, "lacks 'chosen'"),
    ({"prompt": "a"}, "lacks 'chosen', 'rejected'"),
    ({"prompt": "a", "chosen": "b", "rejected": ""}, '"rejected" is empty'),
    ({"prompt": "a", "chosen": "b", "rejected": "  "}, '"rejected" is empty'),
    ({"prompt": "a", "chosen": "b", "rejected": []}, '"rejected" is empty'),
    ({"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant", "content": ""}]}, '"rejected" is empty'),
    ({"prompt": "a", "chosen": [{"role": "user", "content": "b"}], "rejected": "c"},
     '"chosen" must start with an assistant message'),
    ({"prompt": "a", "chosen": "b", "rejected": "c", "score": 1}, "unexpected key"),
    ({"prompt": [{"role": "assistant", "content": "x"}], "chosen": "b", "rejected": "c"}, "assistant turn before"),
])
def test_bad_preference_rows_name_their_line(tmp_path, row, match):
    path = write_rows(tmp_path / "prefs.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, row])
    with pytest.raises(ValueError, match=rf"prefs\.jsonl, line 2: .*{match}"):
        load_preferences(path)
