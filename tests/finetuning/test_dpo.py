"""DPO: the loss against a float64 computation from the four log-probabilities, log 2 and zero gradient for
chosen == rejected, the implicit rewards, and a few Lightning steps that raise the reward accuracy."""

import math

import pytest
import torch
from tiny_runs import one_thread  # noqa: F401  (an autouse fixture: one thread)

from decoderlab.chat import TEMPLATES, add_chat_tokens
from decoderlab.model import DecoderOnlyTransformer, preset
from decoderlab.tokenizers import CharTokenizer
from decoderlab.training import TrainConfig, make_trainer
from decoderlab.finetuning.dpo import (DPODataModule, DPOModule, PreferenceBatches, build_preference_examples,
                                       dpo_loss, load_preferences, render_pair, sequence_logprobs)
from decoderlab.training.rows import IGNORE_INDEX


def test_dpo_loss_equals_a_float64_computation_from_the_four_log_probabilities():
    pc = torch.tensor([-3.2, -10.0, -0.5, -7.25], dtype=torch.float64, requires_grad=True)
    pr = torch.tensor([-4.0, -2.0, -0.5, -20.0], dtype=torch.float64, requires_grad=True)
    rc = torch.tensor([-3.0, -9.0, -1.5, -7.0], dtype=torch.float64)
    rr = torch.tensor([-3.5, -3.0, -0.25, -18.0], dtype=torch.float64)
    beta = 0.3
    losses, cr, rrw = dpo_loss(pc, pr, rc, rr, beta)
    losses.sum().backward()
    for i in range(4):
        z = beta * ((pc[i].item() - rc[i].item()) - (pr[i].item() - rr[i].item()))
        assert losses[i].item() == pytest.approx(math.log(1 + math.exp(-z)), abs=1e-12)  # -log sigmoid(z)
        dz = -1 / (1 + math.exp(z))  # d(-log sigmoid z)/dz = -sigmoid(-z)
        assert pc.grad[i].item() == pytest.approx(beta * dz, abs=1e-12)
        assert pr.grad[i].item() == pytest.approx(-beta * dz, abs=1e-12)
        assert cr[i].item() == pytest.approx(beta * (pc[i].item() - rc[i].item()), abs=1e-12)
        assert rrw[i].item() == pytest.approx(beta * (pr[i].item() - rr[i].item()), abs=1e-12)
    assert not cr.requires_grad and not rrw.requires_grad
    with pytest.raises(ValueError, match="beta must be a finite number > 0, got 0"):
        dpo_loss(pc, pr, rc, rr, 0)


def chat_pair(seed=0):
    torch.manual_seed(seed)
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz .?")
    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=16, n_layer=1,
                                          n_head=2, max_len=32))
    model, tok, _ = add_chat_tokens(model, tok, "decoderlab")
    return model, tok


PAIRS = [{"prompt": "name a colour", "chosen": "red", "rejected": "seven"},
         {"prompt": "say yes", "chosen": "yes", "rejected": "no"},
         {"prompt": "a number?", "chosen": "two", "rejected": "cat"},
         {"prompt": "an animal?", "chosen": "dog", "rejected": "blue"}]


def examples(tok, rows=PAIRS, max_len=32):
    pairs = load_preferences(rows)
    return build_preference_examples([render_pair(p, tok, "decoderlab") for p in pairs], max_len,
                                     [p.line for p in pairs])


def test_chosen_equal_to_rejected_gives_log_2_and_zero_gradient():
    model, tok = chat_pair()
    reference, _ = chat_pair(seed=1)  # another model: the log-ratio is not 0, only the difference is
    same = [{"prompt": p["prompt"], "chosen": p["chosen"], "rejected": p["chosen"]} for p in PAIRS]
    x, y, _ = PreferenceBatches(examples(tok, same).rows, 4, 1, 0, tok.pad_id)[0]
    logp = sequence_logprobs(model(x), y)
    with torch.no_grad():
        ref = sequence_logprobs(reference(x), y)
    losses, cr, rr = dpo_loss(logp[:4], logp[4:], ref[:4], ref[4:], 0.1)
    losses.mean().backward()
    assert losses.tolist() == pytest.approx([math.log(2)] * 4, abs=1e-6)
    assert (cr != 0).all() and torch.allclose(cr, rr, atol=1e-6, rtol=0)
    for n, p in model.named_parameters():
        assert p.grad is None or p.grad.abs().max() < 1e-7, n


def test_preference_rows_shift_once_and_pad_chosen_then_rejected():
    _, tok = chat_pair()
    ex = examples(tok)
    assert len(ex.rows) == 4 and ex.lines == [1, 2, 3, 4] and ex.truncated == ex.dropped == 0
    x, y, step_pairs = PreferenceBatches(ex.rows, 2, 2, seed=0, pad_id=tok.pad_id)[1]
    assert x.shape[0] == 4 and int(step_pairs) == 4
    eot = TEMPLATES["decoderlab"].end_of_turn_id(tok)
    texts = [tok.decode([t for t in row if t != IGNORE_INDEX][:-1]) for row in y.tolist()]
    ends = [[t for t in row if t != IGNORE_INDEX][-1] for row in y.tolist()]
    by_chosen = {p["chosen"]: p["rejected"] for p in PAIRS}
    assert texts[2:] == [by_chosen[t] for t in texts[:2]] and ends == [eot] * 4  # row i's rejected is row i + B
    short = examples(tok, max_len=8)  # "<|user|>name a colour<|end|><|assistant|>" is longer than 8 tokens
    assert short.dropped >= 1 and short.truncated >= short.dropped and len(short.rows) == 4 - short.dropped


def test_a_few_dpo_steps_raise_the_reward_accuracy_and_margin():
    model, tok = chat_pair()
    reference, _ = chat_pair()  # the starting model, frozen
    cfg = TrainConfig(max_steps=15, batch_size=4, lr=2e-2, min_lr=2e-2, warmup=0, grad_clip=1.0, log_every=1,
                      eval_every=15, weight_decay=0.0)
    ex = examples(tok)
    data = DPODataModule(ex, ex, batch_size=4, accumulate=1, seed=0, pad_id=tok.pad_id)
    module = DPOModule(model, cfg, reference, beta=0.5)
    trainer = make_trainer(cfg, None, accelerator="cpu", progress_bar=False, logger=False, checkpointing=False)
    trainer.fit(module, datamodule=data)
    h = module.history
    assert len(h) == 15 and h[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and h[0]["reward_margin"] == 0
    assert h[-1]["loss"] < 0.2 and h[-1]["reward_accuracy"] == 1.0 and h[-1]["reward_margin"] > 2
    assert h[-1]["chosen_reward"] > h[-1]["rejected_reward"]
    assert module.val_history and module.val_history[-1][1] < 0.2
    assert all(not p.requires_grad for p in reference.parameters())
