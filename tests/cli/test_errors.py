"""How a command ends (decoderlab.cli.errors): the one error line's text, and library messages in the words of
the flags."""

from __future__ import annotations

import errno

from decoderlab.cli.errors import FIELD_FLAGS, error_message, in_flag_words


def test_an_operating_system_error_is_its_path_and_reason():
    """No "[Errno 2]" and no repr quotes: the path the user gave and the system's reason."""
    e = FileNotFoundError(errno.ENOENT, "No such file or directory", "/proc/x.png")
    assert error_message(e) == "/proc/x.png: No such file or directory"
    e = OSError(errno.EXDEV, "Invalid cross-device link", "a", None, "b")
    assert error_message(e) == "a -> b: Invalid cross-device link"
    assert error_message(PermissionError(errno.EACCES, "Permission denied")) == "Permission denied"
    assert error_message(FileNotFoundError("no checkpoint in x: it has no config.json")) == \
        "no checkpoint in x: it has no config.json"
    assert error_message(KeyError("unknown token 'zz'")) == "unknown token 'zz'"
    assert error_message(ValueError("lr must be > 0")) == "lr must be > 0"


def test_library_messages_name_the_flags():
    assert in_flag_words("max_steps must be an integer >= 1, got 0") == "--max-steps must be an integer >= 1, got 0"
    assert in_flag_words("max_epochs must be >= 1") == "--epochs must be >= 1"
    assert in_flag_words("d_model (6) must be divisible by n_head (4)") == "--d-model (6) must be divisible by --n-head (4)"
    # names inside paths and file names are left alone
    assert in_flag_words("no file runs/max_steps/lr.json") == "no file runs/max_steps/lr.json"
    assert in_flag_words("see seed.txt") == "see seed.txt"
    assert {"max_steps", "lr", "seed", "precision", "compile", "threads", "vocab_size"} <= set(FIELD_FLAGS)
