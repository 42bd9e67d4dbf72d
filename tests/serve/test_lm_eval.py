"""lm-evaluation-harness against the real server: ``lm_eval --model local-completions`` on a local
multiple-choice task (``lm_eval_task/``: a task YAML over a JSONL file, nothing downloaded) scores each choice
through ``echo`` + ``logprobs`` and tokenizes through the server's ``/tokenize``; its accuracy is exactly the
one computed with decoderlab's own log-likelihoods (``decoderlab.generation.scoring.loglikelihood``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")

from decoderlab.generation.scoring import loglikelihood  # noqa: E402
from decoderlab.serve import ServerThread, create_app  # noqa: E402

from .helpers import MODEL_ID  # noqa: E402

TASK = Path(__file__).parent / "lm_eval_task"


def library_accuracy(model, tok) -> float:
    """lm-eval's multiple-choice accuracy recomputed: context = the question, continuation = " " + choice
    (its target delimiter), encoded as lm-eval does (the whole text, then the context's tokens split off)."""
    right = 0
    docs = [json.loads(line) for line in (TASK / "tiny_choice.jsonl").read_text().splitlines()]
    for d in docs:
        scores = []
        for choice in d["choices"]:
            whole, ctx = tok.encode(d["question"] + " " + choice), tok.encode(d["question"])
            scores.append(loglikelihood(model, ctx, whole[len(ctx):])[0])
        right += max(range(len(scores)), key=scores.__getitem__) == d["answer"]
    return right / len(docs)


@pytest.mark.slow
def test_lm_eval_local_completions_gets_the_librarys_accuracy(mt, tmp_path):
    model, tok = mt
    task = tmp_path / "task"
    task.mkdir()
    (task / "tiny_choice.jsonl").write_text((TASK / "tiny_choice.jsonl").read_text())
    (task / "tiny_choice.yaml").write_text((TASK / "tiny_choice.yaml").read_text().replace(
        "test: tiny_choice.jsonl", f"test: {task / 'tiny_choice.jsonl'}"))
    app = create_app(model, tok, model_id=MODEL_ID, template=None)
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               TOKENIZERS_PARALLELISM="false")
    with ServerThread(app) as url:
        run = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--tasks", "decoderlab_tiny_choice",
             "--include_path", str(task), "--output_path", str(tmp_path / "out"), "--model_args",
             f"base_url={url}/v1/completions,model={MODEL_ID},tokenizer_backend=remote,max_length=32,"
             f"num_concurrent=1,max_retries=1"],
            capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results*.json")).read_text())
    acc = results["results"]["decoderlab_tiny_choice"]["acc,none"]
    assert acc == library_accuracy(model, tok)
