"""The recipe on a real model: SmolLM2-135M-Instruct learns to call the calculator. The base is scored first on
held-out questions (2x2-digit products and two-step word problems), greedy with the calculator off (the plain
prompt) and on (the calculator offered in the system turn, as ``decoderlab chat --tools calculator`` offers it,
the call run and its result read back); then LoRA SFT on generated conversations in SmolLM2's ``chatml-tools``
layout -- the question, a call to the calculator, its result, the answer -- mixed with plain chat (the base's
own greedy replies to everyday prompts, so the model still talks); then the same questions again. Every number
with its Wilson 95% interval, SFT - base with its paired (Newcombe) interval; the README's France question
before and after; each stage's wall and CPU time. Then the room after SFT (pass@8 - pass@1 on train questions),
GRPO with LoRA on the row with the most room (a KL term to the SFT model) and its equal-compute control (more
LoRA SFT on the references for the same CPU time), both scored on the same held-out questions (``--stage room``,
``rl``, ``control``, ``rl-card``).

    PYTHONPATH=src python bench/recipe_real.py --base models/SmolLM2-135M-Instruct.Q4_1.gguf --out runs/real

CPU only, one thread. Writes RUN_DIR/sft (the LoRA run: ``decoderlab chat --checkpoint RUN_DIR/sft --tools
calculator``), RUN_DIR/card.json (every question's replies and outcomes) and RUN_DIR/card.md (the table). The
table and its costs: docs/finetuning.md, "SmolLM2 learns the calculator".
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from decoderlab.config.names import PRECISIONS  # noqa: E402
from decoderlab.tasks import calculator_call, expression_of, generate  # noqa: E402
from recipe import Clock  # noqa: E402  (bench/recipe.py: each stage's wall and CPU seconds)

#: the card's rows: (skill, difficulty) -- 2x2-digit products and two-step word problems
ROWS = (("multiplication", 3), ("word_problem", 2))
#: fewer held-out questions per row are refused: a 95% interval on fewer is wider than the effects it would show
MIN_QUESTIONS = 100
#: held-out questions per row by default: +-5 points at worst, +-1 at 0% or 100% (a split with fewer -- 179
#: 2x1-digit products -- gives what it has)
QUESTIONS = 400
#: the tool conversations of the SFT mix: (skill, difficulty, relative share); with plain chat (CHAT_SHARE)
TOOL_MIX = (("multiplication", 3, .24), ("word_problem", 2, .2), ("word_problem", 1, .12), ("multiplication", 2, .04),
            ("addition", 2, .03), ("addition", 3, .02), ("addition", 4, .02), ("subtraction", 2, .03),
            ("subtraction", 3, .02), ("big_multiplication", 3, .04))
CHAT_SHARE = 0.3
#: the share of plain chat conversations that offer the calculator (and do not call it)
OFFERED_SHARE = 0.75
#: everyday prompts the base answers greedily; its replies are the plain chat of the mix (never the France question)
CHAT_PROMPTS = (
    "Hi! How are you today?", "What is the capital of Italy?", "What is the capital of Japan?",
    "Give me three tips for a good night's sleep.", "What is photosynthesis?", "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?", "What is the largest planet in the solar system?", "How do I boil an egg?",
    "Explain what a computer program is in one sentence.", "What colour is the sky on a clear day?",
    "Name three fruits.", "What does a thermometer measure?", "Tell me a fun fact about cats.",
    "How many days are in a week?", "What is the boiling point of water?", "Suggest a name for a pet goldfish.",
    "What language is spoken in Brazil?", "Why do leaves change colour in autumn?", "What is a noun?",
    "Say something kind to a friend who is sad.", "What is the tallest mountain on Earth?",
    "How do bees make honey?", "What is the opposite of hot?",
    # asked as the arithmetic is ("What is ...?"), answered in words with the calculator offered: the held-out
    # France question must not read as a call
    "What is the capital of Germany?", "What is the capital of Spain?", "What is the capital of Canada?",
    "What is the capital of Egypt?", "What is the capital of Australia?", "What is the capital of Portugal?",
    "What is the capital of Greece?", "What is the capital of Mexico?", "What is the largest ocean on Earth?",
    "What is the chemical symbol for gold?", "What is the main ingredient of bread?", "What is a verb?",
    "What is the colour of grass?", "What is the longest river in Africa?", "Who painted the Mona Lisa?",
    "Which animal is known as the king of the jungle?", "What is the freezing point of water?",
    "What do plants need to grow?", "What is the currency of Japan?", "What is a synonym for happy?")
FRANCE = "What is the capital of France?"
#: reply caps in tokens: the first step (an answer or a call: ~30 tokens), and the answer after a result
CAP, ANSWER_CAP, CHAT_CAP = 48, 32, 96
#: the prompts a batch of one rest length should hold on average for the shared-prefix path to pay
MIN_GROUP = 8
#: the rows whose room after SFT is measured (skill, difficulty, calculator), the train questions and samples each
ROOM_ROWS = (("multiplication", 3, "on"), ("word_problem", 2, "on"), ("addition", 2, "off"),
             ("subtraction", 2, "off"), ("multiplication", 2, "off"), ("addition", 3, "off"))
ROOM_QUESTIONS, ROOM_K = 24, 8
#: generate_batch rows per call (the KV cache of 128 rows of ~300 positions, 30 layers: ~0.6 GB)
BATCH = 128


# ---------------------------------------------------------------------------------------------------------
# The conversations
# ---------------------------------------------------------------------------------------------------------


def calculator_definitions() -> list[dict]:
    from decoderlab.chat import TOOLS

    return [TOOLS["calculator"].definition]


def tool_system(template) -> str:
    """The system message ``template``'s tool variant (:func:`decoderlab.chat.tools_template`: ``chatml-tools``
    for SmolLM2's ChatML) writes when the calculator is offered: its default system message and the tools block.
    A conversation opening with it renders to the same text as the conversation without it, tools offered -- so
    the SFT data (which carries no ``tools`` field) trains on the prompt ``chat --tools calculator`` writes.
    Raises ValueError when the two renderings differ (a template whose system turn is not ChatML's)."""
    from decoderlab.chat import tools_template

    t = tools_template(template)
    probe = [{"role": "user", "content": "What is 2 + 2?"}]
    text = t.render_text(probe, add_generation_prompt=True, tools=calculator_definitions())
    head = "<|im_start|>system\n"
    system = text[len(head):text.index("<|im_end|>")] if text.startswith(head) else None
    if system is None or t.render_text([{"role": "system", "content": system}] + probe,
                                       add_generation_prompt=True) != text:
        raise ValueError(f"the {t.name!r} template's tool prompt is not a ChatML system turn; recipe_real.py writes "
                         f"SmolLM2's chatml-tools layout only")
    return system


def tool_conversation(item, system: str) -> list[dict]:
    """The conversation that teaches ``item`` through the calculator: ``system`` (:func:`tool_system`), the
    question, a call on its expression, the result, then the answer ``EXPRESSION = RESULT.``."""
    return [{"role": "system", "content": system}, {"role": "user", "content": item.question},
            calculator_call(item), {"role": "tool", "tool_call_id": "call_0", "content": item.answer},
            {"role": "assistant", "content": f"{expression_of(item.question)} = {item.answer}."}]


def chat_conversations(replies: dict[str, str], system: str, n: int, seed: int) -> list[list[dict]]:
    """``n`` plain chat conversations from the base's own replies, ``OFFERED_SHARE`` of them with the calculator
    offered (the model learns not to call it for text)."""
    rng, items, out = random.Random(seed), sorted(replies.items()), []
    for k in range(n):
        prompt, reply = items[k % len(items)]
        head = [{"role": "system", "content": system}] if rng.random() < OFFERED_SHARE else []
        out.append(head + [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}])
    return out


def sft_conversations(n: int, system: str, replies: dict[str, str], seed: int = 0) -> list[list[dict]]:
    """``n`` training conversations: ``TOOL_MIX`` (train split) through the calculator and ``CHAT_SHARE`` of
    plain chat, shuffled."""
    convs, scale = [], (1 - CHAT_SHARE) / sum(share for *_, share in TOOL_MIX)  # TOOL_MIX's shares are relative
    for skill, difficulty, share in TOOL_MIX:
        convs += [tool_conversation(i, system) for i in generate(skill, "train", max(1, int(n * share * scale)),
                                                                 seed=seed, difficulty=difficulty)]
    convs += chat_conversations(replies, system, n - len(convs), seed)
    random.Random(seed).shuffle(convs)
    return convs


# ---------------------------------------------------------------------------------------------------------
# Scoring: greedy, batched, the calculator off and on
# ---------------------------------------------------------------------------------------------------------


def common_prefix(prompts: list[list[int]]) -> int:
    """The length of the token prefix every prompt shares (all but each prompt's last token at most)."""
    n = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for p in prompts[1:]:
        k = 0
        while k < n and p[k] == first[k]:
            k += 1
        n = k
    return max(n, 0)


def replies(model, tok, prompts: list[list[int]], cap: int, stop: int, temperature: float = 0.0,
            seed: int = 0) -> list[tuple[str, bool]]:
    """``(text, ended)`` of each prompt's greedy reply, at most ``cap`` tokens, stopped at ``stop`` (the end of
    turn; not in the text).

    The prompts share a long prefix -- the system turn, with the calculator offered ~180 tokens of the ~220 --
    so it is prefilled once and its keys and values copied into the cache of each batch; a batch holds prompts
    whose rest has one length (no padding), at most ``BATCH``. Greedy (``temperature`` 0), each reply is the one
    ``generate_batch`` gives, but for float rounding (tests/tasks/test_tool_sft.py holds them equal); above 0,
    sampled at ``temperature`` from a generator seeded with ``seed``."""
    import torch

    from decoderlab.attention import KVCache

    shared = common_prefix(prompts)
    n_layer, out = model.config.n_layer, [None] * len(prompts)
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(len(p) - shared, []).append(i)
    if len(groups) * MIN_GROUP > len(prompts) and not temperature:  # rests of many lengths: small batches would
        return _replies_padded(model, tok, prompts, cap, stop)  # cost more than the prefix saves
    generator = torch.Generator().manual_seed(seed)
    head = KVCache(n_layer, max(shared, 1))
    if shared:
        model(torch.tensor([prompts[0][:shared]]), cache=head)
    for rest, members in sorted(groups.items()):
        for k in range(0, len(members), BATCH):
            chunk = members[k:k + BATCH]
            cache = KVCache(n_layer, shared + rest + cap)
            if shared:
                for mine, theirs in zip(cache.layers, head.layers):
                    b, h, _, d = theirs.k.shape
                    mine.k = theirs.k.new_zeros(len(chunk), h, cache.capacity, d)
                    mine.v = theirs.v.new_zeros(len(chunk), h, cache.capacity, d)
                    mine.k[:, :, :shared] = theirs.k[:, :, :shared]
                    mine.v[:, :, :shared] = theirs.v[:, :, :shared]
                cache.length = shared
            logits = model(torch.tensor([prompts[i][shared:] for i in chunk]), cache=cache, last_only=True)
            for i, (ids, ended) in zip(chunk, _decode(model, cache, logits, cap, stop, temperature, generator)):
                out[i] = (tok.decode(ids), ended)
    return out


def _replies_padded(model, tok, prompts, cap: int, stop: int) -> list[tuple[str, bool]]:
    """:func:`replies` through ``generate_batch`` (left-padded, every prompt whole)."""
    from decoderlab.generation import SamplingParams, generate_batch

    params, out = SamplingParams(max_new_tokens=cap, stop=(stop,), temperature=0), []
    for i in range(0, len(prompts), BATCH):
        out += [(tok.decode(ids), len(ids) < cap)
                for ids in generate_batch(model, prompts[i:i + BATCH], params, tokenizer=tok)]
    return out


def _decode(model, cache, logits, cap: int, stop: int, temperature: float = 0.0,
            generator=None) -> list[tuple[list[int], bool]]:
    """Steps from the prefill's ``logits`` (B, 1, V) until every row has met ``stop`` or ``cap`` tokens: greedy, or
    sampled at ``temperature`` (> 0) from ``generator``. Once a quarter of the rows still stepped have ended, they
    leave the batch (their cache rows dropped): a card's replies end at 20-48 tokens, and a row that has ended
    would otherwise cost a full step until the longest is done."""
    import torch

    rows = [[] for _ in range(logits.size(0))]
    ended = [False] * len(rows)
    live = list(range(len(rows)))  # the original row of each row of the batch
    for step in range(cap):
        if temperature:
            probs = torch.softmax(logits[:, -1].float() / temperature, -1)
            nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            nxt = logits[:, -1].argmax(-1)
        for r, t in zip(live, nxt.tolist()):
            if not ended[r] and len(rows[r]) < cap:
                if t == stop:
                    ended[r] = True
                else:
                    rows[r].append(t)
        if all(ended) or step == cap - 1:
            break
        done = [k for k, r in enumerate(live) if ended[r]]
        if len(done) * 4 >= len(live):
            keep = torch.tensor([k for k, r in enumerate(live) if not ended[r]])
            cache.keep_rows(keep)
            live, nxt = [live[k] for k in keep.tolist()], nxt.index_select(0, keep)
        logits = model(nxt[:, None], cache=cache)
    return list(zip(rows, ended))


def run_calls(calls) -> list[str]:
    """The results of a reply's calls (``ParsedCall``): the calculator's, or ``error: ...`` as the tool loop
    writes them for a call that is not JSON or names another tool."""
    from decoderlab.chat import TOOLS

    out = []
    for c in calls:
        if c.error:
            out.append(f"error: {c.error}")
        elif c.name not in TOOLS:
            out.append(f"error: unknown tool {c.name!r}; tools: {', '.join(TOOLS)}")
        else:
            try:
                out.append(str(TOOLS[c.name].run(c.arguments)))
            except Exception as e:  # noqa: BLE001 -- a failing tool is a result, as in the tool loop
                out.append(f"error: {type(e).__name__}: {e}")
    return out


def calculator_on(model, tok, template, questions: list[str], system: str) -> list[dict]:
    """Each question answered with the calculator offered: the first reply (an answer, or calls read back by
    :func:`decoderlab.chat.parse_hermes_calls`); the calls run; then, batched, the reply after their results
    (one round, as the training conversations have). ``{"reply", "ended", "calls": [(arguments, result)]}``."""
    from decoderlab.chat import arguments_as_objects, parse_hermes_calls, tools_template

    t = tools_template(template)
    eot = t.end_of_turn_id(tok)
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
    first = replies(model, tok, [t.render(c, tok, add_generation_prompt=True)[0] for c in convs], CAP, eot)
    out, again = [], []
    for k, (text, ended) in enumerate(first):
        content, calls = parse_hermes_calls(text)
        if not calls:
            out.append({"reply": text, "ended": ended, "calls": []})
            continue
        results = run_calls(calls)
        ids = [f"call_{j}" for j in range(len(calls))]
        convs[k] += [{"role": "assistant", "content": content, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": c.name or "?", "arguments": c.arguments}}
            for i, c in zip(ids, calls)]}] + [{"role": "tool", "tool_call_id": i, "content": r}
                                             for i, r in zip(ids, results)]
        out.append({"reply": "", "ended": False, "calls": [(c.arguments, r) for c, r in zip(calls, results)]})
        again.append(k)
    prompts = [t.render(arguments_as_objects(convs[k]), tok, add_generation_prompt=True)[0] for k in again]
    for k, (text, ended) in zip(again, replies(model, tok, prompts, ANSWER_CAP, eot) if again else []):
        out[k].update(reply=text, ended=ended)
    return out


def score_rows(model, tok, template, items: dict, system: str, modes=("off", "on")) -> dict:
    """Every row's questions, the calculator off (the plain prompt) and on: ``{label: {"off": {...}, "on":
    {...}}}``, each with per-question ``right`` (the ``number`` reward: the reply's last number is the answer),
    ``replies`` and ``ended``; ``on`` also ``called`` and ``expression_right`` (the first call's result is the
    answer)."""
    from decoderlab.reinforcement.rewards import load_reward

    number, eot, out = load_reward("number"), template.end_of_turn_id(tok), {}
    for label, its in items.items():
        got, row = {}, {}
        if "off" in modes:
            plain = [template.render([{"role": "user", "content": i.question}], tok, add_generation_prompt=True)[0]
                     for i in its]
            got["off"] = [{"reply": r, "ended": e} for r, e in replies(model, tok, plain, CAP, eot)]
        if "on" in modes:
            got["on"] = calculator_on(model, tok, template, [i.question for i in its], system)
        for mode, g_ in got.items():
            row[mode] = {"right": [int(number(g["reply"], {"reference": i.answer}, g["ended"]) == 1)
                                   for g, i in zip(g_, its)],
                         "replies": [g["reply"] for g in g_], "ended": [g["ended"] for g in g_]}
        if "on" in got:
            on = got["on"]
            row["on"]["called"] = [bool(g["calls"]) for g in on]
            row["on"]["calls"] = [g["calls"] for g in on]
            row["on"]["expression_right"] = [bool(g["calls"]) and g["calls"][0][1] == i.answer
                                             for g, i in zip(on, its)]
        out[label] = row
        print(f"  {label}: " + ", ".join(f"{m} {sum(r['right'])}/{len(its)}" for m, r in row.items()), flush=True)
    return out


def france(model, tok, template) -> dict:
    """The README's question, greedy: the plain reply, and the reply with the calculator offered (the tool loop
    as ``decoderlab chat --tools calculator`` runs it, calls constrained)."""
    from decoderlab.chat import TOOLS, run_tool_turn

    plain = template.render([{"role": "user", "content": FRANCE}], tok, add_generation_prompt=True)[0]
    (off, _), = replies(model, tok, [plain], CHAT_CAP, template.end_of_turn_id(tok))
    turn = run_tool_turn(model, tok, [{"role": "user", "content": FRANCE}], template, TOOLS, temperature=0,
                         max_new_tokens=CHAT_CAP)
    return {"off": off, "on": turn.content, "on_calls": [c.arguments for c in turn.calls]}


def chat_replies(model, tok, template, prompts=CHAT_PROMPTS) -> dict[str, str]:
    """The base's greedy replies to ``prompts`` (plain prompt), cut at the last full sentence when they ran past
    ``CHAT_CAP``; a reply with no full sentence is dropped."""
    plain = [template.render([{"role": "user", "content": p}], tok, add_generation_prompt=True)[0]
             for p in prompts]
    out = {}
    for p, (text, ended) in zip(prompts, replies(model, tok, plain, CHAT_CAP, template.end_of_turn_id(tok))):
        text = text.strip()
        if not ended:
            text = text[:text.rfind(".") + 1]
        if text:
            out[p] = text
    return out


# ---------------------------------------------------------------------------------------------------------
# LoRA SFT, within a CPU-time budget
# ---------------------------------------------------------------------------------------------------------


def budget_callback(seconds: float, every: int):
    """A Lightning callback that ends training at the first step that is a multiple of ``every`` (an
    evaluation step: the adapter is exported after it) once ``seconds`` of CPU time have passed since the start
    of training; it records the steps and the seconds per step."""
    import lightning as L

    class Budget(L.Callback):
        def __init__(self):
            self.t0, self.steps, self.cpu_s = 0.0, 0, 0.0

        def on_train_start(self, trainer, pl_module):
            self.t0 = time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.steps, self.cpu_s = trainer.global_step, time.process_time() - self.t0
            if self.cpu_s >= seconds and self.steps % every == 0:
                trainer.should_stop = True

    return Budget()


def sft(args, base: str, out: Path, convs: list, val: list) -> dict:
    """LoRA (rank ``--lora-rank``, every attention and MLP projection) on ``convs`` from ``base``: batches of
    ``--batch`` conversations at a constant ``--lr`` after a short warm-up, until ``--sft-minutes`` of CPU time
    (or ``--max-steps``); the template is chatml-tools (the base's ChatML given its tool calls:
    ``finetune`` picks it for conversations that hold calls). Returns the steps and CPU seconds per step."""
    from decoderlab.finetuning import finetune
    from decoderlab.lora import lora_settings
    from decoderlab.training import TrainConfig

    budget = budget_callback(args.sft_minutes * 60, args.eval_every)
    finetune(convs, val_data=val, checkpoint=base, out=out, lora=lora_settings(args.lora_rank, args.lora_alpha),
             dtype=args.dtype,
             train_config=TrainConfig(max_steps=args.max_steps, batch_size=args.batch, lr=args.lr, min_lr=args.lr,
                                      warmup=args.warmup, eval_every=args.eval_every, val_batch_size=len(val),
                                      log_every=args.eval_every, precision=args.precision),
             eval_prompts=0, callbacks=[budget], progress_bar="plain", logger=False, accelerator="cpu")
    return {"steps": budget.steps, "cpu_s_per_step": round(budget.cpu_s / max(budget.steps, 1), 1),
            "conversations": budget.steps * args.batch}


# ---------------------------------------------------------------------------------------------------------
# RL on the row with the most room, and its equal-compute control
# ---------------------------------------------------------------------------------------------------------


def messages_of(item, mode: str, system: str) -> list[dict]:
    """``item``'s prompt: the question alone (the calculator ``off``) or after ``system`` (``on``: offered)."""
    head = [{"role": "system", "content": system}] if mode == "on" else []
    return head + [{"role": "user", "content": item.question}]


def tool_reward(reply: str, row: dict, ended: bool) -> float:
    """The reward of a first reply, the calculator offered or not: with a call, 1.0 when the first call's result
    (the calculator run on its arguments) is ``row["reference"]`` -- the answer after the result copies it (the
    card: every right call but a few misquotes) -- and without one, the ``number`` reward (the reply's last
    number is the reference). A one-turn rollout thus scores the calculator path without a tool round."""
    from decoderlab.chat import parse_hermes_calls
    from decoderlab.reinforcement.rewards import load_reward

    _, calls = parse_hermes_calls(reply)
    if calls:
        return float(run_calls(calls[:1])[0] == str(row["reference"]))
    return load_reward("number")(reply, row, ended)


def room(model, tok, template, system: str, seed: int = 7) -> dict:
    """Each of ``ROOM_ROWS``' pass@1 and pass@k (``ROOM_K`` samples at temperature 1 of ``ROOM_QUESTIONS`` train
    questions, scored by :func:`tool_reward`) and its room, pass@k - pass@1: what RL can lift by making a right
    sample the likely one."""
    from decoderlab.chat import tools_template
    from decoderlab.reportcard import row_label

    out = {}
    for skill, d, mode in ROOM_ROWS:
        its = generate(skill, "train", ROOM_QUESTIONS, seed=seed, difficulty=d)
        t = tools_template(template) if mode == "on" else template
        prompts = [t.render(messages_of(i, mode, system), tok, add_generation_prompt=True)[0] for i in its]
        got = replies(model, tok, [p for p in prompts for _ in range(ROOM_K)], CAP, t.end_of_turn_id(tok),
                      temperature=1.0, seed=seed)
        right = [[tool_reward(text, {"reference": i.answer}, ended) for text, ended in got[k * ROOM_K:][:ROOM_K]]
                 for k, i in enumerate(its)]
        p1 = sum(sum(r) / ROOM_K for r in right) / len(its)
        pk = sum(max(r) for r in right) / len(its)
        out[f"{row_label(skill, d)} | {mode}"] = {"skill": skill, "difficulty": d, "mode": mode, "pass1": p1,
                                                  "passk": pk, "room": pk - p1}
        print(f"  room {row_label(skill, d)}, calculator {mode}: pass@1 {p1:.2f}, pass@{ROOM_K} {pk:.2f}", flush=True)
    return out


def rl_row(args, out: Path) -> dict:
    """The RL row: ``--rl-row skill:difficulty:mode`` or the one of ``out/room.json`` with the most room."""
    if args.rl_row:
        skill, d, mode = args.rl_row.split(":")
        return {"skill": skill, "difficulty": int(d), "mode": mode}
    rooms = json.loads((out / "room.json").read_text())["rows"]
    return max(rooms.values(), key=lambda r: r["room"])


def rl_stage(args, out: Path, system: str, row: dict) -> dict:
    """GRPO with LoRA from the SFT run (``out/sft``) on ``--rl-prompts`` train questions of ``row``, rewarded by
    :func:`tool_reward`, with a KL penalty (``--kl-coef``) to the SFT model so the rows it does not train hold;
    until ``--rl-minutes`` of CPU time. Returns the steps and CPU seconds."""
    from decoderlab.config.rl import RLConfig
    from decoderlab.lora import lora_settings
    from decoderlab.reinforcement import rl
    from decoderlab.training import TrainConfig

    its = generate(row["skill"], "train", args.rl_prompts, seed=11, difficulty=row["difficulty"])
    prompts = [{"messages": messages_of(i, row["mode"], system), "reference": i.answer} for i in its]
    budget = budget_callback(args.rl_minutes * 60, args.rl_eval_every)
    rl(prompts, out=out / "rl", checkpoint=out / "sft", reward=tool_reward,
       rl_config=RLConfig(group_size=ROOM_K, max_new_tokens=CAP, temperature=1.0, kl_coef=args.kl_coef),
       train_config=TrainConfig(max_steps=args.max_steps, batch_size=args.rl_batch, lr=args.rl_lr, min_lr=args.rl_lr,
                                warmup=0, eval_every=args.rl_eval_every, log_every=args.rl_eval_every,
                                precision=args.precision),
       lora=lora_settings(args.lora_rank, args.lora_alpha), callbacks=[budget], progress_bar="plain", logger=False,
       accelerator="cpu")
    return {"steps": budget.steps, "cpu_s": round(budget.cpu_s, 1), "prompts": budget.steps * args.rl_batch}


def control_stage(args, out: Path, system: str, row: dict, cpu_s: float) -> dict:
    """The equal-compute control: more LoRA SFT from ``out/sft`` on the references of the RL row's train
    questions (the RL run's prompts, answered ``EXPRESSION = RESULT.``, through the calculator when it is on),
    for ``cpu_s`` of CPU time (the RL run's)."""
    from decoderlab.finetuning import finetune
    from decoderlab.lora import lora_settings
    from decoderlab.training import TrainConfig

    its = generate(row["skill"], "train", args.rl_prompts, seed=11, difficulty=row["difficulty"])
    convs = [tool_conversation(i, system) if row["mode"] == "on" else messages_of(i, "off", system) + [
        {"role": "assistant", "content": f"{expression_of(i.question)} = {i.answer}."}] for i in its]
    budget = budget_callback(cpu_s, args.rl_eval_every)
    finetune(convs[8:], val_data=convs[:8], checkpoint=out / "sft", out=out / "control",
             lora=lora_settings(args.lora_rank, args.lora_alpha), dtype=args.dtype,
             train_config=TrainConfig(max_steps=args.max_steps, batch_size=args.batch, lr=args.lr / 2,
                                      min_lr=args.lr / 2, warmup=0, eval_every=args.rl_eval_every,
                                      val_batch_size=8, log_every=args.rl_eval_every, precision=args.precision),
             eval_prompts=0, callbacks=[budget], progress_bar="plain", logger=False, accelerator="cpu")
    return {"steps": budget.steps, "cpu_s": round(budget.cpu_s, 1), "conversations": budget.steps * args.batch}


def score_stage(args, out: Path, name: str, items: dict, system: str, clock, modes=("off", "on")) -> dict:
    """``out/NAME``'s (``sft``, ``rl``, ``control``; ``base``: the GGUF file) greedy scores on ``items``, the
    calculator in ``modes``."""
    import torch

    torch.set_num_threads(args.eval_threads)
    if name == "base":
        model, tok, template = load_chat_base(args.base, args.eval_dtype)
    else:
        model, tok, template = load_scored(out / name, args.eval_dtype)
    with torch.no_grad():
        return clock.run(f"{name} card", score_rows, model, tok, template, items, system, modes)


# ---------------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------------


def cell(right: list[int]) -> str:
    from decoderlab.reportcard.stats import wilson

    lo, hi = wilson(sum(right), len(right))
    return f"{sum(right)}/{len(right)} = {100 * sum(right) / len(right):.0f}% [{100 * lo:.0f}, {100 * hi:.0f}]"


def difference(first: list[int], second: list[int]) -> str:
    from decoderlab.reportcard.stats import PairedTable, paired_interval

    table = PairedTable(sum(a and b for a, b in zip(first, second)), sum(a and not b for a, b in zip(first, second)),
                        sum(b and not a for a, b in zip(first, second)),
                        sum(not a and not b for a, b in zip(first, second)))
    d, lo, hi = paired_interval(table)
    return f"{100 * d:+.0f} [{100 * lo:+.0f}, {100 * hi:+.0f}]"


def rl_markdown(out: Path, rl_label: str, row: dict) -> str:
    """The RL table: every row the SFT, RL and control models were scored on (the card's rows, both modes, and
    the RL row in its mode), each ``k/n = p% [Wilson]``, RL - SFT, control - SFT and RL - control with their
    paired 95% intervals; then the room measured and the stages' costs."""
    sft_, base_row = json.loads((out / "sft.json").read_text()), json.loads((out / "rlrow.json").read_text())
    rl_, ctl = (json.loads((out / f"{s}.json").read_text()) for s in ("rl", "control"))
    sft_scores = {**sft_["scores"], rl_label: base_row["scores"]["sft"][rl_label]}
    lines = ["| held-out row | calculator | SFT | RL | control | RL - SFT | control - SFT | RL - control |",
             "|---|---|---|---|---|---|---|---|"]
    for label, row_ in rl_["scores"].items():
        for mode in row_:
            s, r, c = sft_scores[label][mode]["right"], row_[mode]["right"], ctl["scores"][label][mode]["right"]
            lines.append(f"| {label} | {mode} | {cell(s)} | {cell(r)} | {cell(c)} | {difference(s, r)} | "
                         f"{difference(s, c)} | {difference(c, r)} |")
    b = base_row["scores"]["base"][rl_label][row["mode"]]["right"]
    lines += ["", f"base on the RL row: {cell(b)}"]
    if (out / "room.json").is_file():
        lines += ["", "| row (train questions, SFT model) | calculator | pass@1 | pass@8 | room |", "|---|---|---|---|---|"]
        lines += [f"| {k.split(' | ')[0]} | {v['mode']} | {v['pass1']:.2f} | {v['passk']:.2f} | {v['room']:.2f} |"
                  for k, v in json.loads((out / "room.json").read_text())["rows"].items()]
    lines += ["", f"RL: {rl_['trained']}; control: {ctl['trained']}", "", "| stage | wall s | CPU-min |",
              "|---|---|---|"]
    for rec in (json.loads((out / "room.json").read_text()) if (out / "room.json").is_file() else {},
                rl_, ctl, base_row):
        lines += [f"| {k} | {v['wall_s']:.0f} | {v['cpu_s'] / 60:.1f} |" for k, v in rec.get("stages", {}).items()]
    return "\n".join(lines) + "\n"


def markdown(scores: dict, chat: dict, record: dict) -> str:
    """The card: a row per (task, calculator off / on), base and SFT each ``k/n = p% [Wilson 95%]``, SFT - base
    in points with its paired 95% interval, and the SFT model's calls (how many called, how many computed the
    right expression); the France question's replies; the stages' costs."""
    lines = ["| held-out row | calculator | base | SFT | SFT - base (paired 95%) | SFT called / right expression |",
             "|---|---|---|---|---|---|"]
    for label in scores["base"]:
        for mode in ("off", "on"):
            b, s = scores["base"][label][mode], scores["sft"][label][mode]
            calls = (f"{sum(s['called'])} / {sum(s['expression_right'])} (base {sum(b['called'])} / "
                     f"{sum(b['expression_right'])})" if mode == "on" else "")
            lines.append(f"| {label} | {mode} | {cell(b['right'])} | {cell(s['right'])} | "
                         f"{difference(b['right'], s['right'])} | {calls} |")
    lines += ["", f"{FRANCE!r}:"]
    for stage in ("base", "sft"):
        for mode in ("off", "on"):
            lines.append(f"- {stage}, calculator {mode}: {chat[stage][mode]!r}")
    lines += ["", "| stage | wall s | CPU-min |", "|---|---|---|"]
    lines += [f"| {k} | {v['wall_s']:.0f} | {v['cpu_s'] / 60:.1f} |" for k, v in record["stages"].items()]
    total = sum(v["cpu_s"] for v in record["stages"].values()) / 60
    lines.append(f"| total | {sum(v['wall_s'] for v in record['stages'].values()):.0f} | {total:.1f} |")
    s = record["sft"]
    lines += ["", f"SFT: {s['steps']} steps of {record['args']['batch']} conversations ({s['conversations']} seen), "
                  f"{s['cpu_s_per_step']:.0f} CPU-s a step; LoRA rank {record['args']['lora_rank']}, lr "
                  f"{record['args']['lr']:g}; {record['args']['threads']} thread(s); scoring on "
                  f"{record['args']['eval_threads']}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="a chat model: SmolLM2-135M-Instruct's GGUF file (or any "
                                                  "checkpoint whose template is SmolLM2's ChatML)")
    ap.add_argument("--out", default="runs/real")
    ap.add_argument("--sft-record", default="{}", help="with --stage sft-card: the SFT run's costs (JSON)")
    ap.add_argument("--stage", choices=("all", "base", "sft", "sft-card", "card", "room", "rl", "control",
                                        "rl-card"), default="all",
                    help="base / sft: one stage (its JSON in --out; the two may run at once); card: join them; "
                         "room: the SFT model's pass@1 and pass@8 on train questions; rl / control: GRPO on the "
                         "row with the most room and the equal-compute SFT, each scored; rl-card: their table")
    ap.add_argument("--rl-row", default="", help="skill:difficulty:on|off (default: the most room in room.json)")
    ap.add_argument("--rl-minutes", type=float, default=12.0, help="RL's CPU-time budget (the control's too)")
    ap.add_argument("--rl-prompts", type=int, default=400, help="train questions of the RL row")
    ap.add_argument("--rl-batch", type=int, default=4, help="prompts per RL step (each sampled 8 times)")
    ap.add_argument("--rl-lr", type=float, default=2e-4)
    ap.add_argument("--kl-coef", type=float, default=0.05, help="the KL penalty to the SFT model")
    ap.add_argument("--rl-eval-every", type=int, default=5)
    ap.add_argument("--rl-questions", type=int, default=400, help="held-out questions of the RL row")
    ap.add_argument("--trained", default="", help="with --stage rl / control: score the run's last export only, "
                                                   "recording these costs (JSON: a run stopped by hand)")
    ap.add_argument("--card-modes", default="off,on", help="the calculator modes the RL and control models are "
                                                          "scored in on the card's rows (off,on; off alone saves "
                                                          "the calculator's second round)")
    ap.add_argument("--questions", type=int, default=QUESTIONS,
                    help=f"held-out questions per row (default {QUESTIONS}, at least {MIN_QUESTIONS})")
    ap.add_argument("--train-conversations", type=int, default=1200, help="conversations generated for SFT (more "
                                                                         "than the budget sees; the rest unused)")
    ap.add_argument("--sft-minutes", type=float, default=7.0, help="SFT's CPU-time budget in minutes")
    ap.add_argument("--max-steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=8e-4)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    ap.add_argument("--threads", type=int, default=1, help="PyTorch threads of SFT")
    ap.add_argument("--precision", choices=PRECISIONS, default="32",
                    help="SFT's, RL's and the control's training precision (bf16-mixed: the products autocast to "
                         "bfloat16, float32 weights and optimizer state; 1.7x faster a LoRA step on an AVX512-BF16 "
                         "CPU)")
    ap.add_argument("--dtype", choices=("auto", "float32"), default="float32",
                    help="the frozen base under the adapters: float32 (dequantized; a step ~1.45x faster than "
                         "auto on AVX2) or auto (the GGUF file's blocks, the file's memory)")
    ap.add_argument("--eval-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the matrices of every scored model (the cards, the room): float32 (the base's file in its "
                         "own blocks) or bfloat16 (as a BF16 file runs: float32 activations; 1.55x less CPU time on "
                         "an AVX512-BF16 CPU)")
    ap.add_argument("--eval-threads", type=int, default=1, help="PyTorch threads of the scoring (greedy replies; "
                                                                   "two on a shared 2-core machine mostly wait)")
    args = ap.parse_args(argv)
    if args.questions < MIN_QUESTIONS:
        ap.error(f"--questions {args.questions} is under {MIN_QUESTIONS}: a row's 95% interval on so few held-out "
                 f"questions is wider than the effects the card shows; give at least {MIN_QUESTIONS}")
    return args


def load_chat_base(path, eval_dtype: str = "float32"):
    """The base model, tokenizer and template (its matrices in ``eval_dtype``: :func:`load_scored`); refuses one
    without a chat template, by name."""
    model, tok, template = load_scored(path, eval_dtype)
    if template is None:
        raise SystemExit(f"--base {path} is not a chat model (it carries no chat template); recipe_real.py "
                         f"fine-tunes a chat model such as SmolLM2-135M-Instruct")
    return model, tok, template


def load_scored(path, eval_dtype: str = "float32"):
    """``(model, tokenizer, template)`` of ``path`` (the GGUF base or a run) as the card scores it: ``float32``
    -- a run merged into float32, the base's file in its own blocks (:func:`decoderlab.chat.load_model`'s
    default) -- or ``bfloat16``: every matrix rounded to bfloat16 and multiplied as a BF16 file's are
    (:func:`decoderlab.half.use_half_weights`: float32 activations, norms and KV cache; on an AVX512-BF16 CPU
    vdpbf16ps at any row count, SmolLM2's greedy card 1.55x less CPU time than float32's here)."""
    from decoderlab.chat import load_model
    from decoderlab.half import use_half_weights

    if eval_dtype == "float32":
        model, tok, template, _ = load_model(path)
    else:
        model, tok, template, _ = load_model(path, dtype="bfloat16")
        use_half_weights(model)
    return model.eval(), tok, template


def base_stage(args, out: Path, items: dict) -> dict:
    """The base's card and France replies (``out/base.json``)."""
    import torch

    clock = Clock()
    model, tok, template = load_chat_base(args.base, args.eval_dtype)
    system = tool_system(template)
    with torch.no_grad():
        scores = clock.run("base card", score_rows, model, tok, template, items, system)
        france_ = france(model, tok, template)
    print(f"France, base: {france_}", flush=True)
    record = {"scores": scores, "france": france_, "stages": clock.stages}
    (out / "base.json").write_text(json.dumps(record))
    return record


def sft_stage(args, out: Path, items: dict) -> dict:
    """LoRA SFT from the base (the base's chat replies: ``out/chat.json``, made when absent), then the SFT model's
    card and France replies (``out/sft.json``)."""
    import torch

    clock = Clock()
    model, tok, template = load_chat_base(args.base)
    system = tool_system(template)
    replies_ = json.loads((out / "chat.json").read_text()) if (out / "chat.json").is_file() else {}
    missing = [p for p in CHAT_PROMPTS if p not in replies_]  # (a reply the base did not finish stays missing)
    if missing:
        with torch.no_grad():
            replies_.update(clock.run("chat replies", chat_replies, model, tok, template, missing))
        (out / "chat.json").write_text(json.dumps(replies_))
    replies_ = {p: r for p, r in replies_.items() if p in CHAT_PROMPTS}
    del model
    convs = sft_conversations(args.train_conversations, system, replies_, seed=0)
    val = sft_conversations(4, system, replies_, seed=1)
    torch.set_num_threads(args.threads)
    trained = clock.run("sft", sft, args, args.base, out / "sft", convs, val)
    return sft_card(args, out, items, system, clock, trained)


def sft_card(args, out: Path, items: dict, system: str, clock, trained: dict) -> dict:
    """The SFT model's (``out/sft``) card and France replies, written to ``out/sft.json`` with ``trained`` (the
    SFT run's steps and costs)."""
    import torch

    torch.set_num_threads(args.eval_threads)
    model, tok, template = load_scored(out / "sft", args.eval_dtype)
    with torch.no_grad():
        scores = clock.run("sft card", score_rows, model, tok, template, items, system)
        france_ = france(model, tok, template)
    print(f"France, SFT: {france_}", flush=True)
    record = {"scores": scores, "france": france_, "stages": clock.stages, "sft": trained}
    (out / "sft.json").write_text(json.dumps(record))
    return record


def main(argv=None) -> int:
    """``--stage all`` (default): base, then SFT, then the card. ``base`` / ``sft`` run one (each writes its
    JSON; they may run at once, as two processes) and ``card`` joins them."""
    import torch

    from decoderlab.reportcard import row_label

    args = parse(argv)
    torch.set_num_threads(args.eval_threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    items = {row_label(s, d): generate(s, "held-out", args.questions, seed=0, difficulty=d) for s, d in ROWS}
    if args.stage in ("all", "base"):
        base_stage(args, out, items)
    if args.stage in ("all", "sft"):
        sft_stage(args, out, items)
    if args.stage == "sft-card":  # an SFT run stopped by hand: its last export, the costs its log gave
        template = load_chat_base(args.base)[2]
        meta = json.loads((out / "sft" / "meta.json").read_text())
        given, clock = json.loads(args.sft_record), Clock()
        clock.stages.update(given.pop("stages", {}))
        trained = {"steps": meta["step"], "conversations": meta["step"] * args.batch, **given}
        sft_card(args, out, items, tool_system(template), clock, trained)
    if args.stage in ("room", "rl", "control", "rl-card"):
        return rl_stages(args, out, items)
    if args.stage not in ("all", "card"):
        return 0
    base, tuned = (json.loads((out / f"{s}.json").read_text()) for s in ("base", "sft"))
    stages = {**base["stages"], **tuned["stages"]}
    record = {"args": vars(args), "sft": tuned["sft"], "stages": stages}
    scores, chat = {"base": base["scores"], "sft": tuned["scores"]}, {"base": base["france"], "sft": tuned["france"]}
    text = markdown(scores, chat, record)
    (out / "card.md").write_text(text, encoding="utf-8")
    (out / "card.json").write_text(json.dumps({**record, "scores": scores, "france": chat,
                                               "questions": {k: [i.question for i in v] for k, v in items.items()}}))
    print(text)
    return 0


def rl_stages(args, out: Path, items: dict) -> int:
    """``--stage room``: ``out/room.json``; ``rl`` / ``control``: train, then score on the card's rows and the RL
    row (``out/rl.json``, ``out/control.json``); ``rl-card``: the base and SFT on the RL row, and the table
    (``out/rl-card.md``)."""
    import torch

    from decoderlab.reportcard import row_label

    clock = Clock()
    system = tool_system(load_chat_base(args.base)[2])
    if args.stage == "room":
        torch.set_num_threads(args.eval_threads)
        model, tok, template = load_scored(out / "sft", args.eval_dtype)
        with torch.no_grad():
            rows = clock.run("room", room, model, tok, template, system)
        (out / "room.json").write_text(json.dumps({"rows": rows, "stages": clock.stages}))
        return 0
    row = rl_row(args, out)
    label = f"{row_label(row['skill'], row['difficulty'])} (RL row)"
    rl_items = {label: generate(row["skill"], "held-out", args.rl_questions, seed=0, difficulty=row["difficulty"])}
    if args.stage in ("rl", "control"):
        torch.set_num_threads(args.threads)
        if args.trained:  # a run stopped by hand: its last export scored, with the costs its log gave
            trained = json.loads(args.trained)
        elif args.stage == "rl":
            trained = clock.run("rl", rl_stage, args, out, system, row)
        else:  # the same CPU-time budget as RL's (both stop at the first export after it): the two may run at once
            trained = clock.run("control", control_stage, args, out, system, row, args.rl_minutes * 60)
        record = {"row": row, "trained": trained, "scores": {}, "stages": clock.stages}
        for group, modes in ((rl_items, (row["mode"],)), *(({k: v}, args.card_modes.split(",")) for k, v in
                                                            items.items())):
            record["scores"].update(score_stage(args, out, args.stage, group, system, clock, modes))
            (out / f"{args.stage}.json").write_text(json.dumps(record))  # each row as it is scored
        return 0
    if not (out / "rlrow.json").is_file():
        scores = {name: score_stage(args, out, name, rl_items, system, clock, (row["mode"],))
                  for name in ("base", "sft")}
        (out / "rlrow.json").write_text(json.dumps({"scores": scores, "stages": clock.stages}))
    text = rl_markdown(out, label, row)
    (out / "rl-card.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
