"""JSON Lines files read row by row with their line numbers, so every error can name the line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator


def jsonl_rows(path: str | os.PathLike, what: str) -> Iterator[tuple[int, object]]:
    """``(line number, parsed JSON)`` of each non-blank line of ``path`` (1-based line numbers).

    ``what`` names the file in messages ("prompts file", "preference file").

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a regular file (a folder, ``/dev/null``); not UTF-8; ``"<path>, line N: malformed JSON:
            ..."``; a file with no rows.
    """
    path = Path(path)
    if path.exists() and not path.is_file():
        raise ValueError(f"{what} {path} is not a regular file (give a JSONL file)")
    if not path.is_file():
        raise FileNotFoundError(f"no {what} {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte offset {e.start})") from None
    seen = False
    for n, line in enumerate(text.splitlines(), start=1):
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
