"""``train_lm``: a GPT-style language model on a corpus, in a few readable steps: the run (planned by
:mod:`.run`), the text, the tokenizer and model config, the data, the trainer, the fit, the summary.

The run directory it writes, what a resume keeps and what it refuses: :mod:`decoderlab.training.run`; the
model's own settings (preset, tokenizer, vocabulary size, shape) are the run's too, and a corpus that differs
from the one the run was trained on is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import lightning as L
import torch

from ..checkpoint import CONFIG_FILE, TOKENIZER_FILE, read_config
from ..config.recipes import resolve as resolve_recipe
from ..config.train import TrainConfig
from ..data import (SequentialWindows, check_split_lengths, corpus_tokens, read_corpus, split_tokens,
                    token_byte_lengths)
from ..model import DecoderOnlyTransformer
from ..model import preset as preset_config
from ..tokenizers import Tokenizer, build_tokenizer
from .callbacks import ExportCheckpoint, LMMetrics, LossHistory, NonFiniteLossGuard
from .interrupted import InterruptNotice
from .datamodule import TokenDataModule
from .evaluation import evaluation_sums
from .module import LitModel
from .progress import PlainProgress
from .run import Run, ShareRunDirectory, Summary, fit_run, mean_of_last, plan_run
from .strategy import on_training_device
from .timing import ValidationClock
from .trainer import check_run_options, make_trainer

#: ``train_lm``'s model preset when none is given (``decoderlab train``'s default is a recipe: ``DEFAULT_RECIPE``)
DEFAULT_PRESET = "baby-shakespeare"


@dataclass
class TrainSummary(Summary):
    """What ``train_lm`` reports, as attributes or as the mapping of ``summary.json`` (``summary["steps"]``).
    Losses are nats per token.

    Attributes:
        steps: optimizer steps done (in total, including those before a resume).
        train_loss: mean training loss of the last ``train_loss_steps`` = min(50, steps) steps.
        val_loss: validation loss of the final model: nats summed over the targets of all (or
            ``val_batches``) validation windows / their number.
        val_ppl: ``exp(val_loss)``; val_bpb: bits per byte, those nats / (ln 2 x the UTF-8 bytes of those
            same targets).
        tokens_per_second: training tokens (targets, all processes) / ``train_seconds``.
        train_seconds: seconds spent in training steps; wall_seconds: of the whole run (every ``trainer.fit``,
            those before a resume included).
        train_losses: loss of every optimizer step; val_history: [(step, val_loss)] at each evaluation.
        run_dir: the run directory (decoderlab checkpoint + ``lightning/`` + ``logs/``).
        device: where the model trained and the final evaluation ran ("cpu", "cuda:0", "mps:0").
        eval_log: every evaluation of this ``fit`` with its wall-clock time and whether it covered all windows
            or the ``val_batches`` subset (:class:`~decoderlab.training.timing.ValidationClock`'s entries).
    """

    steps: int
    train_loss: float
    val_loss: float | None
    val_ppl: float | None
    val_bpb: float | None
    tokens_per_second: float
    train_seconds: float
    wall_seconds: float
    num_parameters: int
    train_losses: list[float]
    val_history: list[tuple[int, float]]
    run_dir: str | None
    is_global_zero: bool = True
    train_loss_steps: int = 0
    eval_log: list = dataclasses.field(default_factory=list)
    device: str | None = None


def train_lm(corpus: str | os.PathLike | None = None, *, text: str | None = None, preset: str | None = None,
             tokenizer: str | Tokenizer | None = None, vocab_size: int | None = None,
             out: str | os.PathLike | None = None, train_config: TrainConfig | None = None,
             config_overrides: dict | None = None, model_overrides: dict | None = None,
             resume: str | os.PathLike | bool | None = None, devices: int | str = 1, strategy: str = "auto",
             num_nodes: int = 1, accelerator: str = "auto", cache_dir: str | os.PathLike | None = None,
             callbacks: Sequence[L.Callback] = (), progress_bar: bool | str = True, logger: bool = True):
    """Train a GPT-style language model on a corpus with Lightning; return ``(model, tokenizer, summary)``
    (:class:`TrainSummary`).

    The corpus (``corpus``: a text file or a folder of .txt files; None = the embedded tinyshakespeare; or the
    text itself as ``text``) is tokenized once (cached), split by position (the last ``val_fraction`` for
    validation) and served as random windows. The model is ``preset`` (a model preset, or a recipe: a preset
    with its ``TrainConfig``, used when ``train_config`` is None; default "baby-shakespeare" with
    ``TrainConfig()``) with ``num_tokens`` = the ``tokenizer``'s vocabulary (default "char"), changed by
    ``model_overrides``, trained as ``train_config`` (+ ``config_overrides``) says. ``out`` (default
    ``runs/<timestamp>``) becomes the run directory (:mod:`decoderlab.training.run`); ``resume`` (a run
    directory, a ``.ckpt`` file, or True for ``out``) continues a run with its own model, tokenizer, corpus and
    settings (changes honoured from the next step, or refused as the module says). ``devices``, ``strategy``,
    ``num_nodes``, ``accelerator``: Lightning's (``batch_size`` is per process). ``progress_bar``: True (a
    step bar), "plain" (a line every ``log_every`` steps and per evaluation) or False.

    Raises:
        FileNotFoundError: missing corpus path; ``resume`` without a checkpoint there.
        FileExistsError: a new run's ``out`` holds files.
        ValueError: bad config values; a ``corpus`` that is text rather than a path; an empty corpus or a split
            shorter than max_len + 1 tokens; fewer validation windows than processes; a non-UTF-8 file; a
            resumed corpus that differs from the run's; a setting a resume cannot change (named).
        NonFiniteLossError: the loss became NaN/inf (the last good checkpoint is kept).
    """
    resuming = resume not in (None, False)
    model_preset, recipe = (None, None) if preset is None and resuming else resolve_recipe(preset or DEFAULT_PRESET)
    run = plan_run(out, resume, train_config, config_overrides, recipe, kind="train")
    check_run_options(run.cfg, strategy, accelerator)  # the machine's refusals before the corpus is read
    preset = run.info.get("preset") if run.resumed and preset is None else (preset or DEFAULT_PRESET)
    corpus = run.info.get("corpus") if corpus is None and text is None else corpus
    corpus_text = _corpus_text(corpus, text)
    _check_settings(run.cfg)  # after the corpus is read, so that a bad --data gets one line
    tok, model_cfg = _tokenizer_and_config(run, corpus_text, preset, model_preset, tokenizer, vocab_size,
                                           model_overrides)
    run.announce()  # every refusal is behind us
    _warn_settings(run.cfg)
    dm, val_tokens, bytes_per_token = _data(corpus_text, tok, run.cfg, model_cfg.max_len, cache_dir)
    L.seed_everything(run.cfg.seed, verbose=False)
    model = DecoderOnlyTransformer(model_cfg)
    meta = {"task": "lm", "preset": preset, "tokenizer": tok.kind, "bytes_per_token": bytes_per_token}
    pieces = _callbacks(run, tok, meta, val_tokens, model_cfg.max_len)
    trainer = make_trainer(run.cfg, run.run_dir, devices=devices, strategy=strategy, num_nodes=num_nodes,
                           accelerator=accelerator, callbacks=[*pieces.values(), *callbacks],
                           progress_bar=progress_bar, logger=logger)
    # every process needs validation windows: refuse before training (and before launching processes)
    SequentialWindows(val_tokens, model_cfg.max_len, run.cfg.val_batch_size, run.cfg.val_batches, 0,
                      trainer.world_size)
    run.record(trainer, model_cfg, tok, dict(devices=devices, strategy=strategy, num_nodes=num_nodes),
               corpus=None if text is not None or corpus is None else str(Path(corpus).resolve()),
               corpus_sha256=_sha256(corpus_text), preset=preset, tokenizer=tok.kind)
    _prepare_fit(trainer, model, run.cfg)
    wall = fit_run(trainer, LitModel(model, run.cfg), run, datamodule=dm)
    model, summary = _summarize(trainer, model, run, pieces, val_tokens, wall)
    return model.eval(), tok, summary


def _check_settings(cfg: TrainConfig) -> None:
    """Before training: refuse an unknown ``torch.compile`` backend (torch would fail at the first step)."""
    if isinstance(cfg.compile, str):
        backends = torch.compiler.list_backends(exclude_tags=())
        if cfg.compile not in backends:
            raise ValueError(f"compile backend {cfg.compile!r} is not one of this PyTorch's: {', '.join(backends)}")


def _warn_settings(cfg: TrainConfig) -> None:
    """After the run's first lines: warn about a warm-up at least as long as the run."""
    if cfg.warmup >= cfg.max_steps:
        warnings.warn(f"warmup ({cfg.warmup} steps) is at least max_steps ({cfg.max_steps}): the learning rate rises "
                      f"for the whole run and never reaches its peak or decays", UserWarning, stacklevel=3)


def _prepare_fit(trainer, model, cfg: TrainConfig) -> None:
    """Just before ``fit``: with ``cfg.compile`` each decoder block compiled in place (``Module.compile``, so
    state-dict keys stay plain); the labels of the plain evaluation lines (:func:`_label_evaluations`)."""
    if cfg.compile:
        for block in model.blocks:
            block.compile(backend="inductor" if cfg.compile is True else str(cfg.compile))
    _label_evaluations(trainer, cfg)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _corpus_text(corpus, text) -> str:
    if text is not None:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if not text.strip():
            raise ValueError(f"the corpus text is empty: it has {len(text)} characters and none but whitespace")
        return text
    return read_corpus(corpus)


def _data(corpus_text: str, tok, cfg: TrainConfig, max_len: int, cache_dir):
    """The token split and its data module: ``(datamodule, validation tokens, bytes per token)``."""
    tokens = corpus_tokens(corpus_text, tok, cache_dir)
    train_tokens, val_tokens = split_tokens(tokens, cfg.val_fraction)
    check_split_lengths(len(train_tokens), len(val_tokens), max_len)
    dm = TokenDataModule(train_tokens, val_tokens, max_len=max_len, batch_size=cfg.batch_size, seed=cfg.seed,
                         val_batch_size=cfg.val_batch_size, val_batches=cfg.val_batches, num_workers=cfg.num_workers)
    return dm, val_tokens, len(corpus_text.encode("utf-8")) / len(tokens)  # of the whole corpus (meta.json)


def _callbacks(run: Run, tok, meta: dict, val_tokens, max_len: int) -> dict:
    """The run's own callbacks by name: loss history, exact metrics, the NaN guard, the evaluation clock, the
    checkpoint export, the Ctrl-C notice and the run directory shared over processes."""
    cfg = run.cfg
    byte_lengths = token_byte_lengths(tok)
    history, metrics = LossHistory(), LMMetrics(byte_lengths)
    clock = ValidationClock(val_tokens, max_len, cfg.val_batch_size, metrics, full_val_below=cfg.full_val_below,
                            subset=cfg.val_batches is not None, precision=cfg.precision, byte_lengths=byte_lengths)
    return {"history": history, "metrics": metrics, "guard": NonFiniteLossGuard(run.run_dir), "clock": clock,
            "exporter": ExportCheckpoint(run.run_dir, tok, meta, metrics), "notice": InterruptNotice(run.run_dir),
            "share": ShareRunDirectory(run)}


def _label_evaluations(trainer, cfg: TrainConfig) -> None:
    """A run that evaluates a subset of the validation windows while training and all of them at the end
    labels its plain evaluation lines (they would read alike at the last step)."""
    if cfg.val_batches is not None and cfg.full_val_at_end:
        for cb in trainer.callbacks:
            if isinstance(cb, PlainProgress):
                cb.windows = f"first {cfg.val_batches * cfg.val_batch_size:,} windows"


def _tokenizer_and_config(run: Run, corpus_text: str, preset: str, model_preset: str | None, tokenizer, vocab_size,
                          model_overrides):
    """Step 2: the tokenizer and the model config -- the run's own when resuming (a different preset,
    tokenizer, vocabulary size or model override is refused), else new ones (the model preset
    ``model_preset``: ``preset``'s own, or the one its recipe names)."""
    if run.resumed:
        _refuse_model_changes(run, preset, tokenizer, vocab_size, model_overrides)
        if run.info.get("corpus_sha256") not in (None, _sha256(corpus_text)):
            raise ValueError(f"cannot resume {run.run_dir}: the corpus differs from the one the run was trained on "
                             f"({run.info.get('corpus')!r}, sha256 {run.info['corpus_sha256'][:12]}...)")
        tok = Tokenizer.load(run.run_dir / TOKENIZER_FILE)
        model_cfg = read_config(run.run_dir)
        if tok.vocab_size != model_cfg.num_tokens:
            raise ValueError(f"cannot resume {run.run_dir}: tokenizer vocabulary size {tok.vocab_size} does not "
                             f"match config num_tokens {model_cfg.num_tokens}")
        return tok, model_cfg
    tokenizer = "char" if tokenizer is None else tokenizer
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else build_tokenizer(tokenizer, corpus_text, vocab_size)
    model_cfg = preset_config(model_preset, **{"num_tokens": tok.vocab_size, **(model_overrides or {})})
    if model_cfg.num_tokens != tok.vocab_size:
        raise ValueError(f"model num_tokens {model_cfg.num_tokens} does not match the tokenizer's vocabulary "
                         f"size {tok.vocab_size}")
    return tok, model_cfg


def _refuse_model_changes(run: Run, preset, tokenizer, vocab_size, model_overrides) -> None:
    """What a resumed run keeps (its model and tokenizer): refuse a preset, tokenizer, vocabulary size or model
    override that differs from the run's, naming it."""
    rdir = run.run_dir
    saved_tok = Tokenizer.load(rdir / TOKENIZER_FILE)
    model_cfg = read_config(rdir)
    keep = "a resumed run keeps its model and tokenizer: resume without it, or train a new run (another --out)"
    if preset is not None and preset != run.info.get("preset"):
        raise ValueError(f"cannot resume {rdir} with preset {preset!r}: the run was trained with preset "
                         f"{run.info.get('preset')!r}; {keep}")
    if isinstance(tokenizer, Tokenizer):
        if tokenizer.to_dict() != saved_tok.to_dict():
            raise ValueError(f"cannot resume {rdir} with a different {tokenizer.kind} tokenizer than the run's "
                             f"{saved_tok.kind} tokenizer ({rdir / TOKENIZER_FILE}); {keep}")
    elif tokenizer is not None and tokenizer != saved_tok.kind:
        raise ValueError(f"cannot resume {rdir} with tokenizer {tokenizer!r}: the run was trained with the "
                         f"{saved_tok.kind!r} tokenizer ({rdir / TOKENIZER_FILE}); {keep}")
    if vocab_size is not None and vocab_size != saved_tok.vocab_size:
        raise ValueError(f"cannot resume {rdir} with vocab_size {vocab_size}: the run's tokenizer has "
                         f"{saved_tok.vocab_size} tokens; {keep}")
    for name, value in (model_overrides or {}).items():
        if not hasattr(model_cfg, name):
            raise ValueError(f"unknown model setting {name!r} in model_overrides")
        if getattr(model_cfg, name) != value:
            raise ValueError(f"cannot resume {rdir} with model setting {name}={value!r}: the run's model has "
                             f"{name}={getattr(model_cfg, name)!r} ({rdir / CONFIG_FILE}); {keep}")


def _log_final_evaluation(trainer, final: dict, windows: str | None = None) -> None:
    """The final evaluation (made after ``fit``) in the loggers and, with plain progress, as a line."""
    values = {k: v for k, v in final.items() if v is not None}
    for lg in trainer.loggers:  # step N = after N optimizer steps, as the evaluations in fit
        lg.log_metrics(values, step=trainer.global_step)
        lg.save()
    for cb in trainer.callbacks:
        if isinstance(cb, PlainProgress):
            cb.validation_line(trainer.global_step, final["val_loss"], final.get("val_bpb"), windows=windows)


def _final_evaluation(trainer, model, run: Run, pieces: dict, val_tokens) -> dict:
    """The final model's metrics (rank 0): the last validation's when it was at this step (and covered what
    the report needs), else a new evaluation over the validation windows (all of them with
    ``full_val_at_end``), logged and printed as the evaluations in ``fit``."""
    cfg, metrics, clock = run.cfg, pieces["metrics"], pieces["clock"]
    full_at_end = cfg.full_val_at_end and cfg.val_batches is not None  # the subset served while training only
    if not full_at_end and metrics.history and metrics.history[-1][0] == trainer.global_step and metrics.last:
        return dict(metrics.last)
    sums = clock.full_sums(model, trainer.global_step) if full_at_end else evaluation_sums(
        model, val_tokens, model.config.max_len, cfg.val_batch_size, cfg.val_batches, trainer.precision,
        clock.byte_lengths)
    loss = sums["nats"] / sums["targets"]
    final = {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)),
             "val_bpb": sums["nats"] / (math.log(2) * sums["bytes"]) if sums["bytes"] else None}
    metrics.history.append((trainer.global_step, loss))
    if not full_at_end:  # (full_sums recorded its own)
        clock.record(trainer.global_step, loss, "all" if cfg.val_batches is None else "subset")
    windows = f"all {(len(val_tokens) - 1) // model.config.max_len:,} windows" if full_at_end else None
    _log_final_evaluation(trainer, final, windows)
    return final


def _summarize(trainer, model, run: Run, pieces: dict, val_tokens, wall: float) -> tuple:
    """``(the model to return, the summary)``: the final evaluation and export on the device the model trained on
    (rank 0; the whole weights under FSDP), then the summary (and ``summary.json``)."""
    final = {}
    with on_training_device(trainer, model) as (whole, device):  # every process enters (a collective under FSDP)
        model = whole if whole is not None else model
        if whole is not None:
            final = _final_evaluation(trainer, model, run, pieces, val_tokens)
            pieces["exporter"].export(trainer, model)
    history = pieces["history"]
    train_loss, n_last = mean_of_last(history.losses)
    summary = TrainSummary(
        steps=trainer.global_step, train_loss=train_loss,
        val_loss=final.get("val_loss"), val_ppl=final.get("val_ppl"), val_bpb=final.get("val_bpb"),
        tokens_per_second=history.tokens / history.train_seconds if history.train_seconds else 0.0,
        train_seconds=history.train_seconds, wall_seconds=history.wall_seconds_before + wall,
        num_parameters=model.num_parameters(), train_losses=list(history.losses),
        val_history=list(pieces["metrics"].history), run_dir=str(run.run_dir), is_global_zero=trainer.is_global_zero,
        train_loss_steps=n_last, eval_log=list(pieces["clock"].entries), device=None if device is None else str(device))
    run.write_summary(trainer, summary)
    return model, summary
