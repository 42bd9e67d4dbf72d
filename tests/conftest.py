import os
import signal
import warnings
from pathlib import Path

import pytest
import torch

# `make test` runs one pytest worker per core (pytest-xdist): each worker then computes on one thread, so
# two workers never fight over the same two cores; a plain `pytest` keeps two threads.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))
warnings.filterwarnings("ignore", category=DeprecationWarning)
# a shell without job control starts background commands (`make test &`) with SIGINT ignored, and an ignored signal
# stays ignored across exec: the Ctrl-C tests' commands would never see theirs and wait forever. Caught here, it is
# reset to the default in every process the tests start, as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

SHARED = Path(__file__).resolve().parents[2] / "shared"
if not SHARED.is_dir():  # a clone next to shared/
    SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    return SHARED


@pytest.fixture(scope="session")
def statquest_checkpoint(tmp_path_factory):
    """The lesson's model trained once per test session (seed 42, 30 epochs), as a checkpoint directory."""
    from decoderlab.training import train_pairs

    out = tmp_path_factory.mktemp("statquest") / "ckpt"
    train_pairs(out=out)
    return out


@pytest.fixture(scope="session")
def llama_directory(tmp_path_factory):
    """A tiny random Hugging Face directory of a Llama 2 / TinyLlama-style model: SentencePiece BPE whose
    ``add_bos_token`` puts ``<s>`` before a text, and Llama 2 chat's template, which writes ``<s>`` itself
    (``tests/hf/families.py``): ``(its path, the transformers model, the AutoTokenizer)``."""
    pytest.importorskip("transformers")
    from hf.families import LLAMA2_CHAT, chat_directory

    path = tmp_path_factory.mktemp("llama") / "hf"
    model, auto = chat_directory(path, "llama", LLAMA2_CHAT)
    return path, model, auto


@pytest.fixture(scope="session")
def decoderlab_cli():
    """Run the real command line in a subprocess (``python -m decoderlab.cli ARGS``, as the console script
    does): returns the CompletedProcess (returncode, stdout, stderr as text; stdout is not a terminal)."""
    import subprocess
    import sys

    src = str(Path(__file__).resolve().parents[1] / "src")

    def run(*args, stdin: str | None = None, cwd=None, env: dict | None = None, timeout: float = 300):
        environ = {**os.environ, "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
        environ.pop("DECODERLAB_RUN_DIR", None)
        return subprocess.run([sys.executable, "-m", "decoderlab.cli", *map(str, args)], input=stdin,
                              capture_output=True, text=True, cwd=cwd, env=environ, timeout=timeout)

    return run


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory):
    """A tiny random character-level language model checkpoint ("to be or not to be ..." vocabulary)."""
    import decoderlab as dl
    from decoderlab.checkpoint import save_checkpoint

    tok = dl.CharTokenizer.from_text("to be or not to be, that is the question\n")
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=16,
                                                n_layer=1, n_head=2, max_len=24))
    out = tmp_path_factory.mktemp("lm") / "ckpt"
    save_checkpoint(out, model, tok, meta={"task": "lm"})
    return out


@pytest.fixture(scope="module")
def newline_bpe():
    """A byte-level BPE that learned "\\n\\n" as one token (and "ab"), with a model that writes "\\n" after
    "a" and after "\\n" -- one newline token at a time, never the "\\n\\n" token -- and "x" -> "ab" -> "c" -> "\\n"."""
    from decoderlab.tokenizers import BPETokenizer
    from tiny_models import bigram_model

    tok = BPETokenizer.train(["ab ab abab pab\n\n" * 50 + "abc c p a b x\n\n"], 270)
    (nn,), (nl,) = tok.encode("\n\n"), tok.encode("\n")
    (a,), (ab,), (c,), (p,), (x,) = (tok.encode(s) for s in ("a", "ab", "c", "p", "x"))
    assert tok.decode([nn]) == "\n\n" and nn != nl
    model = bigram_model(tok.vocab_size, {p: a, a: nl, nl: nl, x: ab, ab: c, c: nl})
    return tok, model, dict(nl=nl, nn=nn, a=a, ab=ab, c=c, p=p, x=x)


@pytest.fixture(scope="session")
def overfit(tmp_path_factory):
    """A chat checkpoint fine-tuned once per test session until it reproduces ``tiny_runs.CONVS``: ``(out,
    summary)`` (used by the tests of chat replies, fine-tuning and the chat commands)."""
    from tiny_runs import overfit_chat

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return overfit_chat(tmp_path_factory.mktemp("overfit") / "chat")
    finally:
        torch.set_num_threads(n)
