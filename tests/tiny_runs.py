"""Tiny training runs shared by the tests of training, fine-tuning, chat, checkpoints and their commands: a
language model on 12,000 characters of tinyshakespeare (``TINY``, ``tiny_config``, ``run``) and a chat model on
eight conversations (``TINY_CHAT``, ``CONVS``, ``chat_pair``, ``tiny_cfg``, ``run_ft``). Import the fixtures
(``text``, ``cache``, ``one_thread``) into a test module to use them there."""

import json
import os
import subprocess

import lightning as L
import pytest
import torch

from decoderlab.chat import TEMPLATES, add_chat_tokens
from decoderlab.finetuning import finetune
from decoderlab.model import DecoderOnlyTransformer, preset
from decoderlab.tokenizers import CharTokenizer
from decoderlab.training import TrainConfig, train_lm

# ---- language models ---------------------------------------------------------------------------------------

TINY = dict(d_model=16, n_layer=1, n_head=2, max_len=16)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def text(shared_dir):
    return (shared_dir / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:12000]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("token-cache")


def tiny_config(**kw):
    base = dict(max_steps=8, batch_size=4, warmup=2, eval_every=4, val_batches=2, val_batch_size=8, log_every=1)
    return TrainConfig(**{**base, **kw})


def run(text, out, cache, cfg=None, **kw):
    kw = {"progress_bar": False, **kw}
    return train_lm(text=text, out=out, train_config=cfg or tiny_config(), model_overrides=TINY,
                    cache_dir=cache, accelerator="cpu", **kw)


def resume(out, cache, **kw):
    return train_lm(resume=out, model_overrides=TINY, cache_dir=cache, progress_bar=False, accelerator="cpu", **kw)


class StopAt(L.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


# ---- several processes --------------------------------------------------------------------------------

def run_group(cmd, timeout=300, **kw):
    """Run ``cmd`` in its own process group; on a timeout kill the whole group (launched ranks included), so a
    hanging multi-process run never outlives the test."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        err += f"\n(killed after {timeout} s)"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def ddp_env(cache):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "DECODERLAB_CACHE": str(cache)}
    env.pop("DECODERLAB_RUN_DIR", None)
    return env


# ---- chat models -------------------------------------------------------------------------------------------

TINY_CHAT = dict(d_model=16, n_layer=1, n_head=2, max_len=48)
ALPHABET = "abcdefghijklmnopqrstuvwxyz ?!.,0123456789<>|"
DL = TEMPLATES["decoderlab"]


def conv(*turns, system=None):
    msgs = [{"role": "system", "content": system}] if system else []
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return msgs


CONVS = [conv("hi", "hello there"), conv("what is two plus two?", "4"), conv("name a colour", "red"),
         conv("say yes", "yes", "say no", "no"), conv("count", "1 2 3 4 5 6"), conv("abc", "def"),
         conv("who are you?", "a tiny model", system="be brief"), conv("bye", "see you")]


def chat_pair(seed=0, **over):
    torch.manual_seed(seed)
    tok = CharTokenizer.from_text(ALPHABET)
    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=tok.vocab_size, **{**TINY_CHAT, **over}))
    return add_chat_tokens(model, tok, "decoderlab")[:2]


def tiny_cfg(**kw):
    base = dict(max_steps=1, batch_size=8, lr=1e-3, warmup=1, eval_every=1, grad_clip=0.0, log_every=1)
    return TrainConfig(**{**base, **kw})


def run_ft(tmp_path, name, model, tok, cfg, callbacks=(), **kw):
    kw = {"val_fraction": 0, "eval_prompts": 2, **kw}
    return finetune(CONVS, out=tmp_path / name, base_model=(model, tok), train_config=cfg, eval_max_new_tokens=4,
                    progress_bar=False, logger=False, accelerator="cpu", callbacks=list(callbacks), **kw)


def write(tmp_path, *lines):
    p = tmp_path / "data.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


GOOD = json.dumps({"messages": conv("hi", "ho")})


def overfit_chat(out):
    """A chat checkpoint fine-tuned until it reproduces the eight ``CONVS`` (150 steps): ``(out, summary)``."""
    model, tok = chat_pair(seed=1, d_model=64, n_layer=2, n_head=4)
    cfg = TrainConfig(max_steps=150, batch_size=8, lr=1e-2, min_lr=1e-3, warmup=5, eval_every=150, grad_clip=1.0,
                      weight_decay=0.0)
    _, _, s = finetune(CONVS, out=out, base_model=(model, tok), train_config=cfg, val_fraction=0, eval_prompts=8,
                       eval_max_new_tokens=16, progress_bar=False, logger=False, accelerator="cpu")
    return out, s


def two_nodes(script, *args, cwd, env, timeout=300):
    """Run ``script ARGS`` as two torchrun "nodes" on localhost (one process each, gloo): ``[(returncode,
    stdout, stderr)]`` of node 0 and node 1; on a timeout both process groups are killed."""
    import socket
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                               "1", "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port",
                               str(port), str(script), *map(str, args)],
                              env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
             for node in (0, 1)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]
