"""The lesson's training: the checkpoint stores the lesson's template, and the lesson's numbers hold through the
one chat path -- also for a checkpoint an earlier version wrote ("task": "pairs", no template)."""

import json

from decoderlab import cli
from decoderlab.chat import TEMPLATES
from decoderlab.checkpoint import load_checkpoint, read_meta, save_checkpoint
from decoderlab.lesson import LESSON_TEMPLATE


def test_the_checkpoint_stores_the_lesson_template(statquest_checkpoint):
    meta = read_meta(statquest_checkpoint)
    assert meta["task"] == "chat" and meta["chat_template"] == LESSON_TEMPLATE == TEMPLATES["lesson"].to_dict()
    assert sorted(p.name for p in statquest_checkpoint.iterdir()) == [
        "config.json", "lightning", "meta.json", "model.safetensors", "run.json", "tokenizer.json"]  # resumable


def test_new_and_old_lesson_checkpoints_answer_awesome(statquest_checkpoint, tmp_path, capsys):
    """`generate` (and `generate --chat`) answer both lesson prompts with "awesome <EOS>", from this version's
    checkpoint and from one with the old "pairs" task."""
    old = save_checkpoint(tmp_path / "old", *load_checkpoint(statquest_checkpoint), meta={"task": "pairs"})
    assert "chat_template" not in json.loads((old / "meta.json").read_text())
    for ckpt in (statquest_checkpoint, old):
        for prompt in ("what is statquest", "statquest is what"):
            for chat in ([], ["--chat"]):
                assert cli.main(["generate", *chat, "--checkpoint", str(ckpt), prompt]) == 0
                assert capsys.readouterr().out == "awesome <EOS>\n", (ckpt, prompt, chat)
