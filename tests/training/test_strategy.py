"""Strategies: decoderlab's ``--strategy fsdp`` (FSDP2, one unit per decoder block) equals one process --
AdamW and Muon, then save, resume and continue -- with its parameter groups decided by name; a non-finite loss
on one rank stops every rank; what cannot run under a strategy is refused in one line before any process
starts. The multi-process runs are 2 CPU processes (gloo)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from support.caches import own_cache

from decoderlab import cli
from decoderlab.checkpoint import load_checkpoint
from decoderlab.training import TrainConfig, train_lm
from decoderlab.training.strategy import check_strategy

SHAPE = dict(d_model=16, n_layer=2, n_head=2, max_len=16)
STEPS, MORE = 4, 6


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def text(shared_dir):
    return (shared_dir / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:12000]


def config(optimizer, processes=1, **kw):
    return TrainConfig(max_steps=STEPS, batch_size=4 // processes, warmup=1, eval_every=2, val_batches=2,
                       val_batch_size=8, log_every=1, optimizer=optimizer, **kw)


def env(cache):
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "DECODERLAB_CACHE": str(own_cache(cache))}
    e.pop("DECODERLAB_RUN_DIR", None)
    return e


def run_script(script, args, tmp_path, cache, timeout=300):
    """Run ``script`` (Lightning launches the second process) in its own process group; a hang is killed."""
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    proc = subprocess.Popen([sys.executable, str(path), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env(cache), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        err += f"\n(killed after {timeout} s: a process hung)"
    return proc.returncode, out, err


FSDP_SCRIPT = """
import json, shutil, sys
import lightning as L
from torch.distributed.fsdp import FSDPModule
from decoderlab.training import NonFiniteLossError, TrainConfig, train_lm

text, root, cache = open(sys.argv[1], encoding="utf-8").read(), sys.argv[2], sys.argv[3]

class Layout(L.Callback):
    # what FSDP made of the model and its optimizer, written by rank 0 at the start of training
    def __init__(self, path):
        self.path = path

    def on_train_start(self, trainer, pl_module):
        if trainer.is_global_zero:
            m, opt = pl_module.model, trainer.optimizers[0]
            groups = [[(type(p).__name__, list(p.shape), list(p.to_local().shape)) for p in g["params"]]
                      for g in opt.param_groups]
            json.dump({"units": [isinstance(b, FSDPModule) for b in m.blocks] + [isinstance(m, FSDPModule)],
                       "groups": groups, "world": trainer.world_size}, open(self.path, "w"))

# both optimizers, each trained for STEPS steps, then resumed to MORE, in the same two processes
for optimizer in ("adamw", "muon"):
    out = f"{root}/{optimizer}"
    cfg = TrainConfig(max_steps=STEPS, batch_size=2, warmup=1, eval_every=2, val_batches=2, val_batch_size=8,
                      log_every=1, optimizer=optimizer)
    common = dict(text=text, cache_dir=cache, devices=2, strategy="fsdp", accelerator="cpu", progress_bar=False,
                  logger=False)
    _, _, s = train_lm(out=out, train_config=cfg, model_overrides=SHAPE, callbacks=[Layout(out + ".layout.json")],
                       **common)
    if s.is_global_zero:
        shutil.copytree(out, out + "-at-4")  # for the test: what the 4 steps wrote
    train_lm(resume=out, config_overrides={"max_steps": MORE}, **common)


class PoisonOneRank(L.Callback):
    # rank 1 alone gets a NaN position table (a buffer: each process has its own) before step 3
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step + 1 == 3:
            pl_module.model.pe.pe.fill_(float("nan"))

cfg = TrainConfig(max_steps=6, batch_size=2, warmup=1, eval_every=2, val_batches=1, val_batch_size=8, log_every=1)
try:
    train_lm(out=f"{root}/nan", train_config=cfg, model_overrides={**SHAPE, "position": "sinusoidal"},
             callbacks=[PoisonOneRank()], **common)
except NonFiniteLossError as e:
    rank = int(__import__("os").environ.get("LOCAL_RANK", 0))
    open(f"{root}/nan.rank{rank}", "w").write(str(e))
"""


@pytest.fixture(scope="module")
def fsdp_runs(text, tmp_path_factory):
    """The 2-process FSDP runs of both optimizers (one launch): ``root/{optimizer}-at-4`` after 4 steps,
    ``root/{optimizer}`` resumed to 6, ``root/{optimizer}.layout.json``; then a run whose loss is NaN on rank 1
    only (``root/nan``, the error each rank raised in ``root/nan.rank{r}``)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    corpus = tmp / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    script = f"STEPS, MORE, SHAPE = {STEPS}, {MORE}, {SHAPE}\n" + textwrap.dedent(FSDP_SCRIPT)
    rc, _, err = run_script(script, [corpus, tmp, tmp / "cache"], tmp, tmp / "cache", timeout=480)
    assert "killed after" not in err, err[-3000:]
    assert rc == 0, err[-3000:]
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_fsdp_two_processes_equal_one_then_resume_and_continue_equal(optimizer, fsdp_runs, text, tmp_path):
    cache = fsdp_runs / "cache"
    first = json.loads((fsdp_runs / f"{optimizer}-at-4" / "summary.json").read_text())
    resumed = json.loads((fsdp_runs / optimizer / "summary.json").read_text())
    layout = json.loads((fsdp_runs / f"{optimizer}.layout.json").read_text())
    single_model, _, single = train_lm(text=text, out=tmp_path / "one", train_config=config(optimizer),
                                       model_overrides=SHAPE, cache_dir=cache, progress_bar=False,
                                       accelerator="cpu", logger=False)
    # 4 steps: the same losses, validation and weights
    assert len(first["train_losses"]) == STEPS
    # torch.optim.Muon orthogonalises in bfloat16 (Newton-Schulz on grad.bfloat16()): the two processes'
    # reduced gradients differ from one process's in the last float32 bits, which flips bfloat16 roundings there.
    # Measured on an AVX512-BF16 CPU: Muon's matrices within 3.7e-3 after 4 steps, the losses within 2.7e-5
    # over 6 (AdamW: 7e-7 and 5e-7); an update computed on one process's rows alone was 1e-2 off.
    loss_tol = 1e-4 if optimizer == "muon" else 1e-5
    np.testing.assert_allclose(first["train_losses"], single.train_losses, rtol=0, atol=loss_tol)
    assert first["val_loss"] == pytest.approx(single.val_loss, abs=loss_tol)
    assert first["device"] == single.device == "cpu"
    fsdp_model, _ = load_checkpoint(fsdp_runs / f"{optimizer}-at-4")  # the whole weights, written by rank 0
    for (name, a), b in zip(fsdp_model.state_dict().items(), single_model.state_dict().values()):
        muon_matrix = optimizer == "muon" and a.ndim == 2 and name.startswith("blocks.")
        torch.testing.assert_close(a, b, atol=1e-2 if muon_matrix else 1e-5, rtol=0, msg=name)
    # the FSDP layout: one unit per block and the root; every parameter a row-sharded DTensor of its full
    # shape; Muon's group holds the blocks' 2-D matrices, whole; no group left empty
    assert layout["world"] == 2 and layout["units"] == [True] * (SHAPE["n_layer"] + 1)
    for group in layout["groups"]:
        assert group
        for kind, shape, local in group:
            assert kind == "DTensor" and local[0] == -(-shape[0] // 2) and local[1:] == shape[1:]
    if optimizer == "muon":
        assert len(layout["groups"][0]) == 4 * SHAPE["n_layer"] and all(len(s) == 2 for _, s, _ in layout["groups"][0])

    # resumed from its checkpoint to 6 steps: the uninterrupted run's losses, under FSDP and under one process
    _, _, single_more = train_lm(text=text, resume=tmp_path / "one", config_overrides={"max_steps": MORE},
                                 cache_dir=cache, progress_bar=False, accelerator="cpu", logger=False)
    crossed_dir = tmp_path / "crossed"
    shutil.copytree(fsdp_runs / f"{optimizer}-at-4", crossed_dir)
    _, _, crossed = train_lm(text=text, resume=crossed_dir, config_overrides={"max_steps": MORE, "batch_size": 4},
                             cache_dir=cache, progress_bar=False, accelerator="cpu", logger=False)
    assert len(resumed["train_losses"]) == MORE
    np.testing.assert_allclose(resumed["train_losses"], single_more.train_losses, rtol=0, atol=loss_tol)
    np.testing.assert_allclose(crossed.train_losses, single_more.train_losses, rtol=0, atol=loss_tol)
    assert resumed["val_loss"] == pytest.approx(single_more.val_loss, abs=loss_tol)
    gap = np.abs(np.subtract(resumed["train_losses"], single_more.train_losses)).max()
    print(f"FSDP {optimizer}: 2 processes vs 1, max |train loss difference| over {MORE} steps {gap:.2e}")


@pytest.mark.slow
def test_a_nonfinite_loss_on_one_rank_stops_every_rank(fsdp_runs):
    """The guard combines its flag over the processes before raising: both ranks stop at step 3, before
    its update, instead of one raising while the other waits in a collective (the launch finished: no hang)."""
    message = "the training loss became nan at step 3: training stopped before this update"
    for rank in (0, 1):
        assert (fsdp_runs / f"nan.rank{rank}").read_text().startswith(message)
    assert json.loads((fsdp_runs / "nan" / "meta.json").read_text())["step"] == 2  # the last good checkpoint


@pytest.mark.parametrize("strategy, kw, message", [
    ("fsdp", dict(compile="eager"), "--compile cannot be combined with --strategy fsdp yet"),
    ("fsdp", dict(accelerator="mps"), "--strategy fsdp needs CUDA GPUs or the CPU (Apple MPS has no distributed backend)"),
    ("fsdp_cpu_offload", dict(optimizer="muon"),
     "--strategy fsdp_cpu_offload shards each weight into flat 1-D pieces, and Muon orthogonalises whole matrices: "
     "use --strategy fsdp"),
    ("deepspeed_stage_3", dict(optimizer="muon"), "use --strategy fsdp (FSDP2, whole matrices) or --optimizer adamw"),
])
def test_what_cannot_run_under_a_strategy_is_refused(strategy, kw, message):
    with pytest.raises(ValueError, match=__import__("re").escape(message)):
        check_strategy(strategy, **kw)
    check_strategy(strategy, **{k: v for k, v in kw.items() if k == "accelerator" and v != "mps"})  # alone: fine


@pytest.mark.parametrize("argv, line", [
    (["--strategy", "fsdp", "--compile"], "decoderlab: error: --compile cannot be combined with --strategy fsdp yet: "
                                          "train without --compile, or with --strategy ddp"),
    (["--strategy", "fsdp_cpu_offload", "--devices", "2"],  # the default recipe trains with Muon
     "decoderlab: error: --strategy fsdp_cpu_offload shards each weight into flat 1-D pieces, and Muon orthogonalises "
     "whole matrices: use --strategy fsdp (FSDP2, whole matrices) or --optimizer adamw"),
])
def test_cli_strategy_refusals_are_one_line_before_any_process(argv, line, tmp_path, text, capsys, monkeypatch):
    monkeypatch.setenv("DECODERLAB_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    assert cli.main(["train", "--data", str(corpus), "--out", str(tmp_path / "run"), "--max-steps", "2",
                     "--no-progress-bar", *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    assert not (tmp_path / "run").exists()  # nothing written, no process launched


def test_the_end_of_a_run_evaluates_on_the_training_device_and_returns_to_the_cpu():
    """Lightning leaves a trained module on the CPU; the final evaluation moves it back to the device it
    trained on (recorded here: the moves of a model that trained on "cuda:0") and, after, to the CPU."""
    from types import SimpleNamespace

    from decoderlab.model import DecoderOnlyTransformer
    from decoderlab.training.strategy import on_training_device

    model = DecoderOnlyTransformer(num_tokens=5, d_model=2, max_len=6)
    moves = []
    model.to = lambda *args, **kw: moves.append(args) or model
    model.cpu = lambda: moves.append("cpu") or model
    cuda = torch.device("cuda", 0)
    rank0 = SimpleNamespace(strategy=SimpleNamespace(root_device=cuda, world_size=1), is_global_zero=True)
    with on_training_device(rank0, model) as (final, device):
        assert final is model and device == cuda and moves == [(cuda,)]
    assert moves == [(cuda,), "cpu"]
    moves.clear()
    rank1 = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 1), world_size=2),
                            is_global_zero=False)
    with on_training_device(rank1, model) as (final, device):
        assert final is None and device == torch.device("cuda", 1)
    assert moves == []  # (the other processes evaluate nothing)
