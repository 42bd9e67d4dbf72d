"""The run directory: its checkpoints and logs describe the last step, and a resume falls back to the newest
intact checkpoint when the last one is damaged."""

import json
import re
import shutil

import numpy as np
import pytest
import torch
from tiny_runs import cache, one_thread, resume, run, text, tiny_config  # noqa: F401

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
