"""An instruction set built from TinyStories text: "write a short story with these three words" -> the text.

TinyStories (Eldan & Li 2023, "TinyStories: How Small Can Language Models Be and Still Speak Coherent
English?"), data licensed CDLA-Sharing-1.0. decoderlab does not ship the text: :func:`build_story_set` reads
a TinyStories text file you give it (the project's ``shared/data/tinystories_val_slice.txt``, the opening
~155k words of the validation split, stories and paragraphs separated by blank lines) and builds the set at
run time, so any file made from it carries the data's licence, not decoderlab's.

Each unit is a paragraph. Its prompt asks for a short story using three content words drawn from the
paragraph (lower-case alphabetic words of 3+ letters that are not function words such as "with" or
"they"); the paragraph is the assistant's reply. Units are split (seeded) into training and held-out sets.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

# the one definition of "uses the word" (the contains_words reward scores it)
from .reinforcement.rewards import word_coverage  # noqa: F401

#: function words and very common verbs/adverbs that make poor "content" words
FUNCTION_WORDS = frozenset("""
a an the and or but so if then than that this these those there here where when what who whom whose which
why how all any some many much more most very too also not no yes just only even still again ever never
always once upon time day one two three first last next other another each every both few own same such
i me my mine we us our ours you your yours he him his she her hers it its they them their theirs
am is are was were be been being do does did done have has had having can could will would shall should
may might must get got go went gone come came say said says tell told ask asked see saw seen look looked
make made take took know knew think thought want wanted like liked let put give gave find found feel felt
with without within into onto from for to of in on at by about above below over under up down out off
around through after before because while until as near far away back together
now soon then today tomorrow yesterday really well maybe lot lots
oh wow hi hello okay yes ok
didn don doesn isn wasn weren couldn wouldn shouldn won aren hasn haven let
""".split())

_WORD = re.compile(r"[A-Za-z]+")


def content_words(text: str) -> list[str]:
    """Distinct lower-case content words of ``text`` in order of first appearance (3+ letters, not in
    ``FUNCTION_WORDS``, not capitalised mid-sentence names)."""
    out: dict[str, None] = {}
    for m in _WORD.finditer(text):
        w = m.group(0)
        if not w.islower() or len(w) < 3 or w in FUNCTION_WORDS:
            continue
        out.setdefault(w)
    return list(out)


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"']?\s+")


def lead_words(text: str) -> list[str]:
    """Content words of ``text``'s opening sentences: sentence by sentence from the start until at least
    three distinct content words are collected (all of ``text`` if it has fewer)."""
    sentences = _SENTENCE_END.split(text)
    for k in range(1, len(sentences) + 1):
        words = content_words(" ".join(sentences[:k]))
        if len(words) >= 3:
            return words
    return content_words(text)


def story_prompt(words: list[str]) -> str:
    """The user turn asking for a story with ``words``."""
    return f"Write a short story with the words: {', '.join(words)}."


def paragraphs(text: str, min_chars: int = 60, max_chars: int = 400) -> list[str]:
    """Blank-line-separated units of ``text`` with ``min_chars`` to ``max_chars`` characters (whitespace
    inside a unit collapsed)."""
    units = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    return [u for u in units if min_chars <= len(u) <= max_chars]


def build_story_set(path: str | os.PathLike, *, holdout: float = 0.1, seed: int = 0, prompts_per_unit: int = 1,
                    min_chars: int = 60, max_chars: int = 400, order: str = "random",
                    first_words: int | None = None, words_from: str = "all"):
    """``(train, held_out, train_texts, held_out_texts)`` from a TinyStories text file.

    ``train`` / ``held_out``: lists of conversations ``[{"role": "user", "content": prompt}, {"role":
    "assistant", "content": paragraph}]``; a training unit gets ``prompts_per_unit`` prompts with different
    word triples (more examples of the skill from the same text), a held-out unit one. The units are split
    by a seeded shuffle; ``holdout`` is the held-out share. ``*_texts``: the units themselves (for
    pre-training on the training units only). ``order``: "random" (the words in the order drawn) or "text"
    (in the order of their first appearance in the paragraph). ``first_words``: draw the three words from
    the paragraph's first ``first_words`` content words only (None: from all). ``words_from``: "all" (the
    whole paragraph) or "lead" (the content words of the paragraph's opening sentences, as few as give 3
    distinct content words: the story can use the words at once, close to the prompt). The split depends
    only on ``seed``.

    Raises:
        FileNotFoundError: no such file.  ValueError: fewer than 10 usable units; holdout outside (0, 1).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no TinyStories text file at {path}")
    if first_words is not None and first_words < 3:
        raise ValueError(f"first_words must be None or >= 3, got {first_words!r}")
    if words_from not in ("all", "lead"):
        raise ValueError(f"words_from must be 'all' or 'lead', got {words_from!r}")
    if order not in ("random", "text"):
        raise ValueError(f"order must be 'random' or 'text', got {order!r}")
    if not 0 < holdout < 1:
        raise ValueError(f"holdout must be in (0, 1), got {holdout!r}")
    units = [u for u in paragraphs(path.read_text(encoding="utf-8"), min_chars, max_chars)
             if len(content_words(u)) >= 3]
    if len(units) < 10:
        raise ValueError(f"{path} has only {len(units)} usable paragraphs; at least 10 are needed")
    rng = random.Random(seed)
    shuffled = list(range(len(units)))  # (not ``order``: that is the word-order option)
    rng.shuffle(shuffled)
    k = max(1, round(holdout * len(units)))
    held_idx, train_idx = sorted(shuffled[:k]), sorted(shuffled[k:])

    def convs(idx, n):
        out = []
        for i in idx:
            words = content_words(units[i])
            pool = lead_words(units[i]) if words_from == "lead" else words
            for _ in range(n):
                pick = rng.sample(pool[:first_words] if first_words else pool, 3)
                if order == "text":
                    pick.sort(key=words.index)
                out.append([{"role": "user", "content": story_prompt(pick)},
                            {"role": "assistant", "content": units[i]}])
        return out

    train = convs(train_idx, prompts_per_unit)
    held = convs(held_idx, 1)
    return train, held, [units[i] for i in train_idx], [units[i] for i in held_idx]


def words_of_prompt(prompt: str) -> list[str]:
    """The requested words of a :func:`story_prompt`."""
    tail = prompt.split(":", 1)[1].strip().rstrip(".")
    return [w.strip() for w in tail.split(",")]


