"""The parsed help of one command, for the tests of its defaults."""

from __future__ import annotations

import argparse

from decoderlab import cli


def command_parser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def helps(name: str) -> dict[str, str]:
    """``{last option string: help}`` of the command ``name``."""
    return {a.option_strings[-1]: a.help for a in command_parser(name)._actions if a.option_strings}


def actions(name: str) -> dict[str, argparse.Action]:
    """``{dest: action}`` of the command ``name``."""
    return {a.dest: a for a in command_parser(name)._actions}
