"""The preference half of :func:`~decoderlab.finetuning.finetune` (``method="dpo"``): TRL's preference rows and
their held-out split, the pair rows rendered with the chat template, the held-out DPO metrics, and the summary.

The loss, the batches and the Lightning module are :mod:`decoderlab.training.dpo`'s; the reference model is the
starting model, frozen (:func:`decoderlab.training.module.frozen_copy`, taken before any LoRA adapter).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ..chat import ChatTemplate
from ..config.defaults import FINETUNE_VAL_FRACTION
from ..feedback import PreferencePair, load_preferences, render_pair
from ..training import Run, Summary, mean_of_last
from ..training.dpo import PreferenceExamples, build_preference_examples, collate_pairs, dpo_loss, sequence_logprobs
from ..training.strategy import on_training_device
from .start import held_out_fraction, path_or_none, sha256_of, split_held_out
from .supervised import merged


@dataclass
class PreferenceSummary(Summary):
    """What :func:`finetune` with ``method="dpo"`` reports, as attributes or as the mapping of ``summary.json``.

    Attributes:
        steps: optimizer steps done; train_loss: mean DPO loss (nats per pair) of the last min(50, steps)
            steps; history: per step ``{"step", "loss", "reward_margin", "reward_accuracy", "chosen_reward",
            "rejected_reward"}`` (means over the step's pairs; rewards are beta times the log-ratio to the
            reference, nats); val_history: [(step, held-out loss)];
        evaluation: :func:`evaluate_preferences` of the final model on the held-out pairs (or the training
            ones when there are none, ``eval_on`` says which);
        train_pairs / val_pairs: pairs trained on / held out (those with a supervised token on both sides
            within max_len + 1 tokens); truncated / dropped: pairs with a side cut / left without a target;
        beta: DPO's beta; template, added_tokens, num_parameters, trainable_parameters, lora, train_seconds,
            run_dir, is_global_zero, device: as :class:`~decoderlab.finetuning.FinetuneSummary`.
    """

    steps: int
    train_loss: float
    history: list[dict]
    val_history: list[tuple[int, float]]
    evaluation: dict
    eval_on: str
    train_pairs: int
    val_pairs: int
    truncated: int
    dropped: int
    beta: float
    template: str
    added_tokens: list[str]
    num_parameters: int
    trainable_parameters: int
    lora: dict | None
    train_seconds: float
    run_dir: str | None
    is_global_zero: bool = True
    device: str | None = None


def pairs_of(run: Run, data, val_data, val_fraction) -> tuple[dict, list[PreferencePair], list[PreferencePair]]:
    """``(what run.json records, training pairs, held-out pairs)`` from TRL's preference rows
    (:func:`decoderlab.feedback.load_preferences`): ``val_data``, or the seeded ``val_fraction`` of ``data``;
    on a resume the run's own rows (refusing others) and fraction."""
    if run.resumed:
        data = run.info.get("data") if data is None else data
        val_data = run.info.get("val_data") if val_data is None else val_data
    if data is None:
        raise ValueError(f"cannot resume {run.run_dir} without data: it was trained on preference rows given as a "
                         f"list, which run.json does not hold; give the same rows as data" if run.resumed
                         else "give the preference rows to train on: data, a JSONL path or a list of rows")
    pairs = load_preferences(data)
    held = None if val_data is None else load_preferences(val_data)
    digest = sha256_of(*([[p.prompt, p.chosen, p.rejected] for p in s] for s in (pairs, held) if s is not None))
    if run.resumed and run.info.get("data_sha256") not in (None, digest):
        raise ValueError(f"cannot resume {run.run_dir}: the preference rows differ from those it was trained on "
                         f"({run.info.get('data')!r}); resume with the same data, or start a new run")
    fraction = held_out_fraction(run, val_fraction, FINETUNE_VAL_FRACTION)
    info = {"data": path_or_none(data), "val_data": path_or_none(val_data), "val_fraction": fraction,
            "data_sha256": digest}
    if held is not None:
        return info, pairs, held
    return (info, *split_held_out(pairs, fraction, run.cfg.seed, what="preference pairs"))


def pair_conversations(pairs) -> list[list[dict]]:
    """Both sides of every pair as conversations (prompt + chosen, prompt + rejected): the text a tokenizer
    must represent, and what a tokenizer built from scratch learns."""
    return [p.prompt + side for p in pairs for side in (p.chosen, p.rejected)]


def preference_examples(train_pairs: list, val_pairs: list, tok, template: ChatTemplate, max_len: int
                        ) -> tuple[PreferenceExamples, PreferenceExamples | None]:
    """``(training pairs, held-out pairs or None)`` rendered with ``template`` (the loss mask on each
    completion) and shifted once; says how many were truncated or dropped.

    Raises:
        ValueError: no training pair keeps a supervised token on both sides within max_len + 1 tokens.
    """
    def build(pairs):
        return build_preference_examples([render_pair(p, tok, template) for p in pairs], max_len,
                                         [p.line for p in pairs])

    train_ex = build(train_pairs)
    val_ex = build(val_pairs) if val_pairs else None
    truncated = train_ex.truncated + (val_ex.truncated if val_ex else 0)
    dropped = train_ex.dropped + (val_ex.dropped if val_ex else 0)
    if not train_ex.rows:
        raise ValueError(f"no preference pair to train on: all {len(train_pairs)} pairs have a completion beyond "
                         f"max_len={max_len} tokens; use shorter pairs or a model with a longer context")
    if truncated or dropped:
        print(f"decoderlab: {truncated} preference pair(s) with a side longer than max_len + 1 = {max_len + 1} tokens "
              f"were truncated; {dropped} with a side left without a completion token were dropped", file=sys.stderr)
    return train_ex, val_ex


@torch.no_grad()
def evaluate_preferences(model, reference, ex: PreferenceExamples, pad_id: int, beta: float,
                         batch_size: int = 16) -> dict:
    """DPO's metrics of ``model`` against ``reference`` over the pairs of ``ex``: the mean ``loss`` (nats per
    pair), ``reward_margin`` (mean of r_chosen - r_rejected), ``reward_accuracy`` (share with r_chosen >
    r_rejected), ``chosen_reward`` and ``rejected_reward`` (means), and ``pairs`` (how many); each None when
    there is no pair. Both models run in eval mode on the first model's device."""
    device = next(model.parameters()).device
    sums = torch.zeros(5, dtype=torch.float64)
    for i in range(0, len(ex.rows), batch_size):
        x, y = (t.to(device) for t in collate_pairs(ex.rows[i : i + batch_size], pad_id))
        b = x.size(0) // 2
        logp, ref = sequence_logprobs(model(x), y), sequence_logprobs(reference.eval()(x), y)
        losses, cr, rr = dpo_loss(logp[:b], logp[b:], ref[:b], ref[b:], beta)
        margin = cr - rr
        sums += torch.stack([losses.sum(), margin.sum(), (margin > 0).float().sum(), cr.sum(), rr.sum()]).cpu().double()
    n = len(ex.rows)
    names = ("loss", "reward_margin", "reward_accuracy", "chosen_reward", "rejected_reward")
    return {**{k: float(v) / n if n else None for k, v in zip(names, sums)}, "pairs": n}


def format_preferences(ev: dict, on: str = "held-out") -> str:
    """One line of :func:`evaluate_preferences`' dict for the terminal."""
    if not ev.get("pairs"):
        return f"{on}: no preference pair to evaluate"
    return (f"{on} ({ev['pairs']} pairs): DPO loss {ev['loss']:.4f} nats/pair, reward margin "
            f"{ev['reward_margin']:+.4f} nats, reward accuracy {ev['reward_accuracy']:.1%}")


def summarize_dpo(trainer, run: Run, model, reference, tok, template: ChatTemplate, exporter, examples: tuple,
                  start: dict, beta: float, seconds: float, pad_id: int) -> tuple:
    """``(the model to return, the summary)``: the held-out metrics and the final export on the device the
    model trained on (rank 0), then the summary (and ``summary.json``)."""
    train_ex, val_ex = examples
    eval_ex, eval_on = (val_ex, "held-out") if val_ex is not None and val_ex.rows else (train_ex, "train")
    evaluation: dict = {}
    with on_training_device(trainer, model) as (whole, device):
        if whole is not None:
            model = merged(whole)
            evaluation = evaluate_preferences(model, reference.to(device), eval_ex, pad_id, beta)
            exporter.meta.update(evaluation=dict(evaluation), eval_on=eval_on)
            exporter.export(trainer, whole)
    model, _ = model.cpu(), reference.cpu()  # (the merged copy too, as Lightning leaves a trained module)
    module = trainer.lightning_module
    summary = PreferenceSummary(
        steps=trainer.global_step, train_loss=mean_of_last([h["loss"] for h in module.history])[0],
        history=[dict(h) for h in module.history], val_history=list(module.val_history), evaluation=evaluation,
        eval_on=eval_on, train_pairs=len(train_ex.rows), val_pairs=len(val_ex.rows) if val_ex else 0,
        truncated=train_ex.truncated + (val_ex.truncated if val_ex else 0),
        dropped=train_ex.dropped + (val_ex.dropped if val_ex else 0), beta=beta, template=template.name,
        added_tokens=start["added_tokens"], num_parameters=model.num_parameters(),
        trainable_parameters=start["trainable_parameters"], lora=start["lora"], train_seconds=seconds,
        run_dir=str(run.run_dir), is_global_zero=trainer.is_global_zero, device=str(device))
    run.write_summary(trainer, summary)
    return model, summary
