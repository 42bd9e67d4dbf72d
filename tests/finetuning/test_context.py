"""Conversations and the context in a fine-tuning run: an evaluation prompt that cannot fit is a data error
found before the first step (it was found after every step had run, exit 2 and no summary.json), and a tools
conversation longer than the context is evaluated with whole exchanges dropped."""

import json

import pytest
from tiny_runs import TINY_CHAT, chat_pair, conv, one_thread, tiny_cfg  # noqa: F401

from decoderlab.finetuning import finetune


def test_an_evaluation_prompt_too_long_for_the_context_is_refused_before_training(tmp_path):
    data = [conv("hi", "ho", "b" * 60, "ok")] * 2  # "ho" is within max_len 48; the last prompt alone is not
    out = tmp_path / "r"
    with pytest.raises(ValueError, match=r"evaluation prompt of conversation 0 .*last user message alone renders "
                                         r"to \d+ tokens.*max_len=48"):
        finetune(data, out=out, base_model=chat_pair(), train_config=tiny_cfg(), val_fraction=0,
                 progress_bar=False, logger=False, accelerator="cpu")
    assert not (out / "lightning").exists() and not (out / "summary.json").exists()  # no step was run


def _tool_conv(i):
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": i, "b": 2}}}
    return [{"role": "user", "content": f"{i} plus 2"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": str(i + 2)}, {"role": "assistant", "content": str(i + 2)}]


def test_a_tools_conversation_longer_than_the_context_is_evaluated_whole_exchanges_dropped(tmp_path):
    convs = [_tool_conv(i) + _tool_conv(i + 1) for i in range(4)]  # two exchanges: longer than max_len 64
    path = tmp_path / "calls.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    _, _, s = finetune(str(path), out=tmp_path / "r", preset="baby-shakespeare", template="tools",
                       model_overrides=dict(TINY_CHAT, max_len=64), train_config=tiny_cfg(), val_fraction=0,
                       eval_prompts=2, eval_max_new_tokens=2, progress_bar=False, logger=False, accelerator="cpu")
    assert s.evaluation["prompts"] == 2 and (tmp_path / "r" / "summary.json").is_file()


def test_ctrl_c_before_the_first_evaluation_keeps_a_resumable_checkpoint(tmp_path, capsys):
    """Ctrl-C in finetune before its first evaluation left a directory that could neither be resumed ("no
    training checkpoint") nor reused ("already holds a training run"): now it keeps lightning/last.ckpt at the
    steps done, and the resume reaches the run's end."""
    from support.interaction import InterruptAt
    from tiny_runs import CONVS

    from decoderlab.training import TrainingInterrupted

    cfg = tiny_cfg(max_steps=6, batch_size=2, eval_every=5, lr=1e-2)
    common = dict(val_fraction=0, eval_prompts=1, eval_max_new_tokens=2, progress_bar=False, logger=False,
                  accelerator="cpu")
    out = tmp_path / "cut"
    with pytest.raises(TrainingInterrupted):
        finetune(CONVS, out=out, base_model=chat_pair(), train_config=cfg, callbacks=[InterruptAt(2)], **common)
    err = capsys.readouterr().err
    assert "interrupted at step 2; a training checkpoint at step 2 was kept" in err
    assert (out / "lightning" / "last.ckpt").is_file()
    _, _, s = finetune(CONVS, out=out, resume=True, **common)
    assert s.steps == 6 and len(s.train_losses) == 6
