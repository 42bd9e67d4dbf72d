"""One vocabulary of options across every command: the test walks every command's parser (``decoderlab --help``'s
table, subcommands included) and holds five rules. Each rule is a table below; a new option that breaks one fails
with a message saying what to rename, and a new exception is one row with its reason.

1. ``SPELLINGS``: one spelling per option. Each canonical spelling lists the spellings that mean the same thing
   elsewhere (other tools' names, near misses); none of them may appear.
2. Near spellings (``--no-progress`` beside ``--no-progress-bar``, ``--seed`` beside ``--seeds``): two spellings
   one word or one plural ``s`` apart are one option spelled twice, unless ``DISTINCT`` says what each means.
3. One spelling, one kind: an option that is a flag in one command is a flag in all (``sae --resume`` was a flag
   where ``train --resume`` takes an optional directory).
4. A positional argument is not another command's option: one thing is either ``--out PATH`` or ``OUT``
   everywhere (``export RUN_DIR OUT`` beside ``--checkpoint`` / ``--out``), and never both in one command
   (``generate PROMPT`` beside ``--prompt``).
5. ``--threads``: every command that computes takes it, from the shared group (``cli/options.py``'s
   ``THREADS_OPTIONS``); ``NO_COMPUTE`` lists the commands that do not, with why.
6. One spelling, one vocabulary of values: the names an option takes in one command are names it takes in every
   other (``export --dtype f16`` beside ``generate --dtype float16``). Each command's choices must lie within
   the largest command's, or within ``VALUES`` (the names of an option checked outside argparse, such as
   ``--dtype`` by the loader); ``VALUES_MAY_DIFFER`` lists one spelling that means two things, with why.
"""

from __future__ import annotations

import argparse
import re

import pytest

from decoderlab.cli.options import THREADS_OPTIONS
from decoderlab.config.names import AUTO_DTYPE, DTYPES
from decoderlab.cli.parser import build_parser

#: the one spelling of an option -> the spellings of the same thing that must not appear beside it
SPELLINGS = {
    "--checkpoint": ("--ckpt", "--model", "--model-dir", "--checkpoint-dir", "--run-dir", "--load", "--init-from"),
    "--out": ("--output", "--output-dir", "--out-dir", "--outdir", "--save-dir", "--save", "-o"),
    "--threads": ("--num-threads", "--n-threads", "--nthreads", "--jobs", "-j", "--intra-op-threads"),
    "--no-progress-bar": ("--no-progress", "--no-bar", "--plain", "--quiet-progress"),
    "--resume": ("--resume-from", "--continue", "--restore"),
    "--max-new-tokens": ("--new-tokens", "--num-tokens", "--n-tokens", "--max-length", "--length",
                         "--tokens-to-generate"),
    "--max-steps": ("--steps", "--iters", "--max-iters", "--num-steps", "--n-steps"),
    "--lr": ("--learning-rate",),
    "--seed": ("--random-seed", "--rng-seed"),
    "--temperature": ("--temp",),
    "--top-k": ("--topk",),
    "--top-p": ("--topp", "--nucleus"),
    "--d-model": ("--n-embd", "--hidden-size", "--dim", "--d-embed"),
    "--n-layer": ("--n-layers", "--num-layers", "--num-hidden-layers"),
    "--n-head": ("--n-heads", "--num-heads", "--num-attention-heads"),
    "--max-len": ("--block-size", "--context", "--context-length", "--seq-len", "--max-seq-len", "--n-ctx"),
    "--batch-size": ("--bs", "--batch"),
    "--data": ("--dataset", "--corpus", "--input", "--train-data", "--text-file"),
    "--system": ("--system-prompt", "--system-message"),
    "--sae": ("--sae-dir", "--dictionary"),
    "--pos": ("--position-index", "--token-position", "--at"),
    "--dtype": ("--weights-dtype", "--outtype", "--weight-type"),
}

#: spellings one word or a plural apart that mean different things (why, each)
DISTINCT = {
    frozenset({"--device", "--devices"}): "where the model runs, vs Lightning's processes per node",
    frozenset({"--token", "--tokens"}): "lens: the token whose logit is split, vs sae/features: how many are read",
    frozenset({"--l1", "--l1-coefficient"}): "sae: the ReLU + L1 variant, vs the weight of its penalty",
    frozenset({"--n", "--n-head"}): "tasks make: how many questions, vs the model's heads",
    frozenset({"--n", "--n-layer"}): "tasks make: how many questions, vs the model's layers",
}

#: spellings whose kind (flag, value, optional value, list) may differ between commands (why, each)
KINDS_MAY_DIFFER: dict[str, str] = {}

#: the names an option takes where some command checks them outside argparse (no ``choices`` to compare)
VALUES = {"--dtype": (AUTO_DTYPE, *DTYPES)}  # (auto: the shared --dtype takes it too, its default)

#: spellings whose values are different things in different commands (why, each)
VALUES_MAY_DIFFER = {"--format": "export: a file format (hf, gguf), vs tasks make: a question's layout (chat, ...)"}

#: commands that compute nothing with torch, so take no --threads (why, each)
NO_COMPUTE = {
    "tasks make": "writes questions drawn by a seed as JSONL: no model",
    "export": "copies a checkpoint's weights into another format: no forward pass",
}


def _kind(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "a flag"
    if action.nargs == "?":
        return "an optional value"
    if isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*"):
        return "a list"
    return "a value"


def commands(parser: argparse.ArgumentParser, prefix: str = ""):
    """``(name, parser)`` of every command with options of its own, subcommands as "tasks make"."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                full = f"{prefix} {name}".strip()
                if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                    yield from commands(sub, full)
                else:
                    yield full, sub


def vocabulary(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    """command -> its arguments (options and positionals), less --help."""
    return {name: [a for a in sub._actions if not isinstance(a, argparse._HelpAction)]
            for name, sub in commands(parser)}


def _words(spelling: str) -> list[str]:
    return spelling.lstrip("-").split("-")


def _near(a: str, b: str) -> bool:
    """``b`` is ``a`` with one more word, or ``a`` plural."""
    wa, wb = _words(a), _words(b)
    return (len(wb) == len(wa) + 1 and wb[:len(wa)] == wa) or b == a + "s"


def problems(vocab: dict[str, list[argparse.Action]]) -> list[str]:
    """Every broken rule of the module docstring, one line each, saying what to rename."""
    found = []
    where: dict[str, dict[str, list[str]]] = {}  # spelling -> kind -> commands
    for command, actions in vocab.items():
        for a in actions:
            for spelling in a.option_strings:
                where.setdefault(spelling, {}).setdefault(_kind(a), []).append(command)
    banned = {bad: good for good, bads in SPELLINGS.items() for bad in bads}
    for spelling, kinds in sorted(where.items()):
        users = sorted({c for cs in kinds.values() for c in cs})
        if spelling in banned:
            found.append(f"{', '.join(users)}: {spelling} is spelled {banned[spelling]} in this house; rename it "
                         f"(tests/cli/test_vocabulary.py SPELLINGS)")
        if len(kinds) > 1 and spelling not in KINDS_MAY_DIFFER:
            said = "; ".join(f"{kind} in {', '.join(sorted(set(cs)))}" for kind, cs in sorted(kinds.items()))
            found.append(f"{spelling} is {said}: make it one kind everywhere")
    for a in sorted(where):
        for b in sorted(where):
            if a != b and a.startswith("--") and _near(a, b) and frozenset({a, b}) not in DISTINCT:
                found.append(f"{a} and {b} look like one option spelled twice: use one spelling, or if they mean "
                             f"different things add the pair to DISTINCT with why")
    for command, actions in vocab.items():
        own = {s for a in actions for s in a.option_strings}
        for a in actions:
            if a.option_strings or isinstance(a, argparse._SubParsersAction):
                continue
            spelling = "--" + a.dest.replace("_", "-")
            if spelling in where:
                others = "this command" if spelling in own else ", ".join(
                    sorted({c for cs in where[spelling].values() for c in cs}))
                found.append(f"{command}: the positional {a.metavar or a.dest.upper()} is {spelling} in {others}: "
                             f"one thing spelled two ways; keep one")
    found += _threads_problems(vocab)
    found += _values_problems(vocab)
    return found


def _values_problems(vocab: dict[str, list[argparse.Action]]) -> list[str]:
    choices: dict[str, dict[str, tuple]] = {}  # spelling -> command -> its choices
    for command, actions in vocab.items():
        for a in actions:
            for spelling in a.option_strings:
                if a.choices:
                    choices.setdefault(spelling, {})[command] = tuple(map(str, a.choices))
    found = []
    for spelling, by_command in sorted(choices.items()):
        if spelling in VALUES_MAY_DIFFER:
            continue
        names = set(VALUES[spelling]) if spelling in VALUES else set(max(by_command.values(), key=len))
        for command, values in sorted(by_command.items()):
            other = sorted(set(values) - names)
            if other:
                found.append(f"{command}: {spelling} takes {', '.join(other)}, which other commands' {spelling} does "
                             f"not name ({', '.join(sorted(names))}): one name per value")
    return found


def _threads_problems(vocab: dict[str, list[argparse.Action]]) -> list[str]:
    shared = THREADS_OPTIONS[0].kwargs["help"]
    found = []
    for command, actions in vocab.items():
        threads = [a for a in actions if "--threads" in a.option_strings]
        if command in NO_COMPUTE:
            if threads:
                found.append(f"{command} takes --threads but NO_COMPUTE says it computes nothing: remove one")
        elif not threads:
            found.append(f"{command} computes but takes no --threads: add cli/options.py's THREADS_OPTIONS (and "
                         f"call set_threads), or list it in NO_COMPUTE with why")
        elif threads[0].help != shared:
            found.append(f"{command}: --threads is not the shared one: add cli/options.py's THREADS_OPTIONS")
    return found


def test_every_command_speaks_one_vocabulary():
    found = problems(vocabulary(build_parser()))
    assert not found, "the options' vocabulary is broken:\n" + "\n".join(found)


def test_the_tables_name_only_what_exists():
    """A row about a command or an option that is gone is a stale exception."""
    vocab = vocabulary(build_parser())
    spellings = {s for actions in vocab.values() for a in actions for s in a.option_strings}
    assert set(NO_COMPUTE) <= set(vocab), set(NO_COMPUTE) - set(vocab)
    for pair in [*DISTINCT, *map(lambda s: {s}, [*KINDS_MAY_DIFFER, *VALUES, *VALUES_MAY_DIFFER])]:
        assert set(pair) <= spellings, set(pair) - spellings
    assert set(SPELLINGS) <= spellings, set(SPELLINGS) - spellings


def _fake(**commands_) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    for name, adders in commands_.items():
        c = sub.add_parser(name)
        for args, kwargs in adders:
            c.add_argument(*args, **kwargs)
    return p


THREADS = (("--threads",), dict(help=THREADS_OPTIONS[0].kwargs["help"]))


@pytest.mark.parametrize("fake, says", [
    (dict(a=[(("--num-threads",), {}), THREADS]), r"a: --num-threads is spelled --threads in this house; rename it"),
    (dict(a=[(("--no-progress",), dict(action="store_true")), THREADS],
          b=[(("--no-progress-bar",), dict(action="store_true")), THREADS]),
     r"--no-progress is spelled --no-progress-bar"),
    (dict(a=[(("--seed",), {}), THREADS], b=[(("--seeds",), {}), THREADS]), r"--seed and --seeds look like one option"),
    (dict(a=[(("--resume",), dict(action="store_true")), THREADS], b=[(("--resume",), dict(nargs="?")), THREADS]),
     r"--resume is a flag in a; an optional value in b: make it one kind everywhere"),
    (dict(a=[(("--prompt",), {}), (("prompt",), {}), THREADS]),
     r"a: the positional PROMPT is --prompt in this command: one thing spelled two ways"),
    (dict(a=[(("out",), {}), THREADS], b=[(("--out",), {}), THREADS]),
     r"a: the positional OUT is --out in b: one thing"),
    (dict(a=[]), r"a computes but takes no --threads"),
    (dict(a=[(("--dtype",), dict(choices=["f32", "q8_0"])), THREADS]),
     r"a: --dtype takes f32, which other commands' --dtype does not name"),
    (dict(a=[(("--norm",), dict(choices=["rms", "layer"])), THREADS],
          b=[(("--norm",), dict(choices=["rmsnorm", "layernorm", "none"])), THREADS]),
     r"a: --norm takes layer, rms, which other commands' --norm does not name"),
    (dict(a=[(("--threads",), dict(help="mine"))]), r"a: --threads is not the shared one"),
])
def test_each_rule_fails_naming_what_to_rename(fake, says):
    found = problems(vocabulary(_fake(**fake)))
    assert any(re.search(says, line) for line in found), found
