"""``decoderlab.rl``: a tiny run raises the mean reward and leaves a chat checkpoint with its curves; a resume
(with and without LoRA adapters) equals the uninterrupted run; LoRA trains the adapters only and keeps them with
a pointer to the base; the refusals name what is wrong."""

import json
import os

import pytest
import torch
from support.interaction import InterruptAt
from safetensors.torch import load_file

from decoderlab.chat import load_model
from decoderlab.config import RLConfig
from decoderlab.reinforcement.rewards import RewardError
from decoderlab.lora import lora_parameter_count
from decoderlab.reinforcement import PLOT_FILE, rl
from decoderlab.training import TrainingInterrupted

from .letters import letter_checkpoint, letter_prompts

FAST = dict(lr=1e-2, min_lr=1e-2, log_every=5, batch_size=4)


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the learning curve below is for one thread's arithmetic
    yield
    torch.set_num_threads(n)


@pytest.fixture
def base(tmp_path):
    return letter_checkpoint(tmp_path / "base"), letter_prompts(tmp_path / "prompts.jsonl")


def go(base, out, steps, resume=None, callbacks=(), **kw):
    checkpoint, prompts = base
    return rl(None if resume else prompts, out=out, checkpoint=None if resume else checkpoint, reward=kw.pop("reward", "regex"),
              rl_config=None if resume else RLConfig(**{"group_size": 8, "max_new_tokens": 2, "scale_rewards": True,
                                                        **kw.pop("rl", {})}),
              config_overrides={**({} if resume else FAST), "max_steps": steps, **kw.pop("train", {})}, resume=resume,
              accelerator="cpu", progress_bar=False, logger=False, callbacks=callbacks, **kw)


def test_a_tiny_run_raises_the_mean_reward_and_writes_a_chat_checkpoint_with_its_curves(base, tmp_path):
    out = tmp_path / "run"
    model, tok, s = go(base, out, 30, train={"eval_every": 10})
    assert s.steps == 30 and len(s.history) == 30 and s.reward == "regex" and s.group_size == 8
    assert s.reward_end > s.reward_start + 0.3, (s.reward_start, s.reward_end)
    assert (out / PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and s.plot == str(out / PLOT_FILE)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["history"] == s.history and [h["step"] for h in s.history] == list(range(1, 31))
    assert all(h["kl"] >= 0 and 0 <= h["end_of_turn_rate"] <= 1 and h["reply_length"] <= 2 for h in s.history)
    loaded = load_model(out)
    assert loaded.template.name == "decoderlab" and loaded.meta["method"] == "rl" and loaded.meta["step"] == 30
    for a, b in zip(model.state_dict().values(), loaded.model.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.load(out / "lightning" / "last.ckpt", weights_only=False)["global_step"] == 30


@pytest.mark.parametrize("lora", [None, {"rank": 2}, {"rank": 2, "dropout": 0.3}],
                         ids=["full", "lora", "lora-dropout"])
def test_resume_equals_an_uninterrupted_run(base, tmp_path, lora):
    kw = dict(train={"eval_every": 2, "accumulate": 2, "batch_size": 2}, rl={"kl_coef": 0.1, "group_size": 4},
              lora=lora)
    full, _, s_full = go(base, tmp_path / "full", 6, **kw)
    with pytest.raises(TrainingInterrupted):
        go(base, tmp_path / "cut", 6, callbacks=[InterruptAt(4)], **kw)
    assert json.loads((tmp_path / "cut" / "meta.json").read_text())["step"] == 4
    resumed, _, s = go(base, tmp_path / "cut", 6, resume=tmp_path / "cut", train={})
    assert s.history == s_full.history and s.history[-1]["kl"] > 0 and len(s.history) == 6
    for (n, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), n
    ckpts = tmp_path / "cut" / "lightning"  # the newest checkpoint under both names: one file
    assert sorted(p.name for p in ckpts.iterdir()) == ["best-step6.ckpt", "last.ckpt"]
    assert os.path.samefile(ckpts / "last.ckpt", ckpts / "best-step6.ckpt")
    if lora is not None:  # the adapter and a pointer to the base (the starting checkpoint), no copy of it
        assert not (tmp_path / "cut" / "model.safetensors").exists()
        assert json.loads((tmp_path / "cut" / "meta.json").read_text())["base"] == str(base[0].resolve())
        weights = load_file(tmp_path / "cut" / "adapter" / "adapter_model.safetensors")
        assert weights and all("lora" in k for k in weights)
        assert s.trainable_parameters == lora_parameter_count(load_model(tmp_path / "cut").model, 2)
        assert s.lora == {"rank": 2, "alpha": 2.0, "dropout": lora.get("dropout", 0.0), "targets": ["attn", "mlp"]}


def test_a_base_model_without_a_chat_template_is_told_to_fine_tune_first(tmp_path):
    plain = letter_checkpoint(tmp_path / "plain", template=False)
    with pytest.raises(ValueError, match=r"plain has no chat template \(it is a base model\).*fine-tune it on "
                                         r"conversations first"):
        go((plain, letter_prompts(tmp_path / "p.jsonl")), tmp_path / "run", 2)
    assert not (tmp_path / "run" / "run.json").exists()


@pytest.mark.parametrize("rows, says", [
    ([{"prompt": "a", "pattern": "^a"}, {"prompt": "b"}], r"line 2.*'pattern'"),
])
def test_prompts_lacking_a_field_the_reward_needs_name_the_line(tmp_path, rows, says):
    base = (letter_checkpoint(tmp_path / "base"), letter_prompts(tmp_path / "p.jsonl", rows))
    with pytest.raises(ValueError, match=says):
        go(base, tmp_path / "run", 2)


def test_one_reply_per_prompt_is_refused(base, tmp_path):
    with pytest.raises(ValueError, match=r"group_size must be an integer >= 2 .*every advantage is 0.*got 1"):
        go(base, tmp_path / "run", 2, rl={"group_size": 1})


def test_a_reward_returning_a_non_number_names_the_prompt_and_keeps_the_last_checkpoint(base, tmp_path):
    calls = []

    def reward(reply, row, ended):
        calls.append(reply)
        return 1.0 if len(calls) <= 2 * 4 * 8 else "yes"

    out = tmp_path / "run"
    with pytest.raises(RewardError, match=r"returned 'yes' \(str\) for a reply to the prompt on line \d .*must "
                                          r"return a finite number"):
        go(base, out, 6, reward=reward, train={"eval_every": 1})
    assert json.loads((out / "meta.json").read_text())["step"] == 2


def test_another_reward_or_batch_size_on_resume_is_refused(base, tmp_path):
    go(base, tmp_path / "run", 2, train={"eval_every": 2})
    with pytest.raises(ValueError, match=r"cannot resume .* with batch_size=2: the run was trained with batch_size=4"):
        go(base, tmp_path / "run", 4, resume=tmp_path / "run", train={"batch_size": 2})
    with pytest.raises(ValueError, match=r"cannot resume .* with reward='exact': the run was trained with "
                                         r"reward='regex'"):
        rl(resume=tmp_path / "run", out=tmp_path / "run", reward="exact", config_overrides={"max_steps": 4},
           accelerator="cpu", progress_bar=False, logger=False)
