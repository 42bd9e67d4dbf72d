"""argparse types with errors in decoderlab's words: ``--max-steps must be an integer, got 'x'``."""

from __future__ import annotations

import argparse
import math
import re


def number(kind, minimum=None, what: str = "", *, maximum=None, above: bool = False):
    """An argparse type: an int or float, >= ``minimum`` (> with ``above``) and <= ``maximum`` where given, with
    an error in our words naming the flag, checked as the line is parsed (before any model loads):
    ``--top-p must be in (0, 1], got 1.5``. A bounded float must be finite (``nan`` passes no comparison)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}{what}, "
                                             f"got {text!r}") from None
        low_ok = minimum is None or (value > minimum if above else value >= minimum)
        if not (low_ok and (maximum is None or value <= maximum)) or (
                kind is float and (minimum is not None or maximum is not None) and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be {bounds(kind, minimum, maximum, above)}{what}, got {text}")
        return value
    parse.integer = kind is int
    return parse


def bounds(kind, minimum, maximum, above: bool) -> str:
    """">= 0", "> 0", "in (0, 1]", "in [-2, 2]" (the words of :func:`number`'s errors; ``kind`` is said by the
    error of a word that is no number)."""
    if maximum is None:
        return f"{'>' if above else '>='} {minimum:g}"
    if minimum is None:
        return f"<= {maximum:g}"
    return f"in {'(' if above else '['}{minimum:g}, {maximum:g}]"


def seed(exponent: int):
    """An argparse type for ``--seed``: an integer in 0 .. 2**exponent-1 (63: a sampling ``torch.Generator``;
    32: training, whose ``seed_everything`` seeds NumPy), refused in those words rather than as torch's
    "Overflow when unpacking long long"."""
    def parse(text: str):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not 0 <= value < 2**exponent:
            raise argparse.ArgumentTypeError(f"must be an integer in 0 .. 2**{exponent}-1, got {text!r}")
        return value
    parse.integer = True
    return parse


DEVICES_HELP = "a number of devices >= 1, -1 (all), 'auto', or device indices such as 0,1"


def devices(text: str):
    """``--devices``: an int >= 1, -1, "auto", or a comma-separated list of device indices ("0,1", "1,")."""
    value = text.strip()
    if value == "auto" or ("," in value and re.fullmatch(r"\d+(,\d+)*,?", value)):
        return value
    if re.fullmatch(r"-1|[1-9]\d*", value):
        return int(value)
    raise argparse.ArgumentTypeError(f"must be {DEVICES_HELP}; got {text!r}")


def head_ref(text: str) -> tuple[int, int]:
    """An attention head written as the glass box labels it, ``L{layer}H{head}`` (``L1H0``): (layer, head)."""
    m = re.fullmatch(r"[Ll](\d+)[Hh](\d+)", text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"must be a head written L<layer>H<head>, such as L0H1; got {text!r}")
    return int(m.group(1)), int(m.group(2))


def json_file(text: str):
    """An argparse type: a file holding one JSON value (a JSON schema), read and parsed, errors naming it."""
    import json

    try:
        with open(text, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"{text} is not valid JSON: {e}") from None
