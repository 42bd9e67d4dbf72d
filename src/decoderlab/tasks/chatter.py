"""Ordinary chat for the fine-tuning mix, so a model taught the tasks still talks: "Tell me a story about
WORD." answered by a passage of the embedded corpus that holds the word. Not checkable (no reward); seeded."""

from __future__ import annotations

import random
import re

from .skills import CORPUS

#: the passage an answer holds, in characters (whole lines, cut at a line's end)
PASSAGE_CHARS = (80, 220)
STORY_PROMPTS = ("Tell me a story about {w}.", "Write a few lines about {w}.", "Say something about {w}.")


def passages() -> list[str]:
    """The corpus's speeches (blocks between blank lines), the speaker's name dropped, cut to
    ``PASSAGE_CHARS``."""
    out = []
    for block in CORPUS.read_text(encoding="utf-8").split("\n\n"):
        lines = block.strip().split("\n")[1:]  # the first line names the speaker
        text = ""
        for line in lines:
            if len(text) + len(line) > PASSAGE_CHARS[1]:
                break
            text = f"{text} {line}".strip()
        if len(text) >= PASSAGE_CHARS[0]:
            out.append(text)
    return out


def story_conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """``n`` conversations: a story prompt naming a word of a passage (5 letters or more), the passage as the
    answer."""
    rng = random.Random(f"chatter:{seed}")
    pool = passages()
    out = []
    while len(out) < n:
        text = pool[rng.randrange(len(pool))]
        words = [w for w in re.findall(r"[a-z]+", text.lower()) if len(w) >= 5]
        if not words:
            continue
        prompt = rng.choice(STORY_PROMPTS).format(w=rng.choice(words))
        out.append([{"role": "user", "content": prompt}, {"role": "assistant", "content": text}])
    return out
