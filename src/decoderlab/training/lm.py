"""``train_lm``: a GPT-style language model on a corpus, in a few readable steps (settings, data, model and
trainer, fit, summary)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import lightning as L
import torch

from ..checkpoint import CONFIG_FILE, TOKENIZER_FILE, check_output_dir
from ..data import (SequentialWindows, check_split_lengths, corpus_tokens, read_corpus, split_tokens,
                    token_byte_lengths)
from ..files import atomic_write_text
from ..model import DecoderOnlyTransformer, ModelConfig
from ..model import preset as preset_config
from ..tokenizers import Tokenizer, build_tokenizer
from .callbacks import (LAST_CKPT, LIGHTNING_DIR, ExportCheckpoint, InterruptNotice, LMMetrics, LossHistory,
                        NonFiniteLossGuard, PlainProgress)
from .config import TrainConfig, evaluation_sums
from .datamodule import TokenDataModule
from .module import LitModel
from .recipes import resolve as resolve_recipe
from .strategy import on_training_device
from .timing import ValidationClock
from .trainer import check_run_options, fit, make_trainer

RUN_FILE = "run.json"
SUMMARY_FILE = "summary.json"
#: train settings a resumed run cannot change: they define its validation split and its batches
RESUME_FIXED = ("seed", "val_fraction", "accumulate")
#: ``train_lm``'s model preset when none is given (``decoderlab train``'s default is a recipe: ``DEFAULT_RECIPE``)
DEFAULT_PRESET = "baby-shakespeare"


@dataclass
class TrainSummary:
    """What ``train_lm`` reports. Losses are nats per token.

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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def default_run_dir() -> Path:
    """``runs/<UTC timestamp>`` (shared by all processes of a multi-process run on one machine)."""
    env = os.environ.get("DECODERLAB_RUN_DIR")
    if env:
        return Path(env)
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def checkpoint_step(path: str | os.PathLike) -> tuple[int | None, str | None]:
    """``(global_step, None)`` when ``path`` is a loadable Lightning training checkpoint, else
    ``(None, why)`` (a truncated or damaged file: the loader's error)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # torch raises OSError, RuntimeError, pickle and zip errors for damaged files
        return None, f"{type(e).__name__}: {e}"
    if not isinstance(ckpt, dict) or "global_step" not in ckpt or "state_dict" not in ckpt:
        return None, "not a Lightning training checkpoint (no global_step or state_dict)"
    return int(ckpt["global_step"]), None


def _step_in_name(path: Path) -> int:
    m = re.search(r"(\d+)", path.stem)
    return int(m.group(1)) if m else -1


def _first_process() -> bool:
    return all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "NODE_RANK"))


def resolve_resume(resume: str | os.PathLike | bool | None, run_dir: Path | None) -> tuple[Path, Path] | None:
    """``(run_dir, checkpoint)`` for ``resume`` = a run directory, a Lightning ``.ckpt`` file, or True (the
    ``run_dir``). A run directory resumes from ``lightning/last.ckpt``; when that file is damaged (e.g.
    truncated) or missing, from the intact ``lightning/best-step*.ckpt`` of the highest step, and a line on
    stderr names the damaged file and the one used.

    Raises:
        FileNotFoundError: no checkpoint there (naming where it looked).
        ValueError: the checkpoint file given, or every checkpoint of the run, is damaged (naming each file
            and the loader's error).
    """
    if resume is None or resume is False:
        return None
    if resume is True:
        if run_dir is None:
            raise ValueError("resume without a directory needs the run directory to resume from (--out / out=)")
        resume = run_dir
    path = Path(resume)
    if path.suffix == ".ckpt":
        if not path.is_file():
            raise FileNotFoundError(f"cannot resume: no checkpoint file {path}")
        _, why = checkpoint_step(path)
        if why is not None:
            raise ValueError(f"cannot resume from {path}: the file is damaged ({why}); resume from the run "
                             f"directory to use its newest intact checkpoint")
        rdir = path.parent.parent if path.parent.name == LIGHTNING_DIR else path.parent
        return rdir, path
    ckpt = path / LIGHTNING_DIR / LAST_CKPT
    bests = sorted((path / LIGHTNING_DIR).glob("best-step*.ckpt"), key=_step_in_name, reverse=True)
    if not ckpt.is_file() and not bests:
        raise FileNotFoundError(
            f"cannot resume: no training checkpoint {ckpt} (a run directory written by `decoderlab train` holds "
            f"one after its first evaluation)"
        )
    damaged = []  # (file, why)
    if ckpt.is_file():
        _, why = checkpoint_step(ckpt)
        if why is None:
            return path, ckpt
        damaged.append((ckpt, why))
    intact = []  # (step, file)
    for best in bests:
        step, why = checkpoint_step(best)
        if why is None:
            intact.append((step, best))
        else:
            damaged.append((best, why))
    if not intact:
        raise ValueError(f"cannot resume {path}: no intact training checkpoint; damaged: "
                         f"{'; '.join(f'{f} ({why})' for f, why in damaged)}")
    step, best = max(intact, key=lambda sb: sb[0])
    if _first_process():
        problem = (f"{ckpt} is damaged ({damaged[0][1]})" if damaged and damaged[0][0] == ckpt
                   else f"{ckpt} is missing")
        print(f"decoderlab: {problem}; resuming from {best} (step {step}), the newest intact checkpoint",
              file=sys.stderr)
    return path, best


def _corpus_text(corpus, text):
    if text is not None:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if not text.strip():
            raise ValueError(f"the corpus text is empty: it has {len(text)} characters and none but whitespace")
        return text
    return read_corpus(corpus)


def train_lm(
    corpus: str | os.PathLike | None = None,
    *,
    text: str | None = None,
    preset: str | None = None,
    tokenizer: str | Tokenizer | None = None,
    vocab_size: int | None = None,
    out: str | os.PathLike | None = None,
    train_config: TrainConfig | None = None,
    config_overrides: dict | None = None,
    model_overrides: dict | None = None,
    resume: str | os.PathLike | bool | None = None,
    devices: int | str = 1,
    strategy: str = "auto",
    num_nodes: int = 1,
    accelerator: str = "auto",
    cache_dir: str | os.PathLike | None = None,
    callbacks: Sequence[L.Callback] = (),
    progress_bar: bool | str = True,
    logger: bool = True,
):
    """Train a GPT-style language model on a corpus with Lightning; return ``(model, tokenizer, summary)``.

    The corpus (``corpus`` path: a text file or a folder of .txt files; None = the embedded tinyshakespeare;
    or ``text``) is tokenized once (``corpus_tokens``, cached memmap), split by position (last
    ``val_fraction`` for validation) and served as random windows (``TokenDataModule``). The model is the
    ``preset`` (``tokenizer`` default ``"char"``) with ``num_tokens`` = the tokenizer's vocabulary (plus
    ``model_overrides``), trained as ``train_config`` says (``configure_optimizers``: AdamW or Muon + AdamW,
    warm-up then cosine or WSD) for ``train_config.max_steps`` steps. ``preset`` may also name a recipe
    (:data:`decoderlab.training.recipes.RECIPES`: a model preset and its ``TrainConfig``, used when
    ``train_config`` is None; a plain model preset trains with ``TrainConfig()``). The default is
    "baby-shakespeare" with ``TrainConfig()`` (nanoGPT's CPU baby recipe); ``decoderlab train``'s default is the
    recipe ``DEFAULT_RECIPE`` ("baby-shakespeare-speedrun"). With ``val_batches`` set, the evaluations while training
    cover that subset of the validation windows; ``full_val_at_end`` adds one over all windows at the end
    (the reported ``val_loss``), ``full_val_below`` one whenever the subset's loss is at or below it.

    The run directory ``out`` (default ``runs/<timestamp>``) receives, each written atomically:
    ``config.json``, ``tokenizer.json``, ``model.safetensors``, ``meta.json`` (``"task": "lm"``) -- a
    decoderlab checkpoint, refreshed at every evaluation and at the end -- plus ``run.json`` (the run's
    settings), ``summary.json``, ``lightning/last.ckpt`` and ``lightning/best-step*.ckpt`` (for ``resume``),
    and ``logs/`` (CSV; TensorBoard when installed).

    ``resume`` (a run directory, a ``.ckpt`` file, or True for ``out``) continues that run: model config,
    tokenizer and (unless given) train config and corpus come from the run directory; optimizer, schedule,
    step, data-sampler position and loss history from the Lightning checkpoint (``lightning/last.ckpt``, or
    when that file is damaged or missing, the newest intact ``best-step*.ckpt``, with a line saying so).
    ``config_overrides`` (field -> value) are applied on top of ``train_config`` (or of the resumed run's, or
    the defaults). On resume every changed train setting is honoured from the next step on (learning rates,
    warm-up and cosine recomputed for the new ``max_steps`` from the current step; betas, eps, weight decay,
    clipping, precision, batch size, evaluation, ...), a line lists the changes, and ``run.json`` records
    them; the settings that define the run's data and batches (``RESUME_FIXED``: ``seed``, ``val_fraction``,
    ``accumulate``), and ``preset``, ``tokenizer``, ``vocab_size`` and ``model_overrides`` that differ from
    the run's, are refused with a ``ValueError`` naming them, as is another ``optimizer`` (the checkpoint holds
    the state of the run's own).

    ``devices``, ``strategy`` ("ddp", "fsdp", ...), ``num_nodes``: passed to Lightning; ``batch_size`` is
    per process (global batch = batch_size * processes).

    ``progress_bar``: True for a step-counting bar; "plain" for a plain line on standard output every
    ``log_every`` steps (step/total, train loss, learning rate, tokens/s, elapsed, ETA) and one per
    evaluation, final evaluation included (:class:`~decoderlab.training.callbacks.PlainProgress`: for logs);
    False for none. A warm-up of at least ``max_steps`` steps warns (``UserWarning``): the learning rate would
    never reach its peak and decay.

    Raises:
        FileNotFoundError: missing corpus path; ``resume`` without a checkpoint there.
        ValueError: bad config values; an empty corpus or a split shorter than max_len + 1 tokens; fewer
            validation windows than processes; a non-UTF-8 file (named, with the byte offset); a resumed
            corpus that differs from the run's; a setting a resume cannot change; no intact checkpoint.
        NonFiniteLossError: the loss became NaN/inf (the last good checkpoint is kept).
    """
    model_preset, recipe_config = (None, None) if preset is None and resume not in (None, False) else \
        resolve_recipe(DEFAULT_PRESET if preset is None else preset)
    run = _plan_run(out, resume, train_config, config_overrides, corpus, recipe_config)
    _check_compile_backend(run.cfg.compile)
    check_run_options(run.cfg, strategy, accelerator)  # the machine's refusals before the corpus is read
    if not run.resumed:
        preset = DEFAULT_PRESET if preset is None else preset
    corpus = run.corpus if corpus is None and text is None else corpus
    corpus_text = _corpus_text(corpus, text)
    if run.cfg.warmup >= run.cfg.max_steps:  # after the corpus is read, so that a bad --data gets one line
        warnings.warn(f"warmup ({run.cfg.warmup} steps) is at least max_steps ({run.cfg.max_steps}): the learning "
                      f"rate rises for the whole run and never reaches its peak or decays", UserWarning, stacklevel=2)
    tok, model_cfg = _tokenizer_and_config(run, corpus_text, preset, model_preset, tokenizer, vocab_size,
                                           model_overrides)
    if run.changes and _first_process():  # every refusal is behind us
        print(f"decoderlab: resuming {run.run_dir} from {run.ckpt_path.name} with changed settings: "
              f"{', '.join(f'{k} {old!r} -> {new!r}' for k, (old, new) in run.changes.items())}", file=sys.stderr)
    cfg, run_dir = run.cfg, run.run_dir

    tokens = corpus_tokens(corpus_text, tok, cache_dir)
    train_tokens, val_tokens = split_tokens(tokens, cfg.val_fraction)
    check_split_lengths(len(train_tokens), len(val_tokens), model_cfg.max_len)
    bytes_per_token = len(corpus_text.encode("utf-8")) / len(tokens)  # of the whole corpus (meta.json)
    dm = TokenDataModule(train_tokens, val_tokens, max_len=model_cfg.max_len, batch_size=cfg.batch_size,
                         seed=cfg.seed, val_batch_size=cfg.val_batch_size, val_batches=cfg.val_batches,
                         num_workers=cfg.num_workers)

    L.seed_everything(cfg.seed, verbose=False)
    model = DecoderOnlyTransformer(model_cfg)
    meta = {"task": "lm", "preset": run.info.get("preset") if run.resumed else preset,
            "tokenizer": getattr(tok, "kind", None),
            "bytes_per_token": bytes_per_token}
    byte_lengths = token_byte_lengths(tok)
    history, metrics = LossHistory(), LMMetrics(byte_lengths)
    exporter = ExportCheckpoint(run_dir, tok, meta, metrics)
    clock = ValidationClock(val_tokens, model_cfg.max_len, cfg.val_batch_size, metrics,
                            full_val_below=cfg.full_val_below, subset=cfg.val_batches is not None,
                            precision=cfg.precision, byte_lengths=byte_lengths)
    trainer = make_trainer(cfg, run_dir, devices=devices, strategy=strategy, num_nodes=num_nodes,
                           accelerator=accelerator,
                           callbacks=[history, metrics, NonFiniteLossGuard(run_dir), clock, exporter,
                                      InterruptNotice(run_dir), *callbacks],
                           progress_bar=progress_bar, logger=logger)
    # every process needs validation windows: refuse before training (and before launching processes)
    SequentialWindows(val_tokens, model_cfg.max_len, cfg.val_batch_size, cfg.val_batches, 0, trainer.world_size)
    if trainer.is_global_zero and not run.resumed:
        _write_run_files(run_dir, model_cfg, tok, cfg, corpus if text is None else None, corpus_text, preset,
                         devices, strategy, num_nodes)
    elif trainer.is_global_zero:
        _record_resume(run, devices, strategy, num_nodes)
    if cfg.compile:  # each decoder block in place (Module.compile): state-dict keys stay plain
        for block in model.blocks:
            block.compile(backend="inductor" if cfg.compile is True else str(cfg.compile))

    wall = _fit(trainer, LitModel(model, cfg), dm, run.ckpt_path, run_dir)
    with on_training_device(trainer, model) as (final, device):  # (whole weights on rank 0 under FSDP)
        model = final if final is not None else model
        summary = _summarize(trainer, model, exporter, history, metrics, clock, val_tokens, cfg, wall,
                             byte_lengths, run_dir, device)
    model.eval()
    return model, tok, summary


def _check_compile_backend(compile) -> None:
    """Refuse an unknown ``torch.compile`` backend before training (torch would fail at the first step)."""
    if isinstance(compile, str):
        backends = torch.compiler.list_backends(exclude_tags=())
        if compile not in backends:
            raise ValueError(f"compile backend {compile!r} is not one of this PyTorch's: {', '.join(backends)}")


@dataclass
class _Run:
    """Where a run writes and what it continues: the run directory, the Lightning checkpoint to resume
    from (None for a fresh run), the train config, and the resumed run's recorded settings."""

    run_dir: Path
    ckpt_path: Path | None
    cfg: TrainConfig
    info: dict
    #: train settings changed on resume: field -> (the run's value, the new value)
    changes: dict = dataclasses.field(default_factory=dict)

    @property
    def resumed(self) -> bool:
        return self.ckpt_path is not None

    @property
    def corpus(self):
        return self.info.get("corpus")


def _plan_run(out, resume, train_config, config_overrides, corpus, recipe_config=None) -> _Run:
    """Step 1: the run directory, what to resume, and the effective ``TrainConfig`` (validated): ``train_config``,
    else the resumed run's, else the recipe's (``recipe_config``), else ``TrainConfig()``."""
    run_dir = Path(out) if out is not None else None
    resumed = resolve_resume(resume, run_dir)
    info: dict = {}
    ckpt_path = None
    if resumed is not None:
        run_dir, ckpt_path = resumed
        run_file = run_dir / RUN_FILE
        if not run_file.is_file() or not (run_dir / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"cannot resume: {run_dir} lacks {RUN_FILE} or {CONFIG_FILE} of a training run")
        info = json.loads(run_file.read_text(encoding="utf-8"))
        if train_config is None:
            train_config = TrainConfig.from_dict(info["train_config"])
    else:
        if run_dir is None:
            run_dir = default_run_dir()
        if not os.environ.get("LOCAL_RANK"):  # a new run never overwrites a checkpoint or any other file
            check_output_dir(run_dir, new_run=True)
    cfg = train_config if train_config is not None else recipe_config if recipe_config is not None else TrainConfig()
    if config_overrides:
        cfg = cfg.replace(**config_overrides)  # validates
    cfg.validate()
    changes = {}
    if resumed is not None:
        before = TrainConfig.from_dict(info["train_config"]).to_dict()
        changes = {k: (before[k], v) for k, v in cfg.to_dict().items() if before[k] != v}
        fixed = [k for k in RESUME_FIXED if k in changes]
        if fixed:
            raise ValueError(
                f"cannot resume {run_dir} with {', '.join(f'{k}={changes[k][1]!r}' for k in fixed)}: the run was "
                f"trained with {', '.join(f'{k}={changes[k][0]!r}' for k in fixed)}, and {', '.join(fixed)} "
                f"cannot change on resume (they define the run's validation split and batches); resume without "
                f"changing {'it' if len(fixed) == 1 else 'them'}, or start a new run")
        if "optimizer" in changes:
            old, new = changes["optimizer"]
            raise ValueError(f"cannot resume {run_dir} with optimizer={new!r}: the run was trained with "
                             f"optimizer={old!r}, whose state its checkpoint holds; resume with optimizer={old!r}, "
                             f"or start a new run")
    return _Run(run_dir, ckpt_path, cfg, info, changes)


def _tokenizer_and_config(run: _Run, corpus_text: str, preset: str, model_preset: str | None, tokenizer, vocab_size,
                          model_overrides):
    """Step 2: the tokenizer and the model config -- the run's own when resuming (a different preset,
    tokenizer, vocabulary size or model override is refused), else new ones (the model preset
    ``model_preset``: ``preset``'s own, or the one its recipe names)."""
    if run.resumed:
        _refuse_model_changes(run, preset, tokenizer, vocab_size, model_overrides)
        sha = hashlib.sha256(corpus_text.encode("utf-8")).hexdigest()
        if run.info.get("corpus_sha256") not in (None, sha):
            raise ValueError(f"cannot resume {run.run_dir}: the corpus differs from the one the run was trained on "
                             f"({run.info.get('corpus')!r}, sha256 {run.info['corpus_sha256'][:12]}...)")
        tok = Tokenizer.load(run.run_dir / TOKENIZER_FILE)
        model_cfg = ModelConfig.from_json((run.run_dir / CONFIG_FILE).read_text(encoding="utf-8"))
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


def _refuse_model_changes(run: _Run, preset, tokenizer, vocab_size, model_overrides) -> None:
    """What a resumed run keeps (its model and tokenizer): refuse a preset, tokenizer, vocabulary size or model
    override that differs from the run's, naming it."""
    rdir = run.run_dir
    saved_tok = Tokenizer.load(rdir / TOKENIZER_FILE)
    model_cfg = ModelConfig.from_json((rdir / CONFIG_FILE).read_text(encoding="utf-8"))
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


def _record_resume(run: _Run, devices, strategy, num_nodes) -> None:
    """Resumed runs (rank 0): ``run.json`` takes the settings now in force, so that a later resume keeps them,
    and lists each resume with what it changed."""
    info = dict(run.info)
    info.update({"train_config": run.cfg.to_dict(), "devices": devices, "strategy": strategy, "num_nodes": num_nodes})
    info["resumes"] = [*info.get("resumes", []), {"checkpoint": str(run.ckpt_path),
                                                  "changed": {k: list(v) for k, v in run.changes.items()}}]
    atomic_write_text(run.run_dir / RUN_FILE, json.dumps(info, indent=2))


def _write_run_files(run_dir: Path, model_cfg, tok, cfg: TrainConfig, corpus, corpus_text: str, preset: str,
                     devices, strategy, num_nodes) -> None:
    """Step 3 (fresh runs, rank 0): config, tokenizer and ``run.json`` before the first step."""
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / CONFIG_FILE, model_cfg.to_json())
    tok.save(run_dir / TOKENIZER_FILE)
    info = {"corpus": None if corpus is None else str(Path(corpus).resolve()),
            "corpus_sha256": hashlib.sha256(corpus_text.encode("utf-8")).hexdigest(), "preset": preset,
            "tokenizer": getattr(tok, "kind", None), "train_config": cfg.to_dict(), "devices": devices,
            "strategy": strategy, "num_nodes": num_nodes}
    atomic_write_text(run_dir / RUN_FILE, json.dumps(info, indent=2))


def _fit(trainer: L.Trainer, lit: LitModel, dm: TokenDataModule, ckpt_path, run_dir: Path) -> float:
    """Step 4: ``trainer.fit``; returns its wall seconds. Processes launched by Lightning (DDP) find the run
    directory in ``DECODERLAB_RUN_DIR``."""
    env_set = "DECODERLAB_RUN_DIR" not in os.environ
    if env_set:
        os.environ["DECODERLAB_RUN_DIR"] = str(run_dir)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*(does not have many workers|resuming from a checkpoint "
                                                      r"that ended|`training_step` returned|exists and is not "
                                                      r"empty|LeafSpec).*")
            # handled here: a moved run directory keeps working (run_dir is where the run is now), and the
            # validation metrics are summed over processes by LMMetrics before they are logged
            warnings.filterwarnings("ignore", message=r".*(The dirpath has changed from|It is recommended to use "
                                                      r"`self\.log\('val_(ppl|bpb)', \.\.\., sync_dist=True\)).*")
            fit(trainer, lit, datamodule=dm, ckpt_path=str(ckpt_path) if ckpt_path else None, weights_only=False)
    finally:
        if env_set:
            os.environ.pop("DECODERLAB_RUN_DIR", None)
    return time.perf_counter() - t0


def _log_final_evaluation(trainer, final: dict) -> None:
    """The final evaluation (made after ``fit``) in the loggers and, with plain progress, as a line."""
    values = {k: v for k, v in final.items() if v is not None}
    for lg in trainer.loggers:  # step N = after N optimizer steps, as the evaluations in fit
        lg.log_metrics(values, step=trainer.global_step)
        lg.save()
    for cb in trainer.callbacks:
        if isinstance(cb, PlainProgress):
            cb.validation_line(trainer.global_step, final["val_loss"], final.get("val_bpb"))


def _summarize(trainer, model, exporter, history, metrics, clock, val_tokens, cfg: TrainConfig, wall: float,
               byte_lengths, run_dir: Path, device=None) -> TrainSummary:
    """Step 5: the final evaluation (unless the last validation was at this step; over all windows with
    ``full_val_at_end``) on the training ``device``, the final export, the summary."""
    final = {}
    full_at_end = cfg.full_val_at_end and cfg.val_batches is not None  # the subset served while training only
    if trainer.is_global_zero:
        if not full_at_end and metrics.history and metrics.history[-1][0] == trainer.global_step and metrics.last:
            final = dict(metrics.last)
        else:  # the run stopped without a validation at its last step, or that one covered the subset only
            sums = clock.full_sums(model, trainer.global_step) if full_at_end else evaluation_sums(
                model, val_tokens, model.config.max_len, cfg.val_batch_size, cfg.val_batches, trainer.precision,
                byte_lengths)
            loss = sums["nats"] / sums["targets"]
            final = {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)),
                     "val_bpb": sums["nats"] / (math.log(2) * sums["bytes"]) if sums["bytes"] else None}
            metrics.history.append((trainer.global_step, loss))
            if not full_at_end:  # (full_sums recorded its own)
                clock.record(trainer.global_step, loss, "all" if cfg.val_batches is None else "subset")
            _log_final_evaluation(trainer, final)
        exporter.export(trainer, model)
    last = history.losses[-50:]
    summary = TrainSummary(
        steps=trainer.global_step,
        train_loss=sum(last) / len(last) if last else float("nan"),
        val_loss=final.get("val_loss"), val_ppl=final.get("val_ppl"), val_bpb=final.get("val_bpb"),
        tokens_per_second=history.tokens / history.train_seconds if history.train_seconds else 0.0,
        train_seconds=history.train_seconds, wall_seconds=history.wall_seconds_before + wall,
        num_parameters=model.num_parameters(),
        train_losses=list(history.losses), val_history=list(metrics.history),
        run_dir=str(run_dir), is_global_zero=trainer.is_global_zero, train_loss_steps=len(last),
        eval_log=list(clock.entries), device=None if device is None else str(device),
    )
    if trainer.is_global_zero:
        atomic_write_text(run_dir / SUMMARY_FILE, json.dumps(summary.to_dict(), indent=2))
    return summary
