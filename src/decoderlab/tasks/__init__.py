"""Checkable tasks: seeded generators of questions a program can score, split into train and held-out by a
hash of the question, written as chat JSONL for ``finetune`` or as prompts for ``rl``.

    skills.py   one generator per kind of question (addition, letter_count, larger, big_multiplication ...),
                its difficulty knob and the registered reward that scores it
    make.py     items of a task, the split, and the rows fine-tuning and RL read

Families (``--task``): ``arithmetic`` (addition and subtraction of 1-4 digit numbers, multiplication up to 2x2
digits), ``spelling`` (letter counts, a word backwards, its first/last letter; words of the embedded corpus),
``comparison`` (the larger of two numbers, the smallest of a short list), ``tool`` (3- and 4-digit
multiplication, answered through the ``calculator`` tool), ``words`` (word problems of one or two steps,
:mod:`.words`, answered through the calculator too). Pure Python: no torch, nothing downloaded.

    >>> from decoderlab.tasks import generate
    >>> item = generate("addition", "held-out", 1, difficulty=3)[0]
    >>> item.reward, int(item.answer) == eval(item.question[8:-1])
    ('number', True)
"""

from .make import (CALCULATOR, FORMATS, HELD_OUT_SHARE, SPLITS, Item, calculator_call, conversation, expression_of,
                   generate, row, skills_of, split_of, task_names, write_rows)
from .skills import FAMILIES, SKILLS, Skill, corpus_words

__all__ = ["CALCULATOR", "FAMILIES", "FORMATS", "HELD_OUT_SHARE", "SKILLS", "SPLITS", "Item", "Skill",
           "calculator_call", "conversation", "corpus_words", "expression_of", "generate", "row", "skills_of",
           "split_of", "task_names", "write_rows"]
