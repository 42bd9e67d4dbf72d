"""Text files read the one way: UTF-8 with a leading byte-order mark dropped (:func:`read_utf8`), and JSON Lines
row by row with their line numbers (:func:`jsonl_rows`), so every error can name the line.

The one reader of chat conversations (:mod:`decoderlab.chat.data`), DPO's preference pairs
(:mod:`decoderlab.finetuning.dpo`) and RL's prompts (:mod:`decoderlab.reinforcement.prompts`): a byte-order mark,
CRLF line ends and blank lines are accepted alike in all three, and a bad line is named by the same number an
editor shows. Lines end at ``\\n`` only (JSON Lines' separator; a ``\\r`` before it is dropped): a JSON string
may hold U+2028 or U+0085 raw, which :meth:`str.splitlines` would split. Ground layer: imports
nothing from decoderlab.

Source: the JSON Lines format (https://jsonlines.org/).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator


def read_utf8(path: str | os.PathLike) -> str:
    """The text of a UTF-8 file, a leading byte-order mark dropped (the one reader of the corpus files and of
    every JSON Lines file).

    Raises:
        ValueError: not UTF-8 (naming the byte and its offset, with a hint: UTF-16, a binary file, or how to
            convert), or a NUL byte (a binary file).
    """
    path = Path(path)
    data = path.read_bytes()
    nul = data.find(b"\0")  # text has no NUL bytes; images, archives, model weights (and UTF-16 text) do
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = f"{path} is not UTF-8 text: byte 0x{data[e.start]:02x} at byte offset {e.start} is invalid ({e.reason})"
        if data.startswith((b"\xff\xfe", b"\xfe\xff")):
            hint = ("it is UTF-16 text (it starts with a UTF-16 byte-order mark): convert it to UTF-8 (e.g. iconv -f "
                    "utf-16 -t utf-8)")
        elif nul >= 0:
            hint = f"it is a binary file, not text (it holds a NUL byte at byte offset {nul}): give a UTF-8 text file"
        else:
            hint = "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        raise ValueError(f"{bad}; {hint}") from None
    if nul >= 0:
        raise ValueError(f"{path} is a binary file, not text: it holds a NUL byte at byte offset {nul}; give a UTF-8 "
                         "text file")
    return text.removeprefix("\ufeff")  # a byte-order mark is not text


def jsonl_rows(path: str | os.PathLike, what: str) -> Iterator[tuple[int, object]]:
    """``(line number, parsed JSON)`` of each non-blank line of ``path`` (1-based, counting ``\\n`` line ends).

    ``what`` names the file in messages ("conversation file", "prompts file", "preference file"). The text is
    read with :func:`read_utf8` (a leading byte-order mark dropped); a ``\\r`` ending a line is dropped; a line
    of whitespace only is skipped.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a regular file (a folder, ``/dev/null``); not UTF-8 text; ``"<path>, line N: malformed
            JSON: ..."``; a file with no rows.
    """
    path = Path(path)
    if path.exists() and not path.is_file():  # a folder, /dev/null, a pipe
        raise ValueError(f"{what} {path} is not a regular file (give a JSONL file)")
    if not path.is_file():
        raise FileNotFoundError(f"no {what} {path}")
    seen = False
    for n, line in enumerate(read_utf8(path).split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {n}: malformed JSON: {e.msg} (column {e.colno})") from None
        seen = True
        yield n, obj
    if not seen:
        raise ValueError(f"{what} {path} holds no rows (it is empty)")
