"""The parser: argparse with decoderlab's one-line errors, and the table of commands.

Building it imports no torch: each command module adds its options from ``decoderlab.config``'s plain data and
imports the library only when the command runs (``tests/cli/test_parser.py`` checks ``sys.modules``). A
command's module is imported only when its options are needed: ``decoderlab --help`` reads this table alone,
``decoderlab train ...`` the train module (``bench/startup.py``).
"""

from __future__ import annotations

import argparse
import importlib
import re

from .._version import __version__
from ..config.recipes import DEFAULT_RECIPE

#: the commands in the order ``decoderlab --help`` lists them: name -> (the module and function that add its
#: options to its subparser, its one-line help)
COMMANDS = {
    "train": ("train", "add_train",
              f"train a model (default: the {DEFAULT_RECIPE} recipe on the embedded tinyshakespeare)"),
    "sample": ("generate", "add_sample",
               "alias of `generate --no-stream --echo`: print a prompt and its continuation"),
    "generate": ("generate", "add_generate", "continue a prompt with a trained model (streamed as it is produced)"),
    "chat": ("chat", "add_chat", "talk with a model; each turn continues the conversation (/help, /quit)"),
    "finetune": ("finetune", "add_finetune", "fine-tune a model on conversations (JSONL) with a chat template"),
    "rl": ("rl", "add_rl", "reinforcement learning of a chat checkpoint from a checkable reward"),
    "verify": ("glassbox", "add_verify",
               "recompute a checkpoint's forward pass in float64 NumPy and compare every step"),
    "explain": ("glassbox", "add_explain",
                "print every attention number step by step (a worked example or a checkpoint)"),
    "lens": ("interpret", "add_lens",
             "the logit lens at a position, and that next token's logit split into its parts (heads, MLPs, ...)"),
    "heads": ("interpret", "add_heads",
              "every head's previous-token, duplicate-token and induction scores; ablate a head (--ablate)"),
    "patch": ("interpret", "add_patch",
              "activation patching: which layers, positions or heads carry the clean run's answer"),
    "export": ("export", "add_export",
               "write a checkpoint as a Hugging Face directory or a GGUF file (llama.cpp, ollama)"),
    "sae": ("dictionary", "add_sae",
            "train a sparse autoencoder on a layer's activations (TopK or ReLU + L1), in SAELens's format"),
    "features": ("dictionary", "add_features",
                 "a sparse autoencoder feature's dashboard: top contexts, histogram, logit effects, density"),
    "tasks": ("tasks", "add_tasks",
              "write checkable questions (arithmetic, spelling, comparison, tool) as chat JSONL or rl prompts"),
    "report": ("report", "add_report", "the report card of a recipe run: every stage scored on held-out tasks"),
    "serve": ("serve", "add_serve",
              "serve a checkpoint over an OpenAI-compatible HTTP API, with a glass-box page at /"),
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse with decoderlab's one-line errors: ``decoderlab: error: --max-steps must be an integer, got
    'x' (see decoderlab train --help)`` and exit status 2. Options are never abbreviated (``allow_abbrev``
    off, for every command's parser: subparsers are made of this class): one spelling per option, so
    ``--max-new-token 5`` is an unknown option rather than ``--max-new-tokens``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._words: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        import sys

        self._words = list(sys.argv[1:] if args is None else args)  # for error(): the words this parser read
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        if message.startswith("the following arguments are required"):
            unknown = unknown_options(self, self._words)  # `--chekpoint X` is the mistake, not a missing --checkpoint
            if unknown:
                message = unrecognized(self, unknown)
        typo = re.match(r"argument COMMAND: invalid choice: '([^']*)'", message)
        if typo:  # `decoderlab verfy`: the near command, as for an option
            import difflib

            near = difflib.get_close_matches(typo.group(1), list(COMMANDS), n=1, cutoff=0.75)
            message += f"; did you mean {near[0]}?" if near else ""
        m = re.match(r"argument ([^:]+): (.*)", message, re.S)
        if m:
            flag = m.group(1).split("/")[-1]
            message = f"{flag} {m.group(2)}" if m.group(2).startswith("must ") else f"{flag}: {m.group(2)}"
        self.exit(2, f"decoderlab: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but an unknown flag is named alone: ``generate --devices 2 The`` said "unrecognized
        arguments: --devices The" (the words after an unknown flag are left over too); now "unrecognized
        option: --devices (see decoderlab generate --help)". Left-over words without a flag are listed."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self
            for action in self._actions:  # the subcommand's parser names its own --help
                if isinstance(action, argparse._SubParsersAction):
                    parser = action.choices.get(getattr(ns, action.dest, None), self)
            flags = unknown_options(parser, extras)
            if flags:
                parser.error(unrecognized(parser, flags))
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns


def unknown_options(parser: argparse.ArgumentParser, words: list[str]) -> list[str]:
    """The words that look like options (``--x``, ``--x=1``, ``-x``; not ``-``, ``-3`` or ``-0.5``, nor a word
    with a space -- a value such as ``--system "-be brief"`` -- nor one after ``--``) and that ``parser`` does
    not know, as typed (without ``=value``)."""
    words = words[:words.index("--")] if "--" in words else words
    flags = [w.split("=", 1)[0] for w in words
             if w.startswith("-") and w != "-" and not re.fullmatch(r"-\d+(\.\d*)?|-\.\d+", w)
             and not re.search(r"\s", w.split("=", 1)[0])]
    return [f for f in flags if f not in parser._option_string_actions]


def unrecognized(parser: argparse.ArgumentParser, flags: list[str]) -> str:
    """"unrecognized option: --chekpoint; did you mean --checkpoint?" (the near spelling of the first, if any)."""
    import difflib

    known = [s for s in parser._option_string_actions if s.startswith("--")]
    near = difflib.get_close_matches(flags[0], known, n=1, cutoff=0.75)
    hint = f"; did you mean {near[0]}?" if near else ""
    return f"unrecognized option{'s' if len(flags) > 1 else ''}: {', '.join(flags)}{hint}"


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole parser; with ``argv``, only the command ``argv`` names gets its options (the others are listed
    by name and one-line help), so that a start imports only what its command needs."""
    parser = ArgumentParser(
        prog="decoderlab",
        description="Build, verify, train, inspect and chat with decoder-only (GPT-style) transformers.",
    )
    parser.add_argument("--version", action="version", version=f"decoderlab {__version__}")
    parser.add_argument("--verbose", action="store_true",
                        help="also show other libraries' import-time notices (torchao, torch's pytree), quiet by "
                             "default; anywhere on the line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # the top level has no option that takes a value: the first word that is not an option names the command
    wanted = None if argv is None else next((a for a in argv if not a.startswith("-")), "")
    for name, (module, function, text) in COMMANDS.items():
        p = sub.add_parser(name, help=text)
        if wanted is None or name == wanted:
            getattr(importlib.import_module(f".{module}", __package__), function)(p)
    return parser
