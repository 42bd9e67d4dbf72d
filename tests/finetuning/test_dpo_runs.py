"""``finetune(method="dpo")``: TRL's preference rows against the frozen starting model -- the held-out reward
margin and accuracy rise from the start's (0 and 0), beta is honoured and kept on resume, and DPO and SFT
through LoRA adapters keep the adapter and the base given in memory (once), and load merged."""

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_runs import CONVS, chat_pair, one_thread, tiny_cfg  # noqa: F401  (one_thread: an autouse fixture)

from decoderlab.chat import load_model
from decoderlab.finetuning import PreferenceSummary, finetune
from decoderlab.lora import lora_parameter_count

PAIRS = [{"prompt": c[-2]["content"], "chosen": c[-1]["content"], "rejected": "no idea"} for c in CONVS]


def dpo(tmp_path, name, steps=12, **kw):
    model, tok = chat_pair()
    return finetune(PAIRS, out=tmp_path / name, base_model=(model, tok), method="dpo", val_fraction=0,
                    train_config=tiny_cfg(max_steps=steps, lr=1e-2, eval_every=steps), progress_bar=False,
                    logger=False, accelerator="cpu", **kw)


def test_dpo_raises_the_reward_margin_and_accuracy_of_the_preferred_replies(tmp_path):
    _, _, s = dpo(tmp_path, "dpo", beta=0.5)
    assert isinstance(s, PreferenceSummary) and s.beta == 0.5 and s.train_pairs == len(PAIRS) and s.steps == 12
    assert s.history[0]["loss"] == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-6)  # policy = reference
    assert s.evaluation["reward_margin"] > 0.5 and s.evaluation["reward_accuracy"] == 1.0, s.evaluation
    assert s.history[-1]["loss"] < s.history[0]["loss"]
    info = json.loads((tmp_path / "dpo" / "run.json").read_text())
    assert info["method"] == "dpo" and info["beta"] == 0.5
    assert load_model(tmp_path / "dpo").meta["method"] == "dpo"


def test_a_resume_keeps_the_run_s_beta_and_method(tmp_path):
    dpo(tmp_path, "dpo", steps=2)
    with pytest.raises(ValueError, match=r"with beta=0\.3: the run was trained with beta=0\.1"):
        finetune(resume=tmp_path / "dpo", out=tmp_path / "dpo", beta=0.3, progress_bar=False, logger=False,
                 accelerator="cpu")
    with pytest.raises(ValueError, match=r"method='sft': it was trained with method='dpo'"):
        finetune(resume=tmp_path / "dpo", out=tmp_path / "dpo", method="sft", progress_bar=False, logger=False,
                 accelerator="cpu")
    with pytest.raises(ValueError, match=r"beta=0\.3 applies to method='dpo'"):
        finetune(CONVS, out=tmp_path / "sft", base_model=chat_pair(), beta=0.3, train_config=tiny_cfg())


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_lora_trains_the_adapters_only_and_keeps_the_adapter_and_its_base(tmp_path, method):
    model, tok = chat_pair()
    expected = lora_parameter_count(model, 2, "attn")  # (before the run: it puts the adapters on model)
    data = PAIRS if method == "dpo" else CONVS
    merged, _, s = finetune(data, out=tmp_path / "run", base_model=(model, tok), method=method, val_fraction=0,
                            eval_prompts=0, train_config=tiny_cfg(max_steps=3, lr=1e-2, eval_every=3),
                            lora={"rank": 2, "targets": "attn"}, progress_bar=False,
                            logger=False, accelerator="cpu")
    assert s.trainable_parameters == expected and s.lora["rank"] == 2
    assert not (tmp_path / "run" / "model.safetensors").exists()  # the adapter, and the base kept once
    weights = load_file(tmp_path / "run" / "adapter" / "adapter_model.safetensors")
    assert weights and all("lora" in k for k in weights)
    assert (tmp_path / "run" / "base" / "model.safetensors").is_file()
    loaded = load_model(tmp_path / "run").model
    x = torch.randint(0, tok.vocab_size, (2, 8))
    torch.testing.assert_close(loaded(x), merged(x), atol=1e-6, rtol=0)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["lora"]["targets"] == ["attn"]
