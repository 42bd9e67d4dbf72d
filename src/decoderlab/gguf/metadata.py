"""A GGUF file's ``<arch>.*`` metadata read as numbers: each key missing, or of the wrong kind, one line naming
the file and the key.

Source: the GGUF specification (ggml-org/ggml, docs/gguf.md: the standardized key-value pairs).
"""

from __future__ import annotations


def number(meta: dict, arch: str, key: str, default=None, *, path=""):
    """``meta["<arch>.<key>"]`` (``default`` when absent), a number.

    Raises:
        ValueError: absent without a default; a list, a string or a bool -- naming the key.
    """
    value = meta.get(f"{arch}.{key}", default)
    if value is None:
        raise ValueError(f"{path}: GGUF metadata {arch}.{key} is missing (a {arch} file states it)")
    if isinstance(value, (list, str, bool)):
        raise ValueError(f"{path}: GGUF metadata {arch}.{key} is {value!r}, not a number")
    return value


def positive(meta: dict, arch: str, key: str, path="", default=None) -> int:
    """``meta["<arch>.<key>"]`` as a positive integer (:func:`number`); ``ValueError`` naming the key otherwise."""
    value = number(meta, arch, key, default, path=path)
    if int(value) != value or value < 1:
        raise ValueError(f"{path}: GGUF metadata {arch}.{key} must be a positive integer, got {value!r}")
    return int(value)
