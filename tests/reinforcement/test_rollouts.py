"""Reinforcement learning end to end: the sampled rows, a tiny model that learns the reward, resume equal to an
uninterrupted run, and a reward that fails mid-run (named, the last checkpoint kept)."""

import lightning as L
import pytest
import torch
from support.interaction import InterruptAt
from lightning.pytorch.callbacks import ModelCheckpoint

from decoderlab.chat import TEMPLATES, add_chat_tokens, chat_reply
from decoderlab.config import RLConfig
from decoderlab.reinforcement.prompts import load_prompts
from decoderlab.reinforcement.rewards import RewardError, load_reward
from decoderlab.model import DecoderOnlyTransformer, preset
from decoderlab.reinforcement import RolloutSampler, require_chat_template, train_rl
from decoderlab.tokenizers import CharTokenizer
from decoderlab.training import TrainConfig, TrainingInterrupted
from decoderlab.training.rows import IGNORE_INDEX

LETTERS = "abcd"
DL = TEMPLATES["decoderlab"]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the learning curve below is for one thread's arithmetic
    yield
    torch.set_num_threads(n)


def letter_model(seed=0, max_len=16):
    torch.manual_seed(seed)
    tok = CharTokenizer.from_text(LETTERS)
    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=32, n_layer=1,
                                          n_head=2, max_len=max_len))
    model, tok, _ = add_chat_tokens(model, tok, "decoderlab")
    return model, tok


def letter_prompts(reward):
    """"Reply with the letter the prompt names": the built-in regex reward, pattern ^<letter>."""
    return load_prompts([{"prompt": c, "pattern": f"^{c}"} for c in LETTERS], reward)


def rl_cfg(**kw):
    base = dict(max_steps=4, batch_size=4, lr=1e-2, min_lr=1e-2, warmup=0, grad_clip=1.0, weight_decay=0.0,
                log_every=1, eval_every=1000)
    return TrainConfig(**{**base, **kw})


def test_rollout_rows_are_the_prompt_then_the_reply_with_labels_on_the_reply_only():
    model, tok = letter_model(max_len=9)
    reward = load_reward("regex")
    rl = RLConfig(group_size=3, max_new_tokens=4)
    sampler = RolloutSampler(letter_prompts(reward), tok, DL, reward, rl, max_len=9, batch_size=2, accumulate=2,
                             seed=5)
    r = sampler(model, step=0)
    assert len(r.micro_batches) == 2 and len(r.rewards) == 12
    eot = DL.end_of_turn_id(tok)
    prompts = [sampler.prompt_ids[i] for i in sampler.step_prompts(0) for _ in range(3)]
    rows = [(x, y) for xs, ys, _ in r.micro_batches for x, y in zip(xs.tolist(), ys.tolist())]
    tokens = 0
    for (x, y), prompt, length, ended, text in zip(rows, prompts, r.lengths, r.ended, r.replies):
        n = len(prompt)
        sampled = [t for t in y if t != IGNORE_INDEX]
        k = len(sampled)
        assert k == length + ended and (sampled[-1] == eot) == ended  # the reply, then its end of turn if any
        assert x[: n + k - 1] == (prompt + sampled)[:-1]  # inputs: the prompt and the reply, shifted once
        assert y[n - 1 : n - 1 + k] == sampled and set(y[: n - 1] + y[n - 1 + k :]) <= {IGNORE_INDEX}
        assert tok.decode(sampled[:length]) == text
        assert n + length + ended <= 9 and ended == (length < min(4, 9 - n))  # never past max_len
        assert tok.eos_id not in sampled and tok.pad_id not in sampled
        tokens += len(sampled)
    assert r.tokens == tokens
    adv = torch.cat([a for _, _, a in r.micro_batches]).view(4, 3)
    assert torch.allclose(adv, torch.tensor(r.rewards).view(4, 3) - torch.tensor(r.rewards).view(4, 3).mean(1, True))
    again = sampler(model, step=0)  # seeded by (seed, step): the same step samples the same replies
    assert again.replies == r.replies and all(torch.equal(a[0], b[0]) for a, b in zip(again.micro_batches, r.micro_batches))
    assert sorted(sampler.step_prompts(0)) == [0, 1, 2, 3] and sampler(model, step=1).replies != r.replies


def test_a_prompt_with_no_room_for_a_reply_names_its_line():
    model, tok = letter_model(max_len=4)
    reward = load_reward("regex")
    with pytest.raises(ValueError, match="the prompt on line 1 renders to 4 tokens, which leaves no room"):
        RolloutSampler(letter_prompts(reward), tok, DL, reward, RLConfig(group_size=2), max_len=4, batch_size=1)


def test_a_tiny_model_learns_to_reply_with_the_letter_the_prompt_names():
    model, tok = letter_model()
    reward = load_reward("regex")
    _, history = train_rl(model, tok, "decoderlab", letter_prompts(reward), reward, accelerator="cpu",
                          train_config=rl_cfg(max_steps=60),
                          rl_config=RLConfig(group_size=8, max_new_tokens=2, scale_rewards=True))
    first = sum(h["reward"] for h in history[:5]) / 5
    last = sum(h["reward"] for h in history[-5:]) / 5
    assert len(history) == 60 and first < 0.3 and last > 0.9, (first, last)
    for c in LETTERS:  # greedy, as the demo scores it
        assert chat_reply(model, [{"role": "user", "content": c}], tok, DL, temperature=0, max_new_tokens=2)[0] == c
    assert all(h["reply_length"] <= 2 and 0 <= h["end_of_turn_rate"] <= 1 for h in history)


def run(tmp_path, name, max_steps=4, callbacks=(), ckpt_path=None, reward=None):
    model, tok = letter_model()
    reward = reward or load_reward("regex")
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / name), every_n_train_steps=1, save_last=True, save_top_k=0)
    _, history = train_rl(model, tok, DL, letter_prompts(reward), reward, accelerator="cpu",
                          train_config=rl_cfg(max_steps=max_steps, accumulate=2, batch_size=2),
                          rl_config=RLConfig(group_size=4, max_new_tokens=3, kl_coef=0.1),
                          callbacks=[ckpt, *callbacks], ckpt_path=ckpt_path)
    return model, history


def test_resume_equals_an_uninterrupted_run(tmp_path):
    full, full_history = run(tmp_path, "full")
    with pytest.raises(TrainingInterrupted):
        run(tmp_path, "cut", callbacks=[InterruptAt(2)])
    assert torch.load(tmp_path / "cut" / "last.ckpt", weights_only=False)["global_step"] == 2
    resumed, history = run(tmp_path, "cut", ckpt_path=tmp_path / "cut" / "last.ckpt")
    assert history == full_history and len(history) == 4 and history[-1]["kl"] > 0
    for (n, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), n


class FailsAtStep:
    """The regex reward, until the replies of step ``step``: then it raises."""

    name = "fails-at-step"
    fields = ("pattern",)

    def __init__(self, step, per_step):
        self.inner, self.calls, self.limit = load_reward("regex"), 0, step * per_step

    def __call__(self, reply, row, ended):
        self.calls += 1
        if self.calls > self.limit:
            raise ZeroDivisionError("division by zero")
        return self.inner(reply, row, ended)


def test_a_reward_failing_mid_run_names_the_prompt_and_keeps_the_last_checkpoint(tmp_path):
    with pytest.raises(RewardError, match=r"reward 'fails-at-step' raised ZeroDivisionError: division by zero on a "
                                          r"reply to the prompt on line \d \('[a-d]'\)"):
        run(tmp_path, "fails", reward=FailsAtStep(step=2, per_step=4 * 4))
    assert torch.load(tmp_path / "fails" / "last.ckpt", weights_only=False)["global_step"] == 2


def test_a_base_model_without_a_chat_template_is_told_to_fine_tune_first():
    with pytest.raises(ValueError, match="runs/base has no chat template .*fine-tune it on conversations first "
                                         r"\(decoderlab finetune --checkpoint runs/base"):
        require_chat_template(None, "runs/base")
    assert require_chat_template(DL) is DL


def test_a_jinja_template_gives_the_rows_of_the_built_in_template_it_writes():
    """RL renders through any template: decoderlab's own written as Jinja (as an exported model carries it)
    gives the same prompts, replies, rewards and rows as the built-in renderer."""
    from decoderlab.chat import JinjaChatTemplate, chat_template_jinja

    model, tok = letter_model(max_len=9)
    reward = load_reward("regex")
    rl = RLConfig(group_size=3, max_new_tokens=4)
    runs = [RolloutSampler(letter_prompts(reward), tok, t, reward, rl, max_len=9, batch_size=2, accumulate=2,
                           seed=5)(model, step=0) for t in (DL, JinjaChatTemplate(chat_template_jinja(DL)))]
    assert runs[0].rewards == runs[1].rewards and runs[0].replies == runs[1].replies and runs[0].tokens
    for (x0, y0, a0), (x1, y1, a1) in zip(runs[0].micro_batches, runs[1].micro_batches):
        assert torch.equal(x0, x1) and torch.equal(y0, y1) and torch.equal(a0, a1)


def test_a_pad_token_that_is_the_end_of_turn_is_still_sampled(monkeypatch):
    """SmolLM2's <PAD> and <EOS> are both <|im_end|>, its end of turn: suppressing <PAD> ran every reply to its
    cap (end of turn 0%). The end of turn stays sampleable; a <PAD> or <EOS> that is another token does not."""
    model, tok = letter_model(max_len=9)
    reward = load_reward("regex")
    eot = DL.end_of_turn_id(tok)
    plain = RolloutSampler(letter_prompts(reward), tok, DL, reward, RLConfig(group_size=2), max_len=9, batch_size=2)
    assert eot not in plain.suppress and tok.pad_id in plain.suppress
    monkeypatch.setattr(type(tok), "pad_id", property(lambda self: eot))
    smol = RolloutSampler(letter_prompts(reward), tok, DL, reward, RLConfig(group_size=2), max_len=9, batch_size=2)
    assert eot not in smol.suppress and smol.row_params(4, 0).suppress_tokens == tuple(smol.suppress)
    assert tok.eos_id in smol.suppress or tok.eos_id == eot
