"""The supervised half of :func:`~decoderlab.finetuning.finetune` (``method="sft"``): the conversations and their
held-out split, the training rows, and the summary with the held-out evaluation."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ..chat import ChatTemplate, as_conversations
from ..config.defaults import FINETUNE_VAL_FRACTION
from ..lora import has_lora, merge_lora
from ..training import Run, Summary, mean_of_last
from ..training.strategy import on_training_device
from .evaluation import build_examples, check_eval_prompts, evaluate_chat
from .start import held_out_fraction, path_or_none, sha256_of, split_held_out


@dataclass
class FinetuneSummary(Summary):
    """What :func:`finetune` reports (losses in nats per supervised token), as attributes or as the mapping of
    ``summary.json`` (``summary["steps"]``).

    Attributes:
        steps: optimizer steps done; train_loss: mean step loss of the last min(50, steps) steps;
        train_losses: every step's loss; val_history: [(step, val_loss)];
        evaluation: :func:`evaluate_chat`'s dict on the held-out conversations (or the training ones when
            there are none, ``eval_on`` says which);
        train_conversations / val_conversations: conversations trained on (those with a supervised token
            within max_len + 1 tokens) / held out; truncated / dropped: conversations cut to max_len + 1 tokens
            / dropped for having no supervised token left (training and validation together);
        template: the chat template's name; added_tokens: special tokens added to the base vocabulary;
        device: where the model trained and the evaluation ran ("cpu", "cuda:0", ...);
        trainable_parameters: the parameters that trained (all, or the LoRA adapters'); lora: the adapters'
            settings (None: none).
    """

    steps: int
    train_loss: float
    train_losses: list[float]
    val_history: list[tuple[int, float]]
    evaluation: dict
    eval_on: str
    train_conversations: int
    val_conversations: int
    truncated: int
    dropped: int
    template: str
    added_tokens: list[str]
    num_parameters: int
    train_seconds: float
    run_dir: str | None
    is_global_zero: bool = True
    device: str | None = None
    trainable_parameters: int | None = None
    lora: dict | None = None


def conversations_of(run: Run, data, val_data, val_fraction) -> tuple[dict, list, list]:
    """``(what run.json records of the data, training conversations, held-out conversations)``: ``val_data``,
    or the seeded ``val_fraction`` of ``data``; on a resume the run's own data (refusing other conversations)
    and fraction."""
    if run.resumed:
        data = run.info.get("data") if data is None else data
        val_data = run.info.get("val_data") if val_data is None else val_data
    if data is None:
        raise ValueError(f"cannot resume {run.run_dir} without data: it was fine-tuned on conversations given as a "
                         f"list, which run.json does not hold; give the same conversations as data" if run.resumed
                         else "give the conversations to fine-tune on: data, a JSONL path or a list of conversations")
    convs = as_conversations(data)
    held = None if val_data is None else as_conversations(val_data)
    digest = sha256_of(convs, held)
    if run.resumed and run.info.get("data_sha256") not in (None, digest):
        raise ValueError(f"cannot resume {run.run_dir}: the conversations differ from those it was fine-tuned on "
                         f"({run.info.get('data')!r}); resume with the same data, or start a new run")
    fraction = held_out_fraction(run, val_fraction, FINETUNE_VAL_FRACTION)
    info = {"data": path_or_none(data), "val_data": path_or_none(val_data), "val_fraction": fraction,
            "data_sha256": digest}
    if held is not None:
        return info, list(convs), list(held)
    return (info, *split_held_out(convs, fraction, run.cfg.seed))


def sft_examples(train_convs: list, val_convs: list, tok, template: ChatTemplate, max_len: int):
    """``(training Examples, held-out Examples or None)``; says how many were truncated or dropped."""
    train_ex = build_examples(train_convs, tok, template, max_len)
    val_ex = build_examples(val_convs, tok, template, max_len) if val_convs else None
    truncated = train_ex.truncated + (val_ex.truncated if val_ex else 0)
    dropped = train_ex.dropped + (val_ex.dropped if val_ex else 0)
    if not train_ex.rows:
        raise ValueError(f"no supervised token in the training data: all {len(train_convs)} conversations have "
                         f"their assistant turns beyond max_len={max_len} tokens; use shorter conversations or a "
                         f"model with a longer context")
    ex, convs = (val_ex, val_convs) if val_ex else (train_ex, train_convs)  # what the evaluation will answer
    check_eval_prompts(tok, template, [convs[i] for i in ex.conversations], max_len, None)  # before any step
    if truncated or dropped:
        print(f"decoderlab: {truncated} conversation(s) longer than max_len + 1 = {max_len + 1} tokens were "
              f"truncated; {dropped} with no assistant token left were dropped", file=sys.stderr)
    return train_ex, val_ex


def merged(model):
    """The trained model as an ordinary one, in eval mode: LoRA adapters folded in (a copy), else itself."""
    return (merge_lora(model) if has_lora(model) else model).eval()


def summarize_sft(trainer, run: Run, model, tok, template: ChatTemplate, exporter, convs: tuple, examples: tuple,
                  start: dict, seconds: float, eval_options: dict) -> tuple:
    """``(the model to return, the summary)``: the evaluation and the final export on the device the model
    trained on (rank 0, the whole weights under FSDP; on the held-out conversations, else the training ones),
    then the summary (and ``summary.json``). ``start``: the starting point's record, with the run's
    ``trainable_parameters`` and ``lora``."""
    (train_convs, val_convs), (train_ex, val_ex) = convs, examples
    eval_convs, eval_on = (val_convs, "held-out") if val_convs else (train_convs, "train")
    evaluation: dict = {}
    with on_training_device(trainer, model) as (whole, device):  # every process enters (a collective under FSDP)
        if whole is not None:
            model = merged(whole)
            evaluation = evaluate_chat(model, tok, template, eval_convs, **eval_options)
            exporter.meta.update(evaluation=dict(evaluation), eval_on=eval_on)
            exporter.export(trainer, whole)  # (with its adapters: the adapter alone is saved too when asked)
    model = model.cpu()  # (the merged copy too, as Lightning leaves a trained module)
    module = trainer.lightning_module
    summary = FinetuneSummary(
        steps=trainer.global_step, train_loss=mean_of_last(module.losses)[0], train_losses=list(module.losses),
        val_history=list(module.val_history), evaluation=evaluation, eval_on=eval_on,
        train_conversations=len(train_ex.rows), val_conversations=len(val_ex.rows) if val_ex else 0,
        truncated=train_ex.truncated + (val_ex.truncated if val_ex else 0),
        dropped=train_ex.dropped + (val_ex.dropped if val_ex else 0), template=template.name,
        added_tokens=start["added_tokens"], num_parameters=model.num_parameters(), train_seconds=seconds,
        run_dir=str(run.run_dir), is_global_zero=trainer.is_global_zero, device=str(device),
        trainable_parameters=start["trainable_parameters"], lora=start["lora"])
    run.write_summary(trainer, summary)
    return model, summary
