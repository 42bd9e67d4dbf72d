"""One checkpoint scored on a row's questions, in batches: greedy replies with the calculator off and on, and
k sampled replies per question at temperature 1, each reply scored by the row's reward and, when it shows its
work, every line checked.

Every reply comes from :func:`decoderlab.generation.generate_batch`, a few hundred rows at a time; row i of a
batch is the reply :func:`decoderlab.chat.chat_reply` (or, for the base model, ``generate`` on the question and
a newline) gives alone, with the same settings -- the card's test holds the two paths equal.

* Greedy, the calculator on and off in one pass: the tool-call token is allowed and does not stop the reply.
  A reply without it is the reply of both columns (banning a token greedy never picks changes nothing); a
  question whose reply opens a call is answered again with the token banned (tools off, batched) and through
  :func:`decoderlab.chat.run_tool_turns` (tools on, the called questions batched: the calls run).
* Sampled: k replies per question at temperature 1, the tool-call token banned, each with its own seed drawn
  from the question's text and the sample's number, so every stage is sampled with the same seeds.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ..chat import TOOLS, evaluate, load_model, run_tool_turns
from ..generation import SamplingParams, generate_batch
from ..reinforcement.rewards import load_reward
from ..tasks import SKILLS, Item
from ..tasks.work import check_work
from ..tokenizers import encode_with_special_tokens

#: the longest reply of each step, in tokens: a call to the calculator on two 4-digit numbers is about 30 BPE
#: tokens; the work of a 2x2-digit product about 100
MAX_NEW_TOKENS = 48
WORK_TOKENS = 128
#: rows of one generate_batch call (the KV cache of 256 rows of 256 positions at d_model 128, 4 layers: 268 MB)
BATCH = 256
#: the prompt of the plain chat turn the card checks (text, not a tool call or a number)
STORY = "Tell me a story about the king."


def max_new_tokens(skill: str) -> int:
    """The reply length limit of a row: ``WORK_TOKENS`` when its answers show their work."""
    return WORK_TOKENS if SKILLS[skill].work else MAX_NEW_TOKENS


def sample_seed(question: str, j: int) -> int:
    """The seed of sample ``j`` of ``question`` (the same for every stage: the stages' samples are paired)."""
    digest = hashlib.blake2b(f"{question}\0{j}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def score(item: Item, reply: str, ended: bool, rewards: dict) -> int:
    """1 when the reward the item names gives the reply 1, else 0 (the reward sees the question as its row's
    user message, and the reference)."""
    if item.reward not in rewards:
        rewards[item.reward] = load_reward(item.reward)
    row = {"reference": item.answer, "messages": [{"role": "user", "content": item.question}]}
    return int(rewards[item.reward](reply, row, ended) == 1)


def false_lines(item: Item, reply: str) -> int | None:
    """The number of false lines of a reply that shows its work (:func:`decoderlab.tasks.work.check_work`,
    the calculator's evaluator doing the arithmetic); None for a question whose answer shows none."""
    checked = check_work(item.question, reply, evaluate)
    return None if checked is None else checked.false


@dataclass
class Checkpoint:
    """A loaded stage: model, tokenizer, template (None: a base model) and the ids its replies need."""

    model: object
    tok: object
    template: object

    @classmethod
    def load(cls, directory) -> "Checkpoint":
        model, tok, template, _ = load_model(directory)
        return cls(model.eval(), tok, template)

    @property
    def chat(self) -> bool:
        return self.template is not None

    @property
    def tools(self) -> bool:
        return self.chat and self.template.has_tools

    def prompt(self, question: str) -> list[int]:
        if not self.chat:  # as transformers' tokenizer(text): <s> first where the tokenizer says add_bos_token
            return encode_with_special_tokens(self.tok, question + "\n")
        return self.template.render([{"role": "user", "content": question}], self.tok, add_generation_prompt=True)[0]

    def params(self, prompt: list[int], cap: int, *, ban_call: bool, **sampling) -> SamplingParams:
        """The settings of one reply: ``chat_reply``'s (stop at the end of turn, at most ``cap`` tokens and the
        room left in the context; the tool-call token banned, or let through without stopping)."""
        if not self.chat:
            return SamplingParams(max_new_tokens=cap, temperature=0, **sampling)
        eot, n = self.template.end_of_turn_id(self.tok), min(cap, self.model.config.max_len - len(prompt))
        if not self.tools:
            return SamplingParams(max_new_tokens=n, stop=(eot,), temperature=0, **sampling)
        tc = self.template.tool_call_id(self.tok)
        if ban_call:
            return SamplingParams(max_new_tokens=n, stop=(eot,), logit_bias={tc: -100.0}, temperature=0, **sampling)
        # every end-of-text token stops the reply as in chat_reply, except the call's opener: it stays in the reply
        stops = [eot] + [i for i in self.tok.end_of_text_ids if i not in (eot, tc)]
        return SamplingParams(max_new_tokens=n, stop=stops, stop_at_eos=False, temperature=0, **sampling)


def _generate(ck: Checkpoint, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    out = []
    for i in range(0, len(prompts), BATCH):
        out += generate_batch(ck.model, prompts[i : i + BATCH], params[i : i + BATCH], tokenizer=ck.tok)
    return out


def _base_reply(ck: Checkpoint, ids: list[int]) -> str:
    return ck.tok.decode(ids).strip().split("\n")[0]


def greedy(ck: Checkpoint, items: list[Item], cap: int) -> tuple[list[dict], list[dict] | None]:
    """Each item's greedy reply with the calculator off, and (a chat model with the tools template) on:
    ``({"reply", "ended"}, ...)`` and ``({"reply", "ended", "calls": [(arguments, result)]}, ...)`` or None."""
    prompts = [ck.prompt(i.question) for i in items]
    params = [ck.params(p, cap, ban_call=not ck.tools) for p in prompts]
    outs = _generate(ck, prompts, params)
    if not ck.chat:
        return [{"reply": _base_reply(ck, o), "ended": True} for o in outs], None
    off = [{"reply": ck.tok.decode(o), "ended": len(o) < p.max_new_tokens} for o, p in zip(outs, params)]
    if not ck.tools:
        return off, None
    tc = ck.template.tool_call_id(ck.tok)
    on = [dict(r, calls=[]) for r in off]
    called = [k for k, o in enumerate(outs) if tc in o]
    if called:
        banned = [ck.params(prompts[k], cap, ban_call=True) for k in called]
        for k, o, p in zip(called, _generate(ck, [prompts[k] for k in called], banned), banned):
            off[k] = {"reply": ck.tok.decode(o), "ended": len(o) < p.max_new_tokens}
    turns = run_tool_turns(ck.model, ck.tok, [[{"role": "user", "content": items[k].question}] for k in called],
                           ck.template, TOOLS, temperature=0, max_new_tokens=cap, batch_size=BATCH)
    for k, turn in zip(called, turns):
        on[k] = {"reply": turn.content, "ended": turn.finish_reason == "stop",
                 "calls": [(c.arguments, c.result) for c in turn.calls]}
    return off, on


def sampled(ck: Checkpoint, items: list[Item], cap: int, k: int, rewards: dict) -> list[int]:
    """How many of ``k`` replies per item, sampled at temperature 1 (tool calls banned), the reward calls
    right."""
    prompts, params = [], []
    for item in items:
        p = ck.prompt(item.question)
        for j in range(k):
            prompts.append(p)
            params.append(ck.params(p, cap, ban_call=True).replace(temperature=1.0, seed=sample_seed(item.question, j)))
    outs = _generate(ck, prompts, params)
    right = [0] * len(items)
    for r, (o, p) in enumerate(zip(outs, params)):
        item = items[r // k]
        right[r // k] += score(item, ck.tok.decode(o), len(o) < p.max_new_tokens, rewards)
    return right


def score_row(ck: Checkpoint, skill: str, items: list[Item], samples: int) -> dict:
    """One row of one stage: ``{"off": {...}, "on": {...} or None}``, each with per-question lists --
    ``right`` (0/1), ``replies``, ``ended``, ``false_lines`` (None where no work is shown); ``off`` also
    ``sample_right`` (right replies of ``samples`` sampled ones; chat models, ``samples`` > 0), ``on`` also
    ``called`` and ``expression_right`` (the first call's result is the reference)."""
    cap, rewards = max_new_tokens(skill), {}
    off, on = greedy(ck, items, cap)
    out = {"off": _outcomes(items, off, rewards), "on": None}
    if ck.chat and samples:
        out["off"]["sample_right"] = sampled(ck, items, cap, samples, rewards)
    if on is not None:
        out["on"] = _outcomes(items, on, rewards)
        out["on"]["called"] = [bool(r["calls"]) for r in on]
        out["on"]["expression_right"] = [bool(r["calls"]) and r["calls"][0][1] == i.answer for r, i in zip(on, items)]
    return out


def _outcomes(items: list[Item], replies: list[dict], rewards: dict) -> dict:
    return {"right": [score(i, r["reply"], r["ended"], rewards) for i, r in zip(items, replies)],
            "replies": [r["reply"] for r in replies], "ended": [r["ended"] for r in replies],
            "false_lines": [false_lines(i, r["reply"]) for i, r in zip(items, replies)]}


def story(ck: Checkpoint) -> dict | None:
    """The reply to ``STORY`` (greedy, the calculator on for a tools model) and whether it is text: no call,
    three words or more."""
    if not ck.chat:
        return None
    off, on = greedy(ck, [Item(STORY, "", "story", 0, "exact", "held-out")], MAX_NEW_TOKENS)
    reply = (on or off)[0]
    words = [w for w in reply["reply"].split() if any(c.isalpha() for c in w)]
    return {"reply": reply["reply"], "text": not reply.get("calls") and len(words) >= 3}
