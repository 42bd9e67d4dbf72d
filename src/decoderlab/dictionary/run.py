"""``train_sae``: a sparse autoencoder trained on one hook point of a checkpoint, in a run directory.

The run directory (``out``) is SAELens's SAE directory plus what a resume and the dashboards need::

    cfg.json, sae_weights.safetensors, sparsity.safetensors   SAELens's files (sae_lens.SAE.load_from_disk)
    sae_run.json        the checkpoint, the corpus, the settings, and at the end the held-out evaluation
    lightning/last.ckpt the whole training state every ``checkpoint_every`` steps (``resume=True``)

The corpus is the checkpoint's own training corpus (its ``run.json``), or ``data``; the SAE trains on the
training split's random windows and is evaluated on the held-out split (the run's ``val_fraction``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch

from ..files import atomic_write_text
from ..glassbox.features import SAEEvaluation, evaluate_sae, held_out_windows
from ..glassbox.sae import SparseAutoencoder, check_sae_hook, check_sae_size, load_sae
from ..waiting import ProgressLines
from .module import LAST_CKPT, LIGHTNING_DIR, SAEModule, SAEProgress, SaveEvery

SAE_RUN_FILE = "sae_run.json"
#: SAELens's default lr (3e-4) suits its normalised activations; ours are raw, and a TopK SAE of a small model
#: trains in a few hundred steps at this rate
DEFAULT_LR = 1e-3
#: windows per batch of the final evaluation: its progress is said after each of a batch's three passes, and
#: SmolLM2-135M's three over one batch of 29 windows of 128 tokens took 38 s on 2 shared cores (its logits in
#: float64, 1.5 GB); 8 windows take about a quarter of both
EVAL_BATCH = 8
#: Lightning's notes about what this loop does on purpose: no validation step, batches cut in the process, the
#: checkpoint loaded as the run's own
_HANDLED_WARNINGS = r".*(val_dataloader|does not have many workers|LeafSpec|weights_only|exists and is not empty).*"


@dataclass(frozen=True)
class SAETrainConfig:
    """The settings of one SAE run.

    Attributes:
        hook: the hook point read (``blocks.L.hook_resid_post``, ...; :func:`~decoderlab.glassbox.sae.sae_hook_names`);
            None: a middle layer's residual stream, ``blocks.<n_layer // 2>.hook_resid_post`` (:func:`default_hook`).
        width: features per input dimension (d_sae = width x d_in).
        k: active features per token (TopK); None for ReLU + L1.
        l1_coefficient: the L1 penalty of the ReLU variant.
        tokens: training tokens (steps = tokens // batch_tokens).
        batch_tokens: tokens per step (whole windows of ``context`` tokens).
        context: window length (default: the model's max_len, at most 128).
        lr: Adam's learning rate (constant, then a linear decay over the last 20%).
        dead_steps: a feature that has not fired for this many steps is dead.
        resample_every: resample dead features every this many steps (0: never), until 3/4 of the run.
        checkpoint_every: steps between resumable checkpoints.
        eval_tokens: held-out tokens of the final evaluation (and the span the progress lines count dead
            features over).
        seed: the SAE's initialisation, the batches and the resampling.
    """

    hook: str | None = None
    width: int = 8
    k: int | None = 32
    l1_coefficient: float = 5.0
    tokens: int = 2_000_000
    batch_tokens: int = 4096
    context: int | None = None
    lr: float = DEFAULT_LR
    dead_steps: int = 50
    resample_every: int = 100
    checkpoint_every: int = 100
    log_every: int = 50
    eval_tokens: int = 65_536
    seed: int = 42

    def replace(self, **changes) -> "SAETrainConfig":
        return dataclasses.replace(self, **changes)


@dataclass
class SAERun:
    """What :func:`train_sae` returns: the SAE, its run directory, the held-out evaluation, and the number
    of features resampled while training."""

    sae: SparseAutoencoder
    out: Path
    evaluation: SAEEvaluation
    resampled: int
    seconds: float


def default_hook(model_config) -> str:
    """The hook an SAE reads when none is named: a middle layer's residual stream,
    ``blocks.<n_layer // 2>.hook_resid_post``."""
    return f"blocks.{model_config.n_layer // 2}.hook_resid_post"


def _positive(value, name: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer ({what}), got {value!r}")
    return value


def run_corpus(checkpoint, data=None) -> tuple[str, float, str | None]:
    """``(text, val_fraction, corpus path)`` of the corpus an SAE of ``checkpoint`` reads: ``data`` (a file or
    folder), else the checkpoint's training corpus from its ``run.json`` (None there: the embedded
    tinyshakespeare, checked against the recorded sha256).

    Raises ``ValueError`` for a checkpoint that records no corpus (the lesson's pairs, a Hugging Face directory, a run
    trained on text passed directly) and no ``data``; ``FileNotFoundError`` for a missing corpus path."""
    from ..data import read_corpus

    run_file = Path(checkpoint) / "run.json"
    info = json.loads(run_file.read_text(encoding="utf-8")) if run_file.is_file() else {}
    val_fraction = float(info.get("train_config", {}).get("val_fraction", 0.1))
    if data is not None:
        return read_corpus(data), val_fraction, str(Path(data).resolve())
    if "corpus_sha256" not in info:
        raise ValueError(f"checkpoint {checkpoint} records no training corpus (no run.json of a language-model "
                         "run); pass the text to read with --data PATH")
    text = read_corpus(info.get("corpus"))
    if hashlib.sha256(text.encode("utf-8")).hexdigest() != info["corpus_sha256"]:
        where = info.get("corpus") or "the embedded tinyshakespeare"
        raise ValueError(f"checkpoint {checkpoint} was trained on a corpus that is not {where} any more (or on "
                         "text passed directly); pass the text to read with --data PATH")
    return text, val_fraction, info.get("corpus")


def _plan(out: Path, resume: bool, settings: dict) -> dict:
    """The run's settings: a new run's ``settings`` (``out`` must be empty), or the resumed run's own."""
    run_file = out / SAE_RUN_FILE
    if resume:
        if not (out / LIGHTNING_DIR / LAST_CKPT).is_file() or not run_file.is_file():
            raise FileNotFoundError(f"cannot resume: {out} holds no {LIGHTNING_DIR}/{LAST_CKPT} and {SAE_RUN_FILE} of "
                                    "an SAE run")
        return json.loads(run_file.read_text(encoding="utf-8"))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already holds files; give an empty or new --out directory, or --resume to "
                              "continue the SAE run there")
    return settings


def _check_settings(cfg: SAETrainConfig) -> int:
    """The steps of ``cfg``; every refusal that needs no model, before the model is loaded."""
    _positive(cfg.tokens, "tokens", "training tokens")
    _positive(cfg.batch_tokens, "batch_tokens", "tokens per step")
    if cfg.context is not None:
        _positive(cfg.context, "context", "window length")
    if cfg.tokens < cfg.batch_tokens:
        raise ValueError(f"tokens {cfg.tokens} is fewer than one batch of {cfg.batch_tokens} tokens; give at least "
                         f"{cfg.batch_tokens}")
    if not cfg.lr > 0:
        raise ValueError(f"lr must be positive, got {cfg.lr!r}")
    return cfg.tokens // cfg.batch_tokens


def _context(cfg: SAETrainConfig, model_cfg) -> int:
    """The window length: ``cfg.context``, or the model's max_len up to 128; checked against the model."""
    context = min(model_cfg.max_len, 128) if cfg.context is None else cfg.context
    if context > model_cfg.max_len:
        raise ValueError(f"context {context} is longer than the model's max_len {model_cfg.max_len}")
    if cfg.batch_tokens < context:
        raise ValueError(f"batch_tokens {cfg.batch_tokens} is fewer than one window of {context} tokens")
    return context


def _check_windows(n_train: int, n_val: int, context: int, data, corpus) -> None:
    """Both parts of the corpus (``n_train`` and ``n_val`` tokens) hold a window of ``context`` tokens and its
    next one -- checked before training, not found short by the evaluation at its end."""
    need = context + 1
    if n_train >= need and n_val >= need:
        return
    what = f"data {data}" if data is not None else f"the checkpoint's corpus {corpus or 'tinyshakespeare (embedded)'}"
    raise ValueError(f"{what} is too short: its {n_train + n_val:,} tokens split into {n_train:,} for training and "
                     f"{n_val:,} held out, and each part needs one window of {need} tokens (context {context} and "
                     f"the next token); give more text")


def train_sae(checkpoint, cfg: SAETrainConfig | None = None, *, out, data=None, resume: bool = False,
              progress_bar: bool | str = True, hook: str | None = None, callbacks=()) -> SAERun:
    """Train a sparse autoencoder on ``checkpoint``'s activations at ``cfg.hook`` and save it to ``out`` in
    SAELens's format (see the module docstring); ``resume=True`` continues the run in ``out`` with its own
    settings, repeating what the uninterrupted run would have done. ``checkpoint``: whatever
    :func:`decoderlab.load` reads (a decoderlab checkpoint or run directory, a Hugging Face directory, a GGUF
    file). ``progress_bar``, as ``train_lm``'s: True (a bar counting steps, with the MSE and L0), "plain" (a line
    every ``cfg.log_every`` steps) or False; with either of the first two the final evaluation says how it goes.
    ``hook``: the hook when no ``cfg`` is given (None: :func:`default_hook`).

    Every setting, the output directory and the corpus are checked before the model is loaded; the hook, the
    window and the corpus's length against the model before training.

    Raises:
        ValueError: a hook the model lacks or an SAE cannot read (listing the valid ones); width or k not
            positive, k > width x d_in; tokens fewer than one batch; no corpus recorded and no ``data``; a corpus
            too short for one training and one held-out window.
        FileExistsError: a new run's ``out`` holds files.  FileNotFoundError: nothing to resume; missing paths;
            a checkpoint path that is none of the kinds above (:func:`decoderlab.chat.checkpoint_kind`).
    """
    from ..chat import checkpoint_kind, load_model

    if progress_bar not in (True, False, "plain"):
        raise ValueError(f"progress_bar must be True (a bar), 'plain' (lines) or False, got {progress_bar!r}")
    checkpoint_kind(checkpoint)
    out = Path(out)
    settings = _plan(out, resume, {"checkpoint": str(Path(checkpoint).resolve()),
                                   "data": None if data is None else str(data),
                                   "config": dataclasses.asdict(cfg or SAETrainConfig(hook=hook))})
    cfg = SAETrainConfig(**settings["config"])
    steps = _check_settings(cfg)
    corpus = run_corpus(checkpoint, settings["data"])
    loaded = load_model(checkpoint, dtype="float32")  # the float activations an SAE is trained on, as before
    model = loaded.model.eval()
    if cfg.hook is None:
        cfg = cfg.replace(hook=default_hook(model.config))
        settings = {**settings, "config": dataclasses.asdict(cfg)}
    check_sae_hook(model, cfg.hook)
    context = _context(cfg, model.config)
    train, val = _split(corpus, loaded.tokenizer, context, settings["data"])
    return _train(out, model, cfg, settings, train, val, steps=steps, context=context,
                  dataset=corpus[2] or "tinyshakespeare (embedded)", resume=resume, progress_bar=progress_bar,
                  callbacks=callbacks)


def _split(corpus: tuple, tokenizer, context: int, data):
    """``(train, val)`` token arrays of ``corpus`` (:func:`run_corpus`'s), each checked to hold a window."""
    from ..data import corpus_tokens, split_tokens

    text, val_fraction, path = corpus
    tokens = corpus_tokens(text, tokenizer)
    n_train = math.floor(len(tokens) * (1 - val_fraction) + 1e-9)  # as split_tokens cuts
    _check_windows(n_train, len(tokens) - n_train, context, data, path)
    return split_tokens(tokens, val_fraction)


def _train(out: Path, model, cfg: SAETrainConfig, settings: dict, train, val, *, steps: int, context: int,
           dataset: str, resume: bool, progress_bar, callbacks) -> SAERun:
    """The SAE made, trained on the Lightning loop and evaluated (:func:`_finish`); every check passed.
    ``dataset``: the corpus's name in the SAE's metadata."""
    from ..training.datamodule import TokenDataModule
    from ..training.progress import StepProgressBar
    from ..training.trainer import fit

    windows = held_out_windows(val, context, max(1, cfg.eval_tokens // context))
    x0 = _d_in(model, cfg.hook)
    d_sae, k = check_sae_size(x0, cfg.width, cfg.k)
    meta = {"model_name": Path(settings["checkpoint"]).name, "hook_name": cfg.hook, "context_size": context,
            "dataset_path": dataset}
    sae = SparseAutoencoder(x0, d_sae, k, metadata=meta, seed=cfg.seed)
    module = SAEModule(sae, model, cfg.hook, lr=cfg.lr, steps=steps, l1_coefficient=cfg.l1_coefficient,
                       dead_steps=cfg.dead_steps, resample_every=cfg.resample_every, seed=cfg.seed)
    dm = TokenDataModule(train, val, max_len=context, batch_size=cfg.batch_tokens // context, seed=cfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / SAE_RUN_FILE, json.dumps(settings, indent=2))
    tokens_per_step = (cfg.batch_tokens // context) * context
    # the span the progress lines count dead features over: as many tokens as the final evaluation reads
    window = max(1, round(windows.size(0) * context / tokens_per_step))
    callbacks = [SaveEvery(out, cfg.checkpoint_every), *callbacks]
    if progress_bar == "plain":
        callbacks.append(SAEProgress(steps, cfg.log_every, tokens_per_step, window))
    elif progress_bar:
        callbacks.append(StepProgressBar(steps))
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=progress_bar is True, enable_model_summary=False, callbacks=callbacks,
                        num_sanity_val_steps=0, limit_val_batches=0, deterministic=False)
    ckpt = out / LIGHTNING_DIR / LAST_CKPT if resume else None
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_HANDLED_WARNINGS)
        fit(trainer, module, datamodule=dm, ckpt_path=None if ckpt is None else str(ckpt), weights_only=False)
    seconds = time.perf_counter() - t0
    dead = module.fired_on_none(window)
    return _finish(out, model, module, windows, settings, seconds, (dead[0], dead[1] * tokens_per_step),
                   progress=bool(progress_bar))


def _d_in(model, hook: str) -> int:
    from ..glassbox.features import hook_activations

    return int(hook_activations(model, torch.zeros(1, 1, dtype=torch.long), hook).shape[-1])


def _finish(out: Path, model, module: SAEModule, windows, settings: dict, seconds: float,
            dead_in_training: tuple[int, int], progress: bool) -> SAERun:
    """The held-out evaluation (with lines saying how it goes when ``progress``), the SAELens files and the
    summary in ``sae_run.json``; ``dead_in_training``: (features that fired on none of the last tokens of
    training, those tokens), the progress lines' measure."""
    sae = module.sae.eval()
    lines = None
    if progress:
        lines = ProgressLines("evaluation", windows.size(0) * (windows.size(1) - 1), "held-out tokens").start()
    ev = evaluate_sae(model, sae, module.hook, windows, batch_size=EVAL_BATCH,
                      progress=None if lines is None else lines.update)
    sae.save(out, log_sparsity=torch.log10(ev.density.double() + 1e-10))
    summary = {**ev.to_dict(), "dead_in_training": dead_in_training[0],
               "dead_in_training_tokens": dead_in_training[1], "resampled": module.resampled,
               "train_seconds": seconds, "steps": int(module.steps_done)}
    atomic_write_text(out / SAE_RUN_FILE, json.dumps({**settings, "summary": summary}, indent=2))
    return SAERun(sae, out, ev, module.resampled, seconds)


def load_sae_run(run_dir) -> tuple[SparseAutoencoder, dict]:
    """``(sae, settings)`` of an SAE run directory: the SAE (:func:`~decoderlab.glassbox.sae.load_sae`) and its
    ``sae_run.json`` ({} for an SAE directory SAELens wrote, which names no checkpoint).

    Raises ``FileNotFoundError`` for a directory that is not an SAE's."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"SAE directory {run_dir} does not exist")
    sae = load_sae(run_dir)
    f = run_dir / SAE_RUN_FILE
    return sae, (json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {})
