"""Head scores watched while a model trains: the records a training callback
(``decoderlab.headwatch.HeadWatch``) appends to the run directory, read back, and when each head became, say,
an induction head.

``head_scores.jsonl`` in the run directory holds one JSON object per line::

    {"step": 200, "loss": 2.91, "scores": {"previous_token": [[...], ...], "duplicate_token": ..., "induction": ...}}

``loss`` is the mean training loss (nats per token) since the previous record (null at step 0); each score
table is n_layer rows of n_head scores (:func:`~decoderlab.glassbox.detectors.all_head_scores`, "mul", on
the probe: random tokens repeated twice, the same probe at every record). This module imports no
Lightning: ``decoderlab explain --run DIR`` and the page read it; :func:`~decoderlab.glassbox.plotting.
save_head_scores_png` draws it.

Source: Olsson et al. 2022, "In-context Learning and Induction Heads" (the phase change seen in the loss
and in the heads' scores at once).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from .detectors import KINDS, all_head_scores, repeated_tokens

#: the records' file in a run directory
WATCH_FILE = "head_scores.jsonl"
#: "mul" score at which a head counts as formed: a perfect induction head on a probe repeated twice scores 1/2,
#: an untrained one about 1/T per matching key
FORMED_AT = 0.3


def probe_tokens(model, *, length: int | None = None, batch: int = 4, seed: int = 0) -> torch.Tensor:
    """(batch, 2 length) the probe: ``length`` random ids (default min(max_len // 2, 64)) repeated twice."""
    cfg = model.config
    return repeated_tokens(cfg.num_tokens, length or min(cfg.max_len // 2, 64), batch=batch, seed=seed)


def score_record(model, probe: torch.Tensor, step: int, loss: float | None = None) -> dict:
    """One record: the step, the loss and every detector's (n_layer, n_head) scores on ``probe``."""
    scores = all_head_scores(model, probe)
    return {"step": int(step), "loss": None if loss is None else float(loss),
            "scores": {kind: [[round(float(s), 6) for s in row] for row in scores[kind]] for kind in KINDS}}


def append_record(run_dir: str | os.PathLike, record: dict) -> Path:
    """Append ``record`` as one line to ``run_dir/head_scores.jsonl`` (one write of a whole line, flushed)."""
    path = Path(run_dir) / WATCH_FILE
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, allow_nan=False) + "\n")
        f.flush()
    return path


def read_records(run_dir: str | os.PathLike) -> list[dict]:
    """The records of ``run_dir/head_scores.jsonl`` (or of that file given directly), in step order.

    Raises:
        FileNotFoundError: no such file (the message says how a run gets one).
        ValueError: a line that is not a record (naming the file and the line number).
    """
    path = Path(run_dir)
    path = path / WATCH_FILE if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: a run records head scores when trained with "
                                "decoderlab.headwatch.HeadWatch (decoderlab train --watch-heads N)")
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            ok = isinstance(rec, dict) and isinstance(rec.get("step"), int) and isinstance(rec.get("scores"), dict)
        except json.JSONDecodeError:
            ok = False
        if not ok:
            raise ValueError(f"{path} line {n} is not a head-score record: {line[:80]!r}")
        records.append(rec)
    return sorted(records, key=lambda r: r["step"])


def score_curves(records: list[dict], kind: str = "induction") -> tuple[list[int], torch.Tensor]:
    """(steps, scores (n_records, n_layer, n_head)) of one detector over the records."""
    if kind not in KINDS:
        raise ValueError(f"unknown head detector {kind!r}; allowed: {', '.join(KINDS)}")
    if not records:
        raise ValueError("no head-score records to read")
    return [r["step"] for r in records], torch.tensor([r["scores"][kind] for r in records], dtype=torch.float64)


def formation_steps(records: list[dict], kind: str = "induction", threshold: float = FORMED_AT
                    ) -> dict[tuple[int, int], int | None]:
    """{(layer, head): the first recorded step at which its ``kind`` score reached ``threshold``, or None}."""
    steps, scores = score_curves(records, kind)
    out = {}
    for layer in range(scores.size(1)):
        for head in range(scores.size(2)):
            hit = (scores[:, layer, head] >= threshold).nonzero()
            out[(layer, head)] = steps[int(hit[0])] if hit.numel() else None
    return out


def watch_table(records: list[dict], kind: str = "induction", threshold: float = FORMED_AT) -> str:
    """The CLI's table: per head, its first and last score and the step it formed, then the loss."""
    steps, scores = score_curves(records, kind)
    formed = formation_steps(records, kind, threshold)
    lines = [f"{kind} scores over {len(steps)} records (steps {steps[0]} .. {steps[-1]}; formed = first step "
             f">= {threshold:g}):", f"  {'head':<8}{'first':>7}{'last':>8}  formed"]
    for (layer, head), step in formed.items():
        lines.append(f"  {f'L{layer}H{head}':<8}{float(scores[0, layer, head]):7.3f}{float(scores[-1, layer, head]):8.3f}"
                     f"  {'-' if step is None else step}")
    losses = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None and math.isfinite(r["loss"])]
    if losses:
        lines.append(f"loss {losses[0][1]:.4f} at step {losses[0][0]} -> {losses[-1][1]:.4f} at step {losses[-1][0]}")
    return "\n".join(lines)
