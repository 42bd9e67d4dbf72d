"""RL on a scripted reward whose optimum is known: reply with the two letters that follow the prompt's letter
("a" -> "bc"). The chance of that reply is computed exactly from the model's probabilities (the sampler's own
distribution: temperature 1, <PAD> and <EOS> suppressed), so a step's effect is measured without sampling
noise. A run moves the exact pass@1 from ~2% toward its optimum, 1; the same run with the advantages' sign
flipped moves it down -- the test fails when the policy gradient points the wrong way."""

import pytest
import torch

import decoderlab.reinforcement.rollouts as rollouts
from decoderlab.chat import TEMPLATES, add_chat_tokens
from decoderlab.config import RLConfig
from decoderlab.model import DecoderOnlyTransformer, preset
from decoderlab.reinforcement import train_rl
from decoderlab.reinforcement.prompts import load_prompts
from decoderlab.reinforcement.rewards import load_reward
from decoderlab.tokenizers import CharTokenizer
from decoderlab.training import TrainConfig

LETTERS = "abcde"
DL = TEMPLATES["decoderlab"]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the run below is for one thread's arithmetic
    yield
    torch.set_num_threads(n)


def target(c: str) -> str:
    i = LETTERS.index(c)
    return LETTERS[(i + 1) % 5] + LETTERS[(i + 2) % 5]


def setup():
    torch.manual_seed(0)
    tok = CharTokenizer.from_text(LETTERS)
    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=32, n_layer=1,
                                          n_head=2, max_len=16))
    model, tok, _ = add_chat_tokens(model, tok, "decoderlab")
    reward = load_reward("regex")
    prompts = load_prompts([{"prompt": c, "pattern": f"^{target(c)}"} for c in LETTERS], reward)
    return model, tok, reward, prompts


@torch.no_grad()
def exact_pass1(model, tok) -> float:
    """The mean over the prompts of P(the reply starts with the target), as the sampler draws: the product of
    the two tokens' probabilities at temperature 1 with <PAD> and <EOS> suppressed."""
    model.eval()
    suppress = [t for t in (tok.pad_id, tok.eos_id) if t is not None]
    total = 0.0
    for c in LETTERS:
        ids, _ = DL.render([{"role": "user", "content": c}], tok, add_generation_prompt=True)
        want = tok.encode(target(c))
        logits = model(torch.tensor([ids + want[:1]]))[0, -2:]
        logits[:, suppress] = float("-inf")
        p = torch.softmax(logits.double(), -1)
        total += float(p[0, want[0]] * p[1, want[1]])
    model.train()
    return total / len(LETTERS)


def run(model, tok, reward, prompts, steps=80, lr=3e-3):
    cfg = TrainConfig(max_steps=steps, batch_size=5, lr=lr, min_lr=lr, warmup=0, grad_clip=1.0,
                      weight_decay=0.0, log_every=1, eval_every=1000)
    _, history = train_rl(model, tok, DL, prompts, reward, accelerator="cpu", train_config=cfg,
                          rl_config=RLConfig(group_size=16, max_new_tokens=2))
    return history


def test_rl_moves_the_exact_pass_at_1_toward_its_known_optimum():
    model, tok, reward, prompts = setup()
    before = exact_pass1(model, tok)
    history = run(model, tok, reward, prompts)
    after = exact_pass1(model, tok)
    assert before < 0.05 and after > 0.8, (before, after)
    assert sum(h["reward"] for h in history[-5:]) / 5 > 0.7


def test_with_the_advantages_sign_flipped_the_same_run_moves_it_away(monkeypatch):
    right = rollouts.group_advantages
    monkeypatch.setattr(rollouts, "group_advantages", lambda r, g, scale=False: -right(r, g, scale))
    model, tok, reward, prompts = setup()
    before = exact_pass1(model, tok)
    run(model, tok, reward, prompts)
    assert exact_pass1(model, tok) < before / 2
