"""Resume is exact with dropout: the random state that dropout draws from is saved with the training checkpoint
and put back before the next step, for train (--dropout), finetune (--lora-dropout) and rl (a LoRA with
dropout): 4 steps + a resume to 8 equal 8 steps uninterrupted, bit for bit."""

import random

import numpy as np
import pytest
import torch
from tiny_runs import (CONVS, TINY, StopAt, cache, chat_pair, one_thread, text, tiny_cfg,  # noqa: F401
                       tiny_config)

from decoderlab.finetuning import finetune
from decoderlab.training import train_lm
from decoderlab.training.random_state import RandomState, collect_states, restore_states


def _equal_weights(a, b):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


def test_train_with_dropout_resumes_bit_identical(tmp_path, text, cache):
    shape = {**TINY, "dropout": 0.2}
    common = dict(model_overrides=shape, cache_dir=cache, accelerator="cpu", progress_bar=False)
    whole, _, s_whole = train_lm(text=text, out=tmp_path / "whole", train_config=tiny_config(), **common)
    train_lm(text=text, out=tmp_path / "cut", train_config=tiny_config(), callbacks=[StopAt(4)], **common)
    resumed, _, s = train_lm(text=text, resume=tmp_path / "cut", **common)
    assert s.steps == 8
    assert s.train_losses == s_whole.train_losses
    _equal_weights(whole, resumed)


def test_finetune_with_lora_dropout_resumes_bit_identical(tmp_path):
    cfg = tiny_cfg(max_steps=8, batch_size=2, eval_every=4, lr=1e-2)
    lora = {"rank": 2, "dropout": 0.3}
    common = dict(val_fraction=0, eval_prompts=1, eval_max_new_tokens=2, progress_bar=False, logger=False,
                  accelerator="cpu", lora=lora)
    model, tok = chat_pair()
    whole, _, s_whole = finetune(CONVS, out=tmp_path / "whole", base_model=(model, tok), train_config=cfg, **common)
    model, tok = chat_pair()
    finetune(CONVS, out=tmp_path / "cut", base_model=(model, tok), train_config=cfg, callbacks=[StopAt(4)], **common)
    resumed, _, s = finetune(CONVS, out=tmp_path / "cut", resume=True, **common)
    assert s.steps == 8
    assert s.train_losses == s_whole.train_losses
    _equal_weights(whole, resumed)


def test_the_states_come_back_as_they_were():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    saved = collect_states()
    want = (random.random(), float(np.random.rand()), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_states(saved)
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[:2] == want[:2] and torch.equal(got[2], want[2])


def test_a_checkpoint_of_another_number_of_processes_draws_anew():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    cb = RandomState()
    torch.manual_seed(6)
    cb.load_state_dict({"ranks": [collect_states(), collect_states()]})
    torch.manual_seed(5)
    cb.restore(world_size=1, rank=0)
    assert torch.equal(torch.get_rng_state(), before)
    cb.load_state_dict({"ranks": [collect_states()]})
    torch.manual_seed(7)
    cb.restore(world_size=1, rank=0)
    assert torch.equal(torch.get_rng_state(), before)  # its own state: the one saved after seed 5


def test_the_states_load_with_weights_only(tmp_path):
    """FSDP's resume reads the checkpoint with torch.load(weights_only=True): the saved states must be plain
    tensors, lists and numbers (NumPy's own state array was refused there), and still come back exactly."""
    import random

    import numpy as np

    from decoderlab.training.random_state import collect_states, restore_states

    torch.save({"ranks": [collect_states()]}, tmp_path / "s.pt")
    want = (torch.rand(3), random.random(), np.random.rand(3))
    restore_states(torch.load(tmp_path / "s.pt", weights_only=True)["ranks"][0])
    got = (torch.rand(3), random.random(), np.random.rand(3))
    assert torch.equal(want[0], got[0]) and want[1] == got[1] and (want[2] == got[2]).all()
