"""``decoderlab generate`` and ``sample`` (decoderlab.cli.generate): no Lightning to answer, the help shows the
config's defaults, a closed output ends them quietly."""

from __future__ import annotations

from decoderlab.config import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE, DTYPES

from .helps import helps
from .test_parser import _loaded


def test_generate_on_a_checkpoint_does_not_import_lightning(statquest_checkpoint):
    body = "from decoderlab.cli import main\nmain()"
    assert _loaded(body, ["generate", "--checkpoint", str(statquest_checkpoint), "what is statquest"]) == {"torch"}


def test_generate_help_shows_the_config_defaults():
    for command in ("generate", "sample"):
        h = helps(command)
        assert h["--max-new-tokens"].startswith(f"longest continuation in tokens (default {DEFAULT_MAX_NEW_TOKENS};")
        assert h["--temperature"] == f"sampling temperature, 0 = greedy (default {DEFAULT_TEMPERATURE:g})"
        assert h["--dtype"].startswith(f"weights for inference: {', '.join(DTYPES)} (default float32")
    assert helps("generate").keys() == helps("sample").keys()


def test_a_closed_output_ends_generate_and_sample_quietly(closed_stdout_cli, statquest_checkpoint):
    """`decoderlab generate ... | head -c 10` said "decoderlab: error: [Errno 32] Broken pipe" (exit 2); now no
    word, exit 141 as a program stopped by SIGPIPE."""
    for argv in (("generate", "--echo", "--max-new-tokens", "100000"), ("sample", "--max-new-tokens", "20")):
        assert closed_stdout_cli(*argv, "--checkpoint", statquest_checkpoint, "what") == (141, ""), argv
