"""The run directory: its checkpoints and logs describe the last step, a resume falls back to the newest
intact checkpoint when the last one is damaged, global rank 0 checks and names it for several nodes, and the
summary reads like summary.json. (A resume's refusals: tests/cli/test_train.py and tests/test_finetuning.py.)"""

import json
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_runs import TINY, cache, ddp_env, one_thread, resume, run, text, tiny_config, two_nodes  # noqa: F401

from decoderlab.training import lr_at


@pytest.fixture(scope="module")
def run_25(tmp_path_factory, text, cache):
    out = tmp_path_factory.mktemp("r25") / "run"
    model, tok, s = run(text, out, cache, tiny_config(max_steps=25, eval_every=10))
    return out, model, s


def test_checkpoints_logs_and_model_describe_the_last_step(run_25):
    from safetensors.torch import load_file

    out, model, s = run_25
    assert [h[0] for h in s.val_history] == [10, 20, 25] and s.val_loss == s.val_history[-1][1]
    last = torch.load(out / "lightning" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 25 and json.loads((out / "meta.json").read_text())["step"] == 25
    exported = load_file(str(out / "model.safetensors"))
    for name, tensor in exported.items():
        torch.testing.assert_close(last["state_dict"][f"model.{name}"], tensor, rtol=0, atol=0)
    rows = (out / "logs" / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    cells = [dict(zip(header, r.split(","))) for r in rows[1:]]
    val_rows = [(int(c["step"]), float(c["val_loss"])) for c in cells if c["val_loss"]]
    assert [r[0] for r in val_rows] == [10, 20, 25]
    assert [r[1] for r in val_rows] == pytest.approx([h[1] for h in s.val_history])
    train_steps = [int(c["step"]) for c in cells if c["train_loss"]]
    assert train_steps == list(range(1, 26))  # step N: the N-th optimizer step's loss
    np.testing.assert_allclose([float(c["train_loss"]) for c in cells if c["train_loss"]], s.train_losses, atol=1e-6)
    lrs = [float(c[k]) for c in cells for k in header if k.startswith("lr-") and k.endswith("pg1") and c[k]]
    cfg = tiny_config(max_steps=25, eval_every=10)
    assert lrs == pytest.approx([lr_at(k, cfg) for k in range(25)])  # step N ran at lr_at(N - 1)
    bests = list((out / "lightning").glob("best-step*.ckpt"))
    assert len(bests) == 1
    best_step = int(bests[0].stem.removeprefix("best-step"))
    best = torch.load(bests[0], weights_only=False)
    assert best["global_step"] == best_step and best_step in dict(s.val_history)
    assert dict(s.val_history)[best_step] == min(v for _, v in s.val_history)


def test_damaged_last_checkpoint_falls_back_to_the_newest_intact_one(run_25, tmp_path, text, cache, capsys):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(run_25[0], out)
    best = next((out / "lightning").glob("best-step*.ckpt"))
    best_step = int(best.stem.removeprefix("best-step"))
    last = out / "lightning" / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # truncated, as by a full disk
    # a damaged file named explicitly: refused, naming it
    with pytest.raises(ValueError, match=rf"cannot resume from {re.escape(str(last))}: the file is damaged"):
        resume(last, cache, text=text)
    _, _, s = resume(out, cache, text=text, config_overrides={"max_steps": best_step + 2})
    err = capsys.readouterr().err
    assert f"{last} is damaged" in err and f"resuming from {best} (step {best_step})" in err
    assert s.steps == best_step + 2 and s.val_history[-1][0] == best_step + 2
    assert torch.load(last, weights_only=False)["global_step"] == best_step + 2  # rewritten, intact
    # every checkpoint damaged: an error naming them
    for f in (out / "lightning").glob("*.ckpt"):
        f.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"no intact training checkpoint; damaged: .*last\.ckpt .*best-step"):
        resume(out, cache, text=text)


# ---------------------------------------------------------------------------------------------------------
# several nodes: global rank 0 checks and names the run directory
# ---------------------------------------------------------------------------------------------------------

NODES_SCRIPT = """
import os, sys, time
from decoderlab.training import TrainConfig, train_lm
if os.environ["RANK"] == "1":  # this node's clock is an hour ahead: a timestamp of its own would differ
    _gmtime = time.gmtime
    time.gmtime = lambda secs=None: _gmtime((time.time() if secs is None else secs) + 3600)
text = open(sys.argv[1], encoding="utf-8").read()
cfg = TrainConfig(max_steps=2, batch_size=2, warmup=1, eval_every=2, val_batches=1, val_batch_size=4)
_, _, s = train_lm(text=text, out=None if sys.argv[3] == "-" else sys.argv[3], train_config=cfg,
                   model_overrides={tiny}, cache_dir=sys.argv[2], devices=1, num_nodes=2, strategy="ddp",
                   accelerator="cpu", progress_bar=False, logger=False)
print("run directory", s.run_dir, "global zero", s.is_global_zero, flush=True)
"""


@pytest.mark.slow
def test_two_nodes_share_rank_zeros_run_directory(tmp_path, text, cache):
    """Two torchrun "nodes" without --out, the second one's clock an hour ahead: one run directory, rank 0's
    timestamp, named the same by both processes (each took its own timestamp)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    script = tmp_path / "nodes.py"
    script.write_text(textwrap.dedent(NODES_SCRIPT).format(tiny=TINY))
    results = two_nodes(script, corpus, cache, "-", cwd=tmp_path, env=ddp_env(cache))
    assert [r[0] for r in results] == [0, 0], results[0][2][-2000:] + results[1][2][-2000:]
    said = [re.search(r"run directory (\S+) global zero (\w+)", r[1]).groups() for r in results]
    assert [g for _, g in said] == ["True", "False"]
    assert said[0][0] == said[1][0], said
    runs = list((tmp_path / "runs").iterdir())
    assert [p.name for p in runs] == [Path(said[0][0]).name] and (runs[0] / "summary.json").is_file()


@pytest.mark.slow
def test_two_nodes_refuse_an_out_directory_that_holds_files(tmp_path, text, cache):
    """A non-empty --out on two nodes (torchrun sets LOCAL_RANK in every process, which skipped the check):
    refused, nothing written, both nodes stop."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    script = tmp_path / "nodes.py"
    script.write_text(textwrap.dedent(NODES_SCRIPT).format(tiny=TINY))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.md").write_text("mine")
    results = two_nodes(script, corpus, cache, busy, cwd=tmp_path, env=ddp_env(cache), timeout=240)
    assert [r[0] != 0 for r in results] == [True, True]
    assert f"FileExistsError: refusing to replace {busy}: it already holds files (notes.md)" in results[0][2]
    assert [p.name for p in busy.iterdir()] == ["notes.md"] and (busy / "notes.md").read_text() == "mine"


# ---------------------------------------------------------------------------------------------------------
# the summary reads like summary.json
# ---------------------------------------------------------------------------------------------------------


def test_summaries_are_mappings_like_summary_json(tmp_path, text, cache):
    """`summary["steps"]` failed on train_lm's summary (a dataclass) while summary.json is a dict."""
    from decoderlab.finetuning import FinetuneSummary
    from decoderlab.training import TrainSummary

    _, _, s = run(text, tmp_path / "run", cache, tiny_config(max_steps=2, eval_every=2))
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert isinstance(s, TrainSummary) and s["steps"] == s.steps == on_disk["steps"] == 2
    assert list(s) == list(on_disk) and len(s) == len(on_disk)
    assert json.loads(json.dumps(s.to_dict())) == on_disk
    assert s["val_loss"] == pytest.approx(on_disk["val_loss"]) and s.get("nope") is None
    with pytest.raises(KeyError, match="'stpes'; the summary's keys: steps, train_loss"):
        s["stpes"]
    assert issubclass(FinetuneSummary, type(s).__mro__[1])  # the same mapping
