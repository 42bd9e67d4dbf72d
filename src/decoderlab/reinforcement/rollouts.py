"""The samples of a reinforcement-learning step: sample -> reward -> batch.

One optimizer step ``s`` (:class:`RolloutSampler`, called by :class:`~decoderlab.reinforcement.grpo.RLModule` at
the start of the step with the current weights):

1. the step's prompts: ``batch_size * accumulate`` rows of seeded permutations of the prompts file, epoch
   after epoch (so every step's prompts are fixed by the seed and the step number);
2. each prompt rendered with the chat template (the one renderer, ``add_generation_prompt=True``) and
   answered G times by :func:`decoderlab.generation.generate_batch` (one batch KV cache per micro-batch), each
   row with its own :class:`~decoderlab.generation.SamplingParams` seeded from (seed, step), so a resumed run samples what the uninterrupted one did.
   A reply stops at the end-of-turn token, at ``max_new_tokens`` or where the context would pass
   ``max_len`` (it never slides); ``<PAD>`` is never sampled, nor ``<EOS>`` when the template ends turns with
   another token (so "ended its turn" is exactly "stopped before its limit");
3. each reply decoded and scored by the reward (:func:`decoderlab.reinforcement.rewards.score`), advantages per
   group (:func:`~decoderlab.reinforcement.grpo.group_advantages`);
4. rows ``prompt + reply (+ end of turn)`` with labels on the reply and its end of turn only, shifted once
   (:func:`~decoderlab.training.rows.shift_for_training`), cut into ``accumulate`` micro-batches, with the
   number of sampled tokens of the whole step as the loss's normaliser.

:func:`decoderlab.reinforcement.train.train_rl` runs it on Lightning's loop.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..chat import ChatTemplate, get_template
from ..config.rl import RLConfig
from ..generation import SamplingParams, generate_batch
from ..tokenizers import Tokenizer
from ..training.rows import IGNORE_INDEX, collate, shift_for_training
from .grpo import Rollout, group_advantages
from .prompts import PromptRow
from .rewards import RewardFn, score

#: largest per-row sampling seed (the engine's 0 .. 2**63-1)
_SEED_MASK = 2**63 - 1


def _pad_id(tokenizer: Tokenizer, eot: int) -> int:
    pad = tokenizer.pad_id
    return pad if pad is not None and pad != eot else next(i for i in range(tokenizer.vocab_size) if i != eot)


class RolloutSampler:
    """``sampler(model, step) -> Rollout``: the samples of optimizer step ``step`` (see the module docstring).

    Args:
        prompts: the rows of the prompts file (:func:`decoderlab.reinforcement.prompts.load_prompts`).
        tokenizer, template: the chat model's tokenizer and template.
        reward: ``reward(reply, row, ended) -> float`` (:func:`decoderlab.reinforcement.rewards.load_reward`).
        rl: group size, reply length, sampling, reward scaling.
        max_len: the model's context length.
        batch_size: prompts per micro-batch (each answered ``rl.group_size`` times); accumulate: micro-batches
            per optimizer step; seed: the prompts' order and every reply's sampling seed.

    Raises:
        ValueError: a prompt that leaves no room for a reply within ``max_len`` (naming its line); the
            tokenizer lacks the template's tokens.
    """

    def __init__(self, prompts: Sequence[PromptRow], tokenizer: Tokenizer, template: str | ChatTemplate,
                 reward: RewardFn, rl: RLConfig, *, max_len: int, batch_size: int, accumulate: int = 1,
                 seed: int = 0):
        if not prompts:
            raise ValueError("no prompts to learn from")
        self.prompts, self.tokenizer, self.reward = list(prompts), tokenizer, reward
        self.template, self.rl = get_template(template), rl.validate()
        self.max_len, self.b, self.acc, self.seed = int(max_len), int(batch_size), int(accumulate), int(seed)
        self.eot = self.template.end_of_turn_id(tokenizer)
        self.pad = _pad_id(tokenizer, self.eot)
        eos = tokenizer.eos_id
        # <PAD> and <EOS> are never sampled -- unless one is the end of turn (SmolLM2's pad and eos are <|im_end|>):
        # suppressing it would run every reply to its cap
        self.suppress = sorted({t for t in (tokenizer.pad_id, eos) if t is not None and t != self.eot})
        self.prompt_ids, self.caps = [], []
        for p in self.prompts:
            ids, _ = self.template.render(p.messages, tokenizer, add_generation_prompt=True)
            cap = min(rl.max_new_tokens, self.max_len - len(ids))
            if cap < 1:
                raise ValueError(f"the prompt on line {p.line} renders to {len(ids)} tokens, which leaves no room for "
                                 f"a reply within the model's max_len={self.max_len}; shorten it")
            self.prompt_ids.append(ids)
            self.caps.append(cap)
        self._perms: dict[int, np.ndarray] = {}

    def step_prompts(self, step: int) -> list[int]:
        """Indices of the prompts of optimizer step ``step``: ``batch_size * accumulate`` consecutive positions
        of an endless stream of seeded permutations (one per epoch)."""
        n, per = len(self.prompts), self.b * self.acc
        out = []
        for pos in range(step * per, (step + 1) * per):
            epoch = pos // n
            if epoch not in self._perms:
                self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(n)}
            out.append(int(self._perms[epoch][pos % n]))
        return out

    def row_seeds(self, step: int, rows: int) -> list[int]:
        """One sampling seed per reply of step ``step``, drawn from (seed, step)."""
        state = np.random.SeedSequence([self.seed, step]).generate_state(rows, dtype=np.uint64)
        return [int(s) & _SEED_MASK for s in state]

    def row_params(self, cap: int, seed: int) -> SamplingParams:
        """The sampling settings of one reply: the run's temperature, top-k and top-p, at most ``cap`` new
        tokens, stopping at the end of turn (never at another end-of-text token), ``<PAD>`` (and ``<EOS>`` when
        it is not the end of turn) never sampled, seeded with ``seed``."""
        return SamplingParams(max_new_tokens=cap, temperature=self.rl.temperature, top_k=self.rl.top_k,
                              top_p=self.rl.top_p, stop=self.eot, stop_at_eos=False,
                              suppress_tokens=tuple(self.suppress), seed=seed)

    def _sample(self, model, prompt_idx: list[int], seeds: list[int]) -> list[list[int]]:
        """G replies (token ids, without the end of turn) per prompt, group after group, in one
        ``generate_batch`` call (one batch KV cache; each row with its own limit and seed)."""
        g = self.rl.group_size
        rows = [i for i in prompt_idx for _ in range(g)]
        params = [self.row_params(self.caps[i], seed) for i, seed in zip(rows, seeds)]
        return generate_batch(model, [self.prompt_ids[i] for i in rows], params)

    def __call__(self, model, step: int) -> Rollout:
        idx = self.step_prompts(step)
        g = self.rl.group_size
        seeds = self.row_seeds(step, len(idx) * g)
        replies = self._sample(model, idx, seeds)
        rewards, lengths, ended, texts, rows = [], [], [], [], []
        for r, reply in enumerate(replies):
            i = idx[r // g]
            done = len(reply) < self.caps[i]
            text = self.tokenizer.decode(reply)
            rewards.append(score(self.reward, text, self.prompts[i].row, done, self.prompts[i].line))
            lengths.append(len(reply))
            ended.append(done)
            texts.append(text)
            ids = self.prompt_ids[i] + reply + ([self.eot] if done else [])
            mask = [False] * len(self.prompt_ids[i]) + [True] * (len(ids) - len(self.prompt_ids[i]))
            rows.append(shift_for_training(ids, mask, self.max_len))
        adv = group_advantages(torch.tensor(rewards, dtype=torch.float32), g, self.rl.scale_rewards)
        per = self.b * g
        micro = []
        for m in range(self.acc):
            x, y = collate(rows[m * per : (m + 1) * per], self.pad)
            micro.append((x, y, adv[m * per : (m + 1) * per].clone()))
        tokens = int(sum(int((y != IGNORE_INDEX).sum()) for _, y, _ in micro))
        return Rollout(micro, tokens, rewards, lengths, ended, texts)


def require_chat_template(template: ChatTemplate | None, checkpoint: str = "the checkpoint") -> ChatTemplate:
    """The chat template of the model to train, or a ``ValueError`` that says to fine-tune first: the replies
    are answers to conversations, rendered with the template the model was fine-tuned on (a base model has
    none; :func:`decoderlab.chat.load_model` gives None)."""
    if template is None:
        raise ValueError(f"{checkpoint} has no chat template (it is a base model): reinforcement learning answers "
                         f"conversations, so fine-tune it on conversations first (decoderlab finetune "
                         f"--checkpoint {checkpoint} --data chats.jsonl) and start from that checkpoint")
    return get_template(template)
