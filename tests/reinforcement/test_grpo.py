"""The GRPO-style policy-gradient loss: a hand-made batch against a float64 computation by hand, zero gradient
for equal rewards, G = 1 refused, and per-token normalisation over the whole step across accumulation."""

import math

import lightning as L
import pytest
import torch

from decoderlab.config import RLConfig
from decoderlab.model import DecoderOnlyTransformer, preset
from decoderlab.training import TrainConfig, make_trainer
from decoderlab.reinforcement.grpo import (STD_EPS, RLModule, Rollout, group_advantages, policy_gradient_loss,
                                      token_logprobs)
from decoderlab.training.rows import IGNORE_INDEX

V, T = 7, 5
REWARDS = [1.0, 0.0, 0.5, 2.0, 3.0, -1.0]  # 2 prompts x 3 replies
#: which positions hold sampled tokens (1) -- prompt positions and right padding are -100
MASKS = [[0, 1, 1, 1, 0], [0, 1, 0, 0, 0], [0, 1, 1, 1, 1],
         [0, 0, 1, 1, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 1]]


def hand_batch(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, T, V, generator=g, dtype=torch.float64) * 2
    ref = torch.randn(6, T, V, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (6, T), generator=g)
    labels = torch.where(torch.tensor(MASKS, dtype=torch.bool), tokens, torch.full_like(tokens, IGNORE_INDEX))
    return logits.to(dtype).requires_grad_(True), ref.to(dtype), labels


def by_hand(logits, ref, labels, rewards, scale, kl_coef):
    """The loss, its gradient with respect to the logits and the advantages, in float64 with plain Python."""
    lg, rf, lab = logits.detach().double().tolist(), ref.double().tolist(), labels.tolist()
    adv = []
    for k in range(2):
        group = rewards[3 * k : 3 * k + 3]
        mean = sum(group) / 3
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / 2)  # Bessel's, as torch.std and TRL
        adv += [(r - mean) / (std + STD_EPS) if scale else r - mean for r in group]
    n = sum(map(sum, MASKS))
    loss, grad = 0.0, [[[0.0] * V for _ in range(T)] for _ in range(6)]
    for i in range(6):
        for t in range(T):
            if lab[i][t] == IGNORE_INDEX:
                continue
            y = lab[i][t]
            lse = math.log(sum(math.exp(z) for z in lg[i][t]))
            lp = lg[i][t][y] - lse
            ref_lp = rf[i][t][y] - math.log(sum(math.exp(z) for z in rf[i][t]))
            d = ref_lp - lp
            loss += (-adv[i] * lp + kl_coef * (math.exp(d) - d - 1)) / n
            # d/dlogit_v of (-A lp + c (e^d - d - 1)), d = ref - lp: (-A + c (1 - e^d)) (1[v=y] - softmax_v)
            coef = (-adv[i] + kl_coef * (1 - math.exp(d))) / n
            for v in range(V):
                grad[i][t][v] = coef * ((v == y) - math.exp(lg[i][t][v] - lse))
    return loss, torch.tensor(grad, dtype=torch.float64), adv


@pytest.mark.parametrize("scale", [False, True])
@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
def test_hand_made_batch_equals_a_float64_computation_by_hand(scale, kl_coef):
    logits, ref, labels = hand_batch()
    want_loss, want_grad, want_adv = by_hand(logits, ref, labels, REWARDS, scale, kl_coef)
    adv = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), 3, scale=scale)
    assert adv.tolist() == pytest.approx(want_adv, abs=1e-12)
    n = int((labels != IGNORE_INDEX).sum())
    assert n == sum(map(sum, MASKS)) == 14
    loss = policy_gradient_loss(logits, labels, adv, n, ref_logits=ref if kl_coef else None, kl_coef=kl_coef)
    loss.backward()
    assert float(loss) == pytest.approx(want_loss, abs=1e-12)
    assert torch.allclose(logits.grad, want_grad, atol=1e-12, rtol=0)
    # the same batch in float32 (the training dtype) within float32's precision
    l32, r32, _ = hand_batch(torch.float32)
    loss32 = policy_gradient_loss(l32, labels, adv.float(), n, ref_logits=r32 if kl_coef else None, kl_coef=kl_coef)
    assert float(loss32) == pytest.approx(want_loss, abs=1e-5)


def test_equal_rewards_in_a_group_give_that_group_zero_gradient():
    logits, _, labels = hand_batch()
    rewards = [0.7, 0.7, 0.7, 0.0, 1.0, 0.0]  # the first group all alike
    for scale in (False, True):
        logits.grad = None
        adv = group_advantages(torch.tensor(rewards, dtype=torch.float64), 3, scale=scale)
        policy_gradient_loss(logits, labels, adv, 14).backward()
        assert torch.count_nonzero(logits.grad[:3]) == 0
        assert torch.count_nonzero(logits.grad[3:]) > 0
    logits.grad = None
    loss = policy_gradient_loss(logits, labels, group_advantages(torch.full((6,), 2.5), 3, scale=True), 14)
    loss.backward()
    assert float(loss) == 0.0 and torch.count_nonzero(logits.grad) == 0


def test_masked_positions_have_zero_log_probability_and_gradient():
    logits, _, labels = hand_batch()
    lp = token_logprobs(logits, labels)
    assert (lp[labels == IGNORE_INDEX] == 0).all() and (lp[labels != IGNORE_INDEX] < 0).all()
    policy_gradient_loss(logits, labels, torch.ones(6, dtype=torch.float64), 14).backward()
    assert torch.count_nonzero(logits.grad[labels == IGNORE_INDEX]) == 0


def test_one_reply_per_prompt_is_refused():
    with pytest.raises(ValueError, match="group_size must be an integer >= 2 .*every advantage is 0"):
        group_advantages(torch.ones(4), 1)
    with pytest.raises(ValueError, match="group_size must be an integer >= 2 .*nothing is learned"):
        RLConfig(group_size=1)
    with pytest.raises(ValueError, match=r"shape \(prompts \* group_size,\)"):
        group_advantages(torch.ones(5), 2)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        RLConfig(temperature=0)


# ---------------------------------------------------------------------------------------------------------
# The Lightning module: the gradient of one step does not depend on how it is accumulated
# ---------------------------------------------------------------------------------------------------------


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=V, d_model=16, n_layer=1, n_head=2,
                                         max_len=8))


def fixed_rollout(accumulate):
    """Rows of different lengths and token counts, split into ``accumulate`` micro-batches."""
    _, _, labels = hand_batch()
    g = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, V, (6, T), generator=g)
    adv = group_advantages(torch.tensor(REWARDS), 3)
    per = 6 // accumulate
    micro = [(inputs[m * per : (m + 1) * per], labels[m * per : (m + 1) * per], adv[m * per : (m + 1) * per])
             for m in range(accumulate)]
    return Rollout(micro, 14, REWARDS, [1] * 6, [True] * 6)


class GradCapture(L.Callback):
    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.clone() for n, p in pl_module.model.named_parameters()})


def step_gradient(accumulate, kl):
    model = tiny_model()
    cfg = TrainConfig(max_steps=1, batch_size=6 // accumulate, accumulate=accumulate, warmup=0, grad_clip=0.0,
                      log_every=1, eval_every=1)
    calls = []

    def sample(m, step):
        calls.append(step)
        return fixed_rollout(accumulate)

    ref = tiny_model(seed=1) if kl else None
    module = RLModule(model, cfg, sample, reference=ref, kl_coef=0.5 if kl else 0.0)
    cap = GradCapture()
    trainer = make_trainer(cfg, None, accelerator="cpu", callbacks=[cap], progress_bar=False, logger=False,
                           checkpointing=False)
    trainer.fit(module)
    assert calls == [0]  # one rollout per optimizer step, sampled before its first micro-batch
    return cap.grads[0], module.history, ref


@pytest.mark.parametrize("kl", [False, True])
def test_accumulated_micro_batches_give_the_gradient_of_the_whole_step(kl):
    g1, h1, ref = step_gradient(1, kl)
    g3, h3, _ = step_gradient(3, kl)
    for n in g1:
        assert torch.allclose(g1[n], g3[n], atol=1e-7, rtol=1e-5), n
    # and both equal the gradient of the loss over all six rows divided by the step's 14 tokens
    model = tiny_model()
    r = fixed_rollout(1)
    x, y, adv = r.micro_batches[0]
    loss = policy_gradient_loss(model(x), y, adv, 14, ref_logits=ref(x) if kl else None, kl_coef=0.5 if kl else 0.0)
    loss.backward()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, g1[n], atol=1e-7, rtol=1e-5), n
    assert h1[0]["loss"] == pytest.approx(float(loss.detach()), abs=1e-6) == h3[0]["loss"]
    assert h1[0]["reward"] == pytest.approx(sum(REWARDS) / 6) and h1[0]["end_of_turn_rate"] == 1.0
    assert (h1[0]["kl"] > 0) == kl


def test_a_rollout_with_the_wrong_number_of_micro_batches_is_refused():
    model = tiny_model()
    cfg = TrainConfig(max_steps=1, batch_size=3, accumulate=2, warmup=0, log_every=1, eval_every=1)
    module = RLModule(model, cfg, lambda m, s: fixed_rollout(1))
    trainer = make_trainer(cfg, None, accelerator="cpu", progress_bar=False, logger=False, checkpointing=False)
    with pytest.raises(ValueError, match="has 1 micro-batches; accumulate is 2"):
        trainer.fit(module)
    with pytest.raises(ValueError, match="kl_coef=0.1 needs a reference model"):
        RLModule(model, cfg, lambda m, s: None, kl_coef=0.1)
