"""The run directory and the one fit of every training run: ``train_lm``, ``finetune`` and ``train_pairs``.

A run directory (``out``; default ``runs/<UTC timestamp>``) is a decoderlab checkpoint plus what a resume
needs, each file written atomically::

    config.json, tokenizer.json   the model's shape and tokenizer, written before the first step
    model.safetensors, meta.json  the checkpoint, refreshed at every evaluation and at the end
    run.json                      the run's settings: its TrainConfig, the launch (devices, strategy, nodes),
                                  the task's own (corpus, template, ...), and each resume with what it changed
    summary.json                  what the run reports at the end (the summary's mapping)
    lightning/                    last.ckpt and best-step{N}.ckpt, for resuming (one file under both names
                                  when the last evaluation is the best)
    logs/                         CSV (and TensorBoard when installed)

A LoRA run writes ``adapter/`` in place of ``model.safetensors`` and points to its base instead of copying it
(:mod:`.adapters`; its Lightning checkpoints hold the adapters and their optimizer state alone).

Planning (:func:`plan_run`): a new run refuses an ``out`` that holds anything (a run is never written over an
earlier checkpoint or other files). A resume takes the run's stored ``TrainConfig`` with the overrides on top;
every changed setting is honoured from the next step on and recorded in ``run.json`` (:meth:`Run.record`),
while the settings that define the run's data and batches (``RESUME_FIXED``; and what a task adds, through
:meth:`Run.keep`) and another optimizer are refused with a ``ValueError`` naming them.

Several processes (DDP, several nodes): only global rank 0 checks the directory and writes it; the others take
its name from rank 0 when the processes meet (:class:`ShareRunDirectory`, in Lightning's ``setup``, once the
process group is up), so a default timestamped directory is one directory for all of them.

Fitting (:func:`fit_run`): ``trainer.fit`` with Ctrl-C as :class:`TrainingInterrupted` (after
``InterruptNotice`` said what was kept) and without the Lightning warnings a run handles itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch

from ..checkpoint import CONFIG_FILE, TOKENIZER_FILE, check_output_dir
from ..files import atomic_write_text
from .callbacks import LAST_CKPT, LIGHTNING_DIR
from ..config.train import TrainConfig
from .trainer import fit

RUN_FILE = "run.json"
#: the run.json key of the command line's options (:class:`RecordOptions`; :mod:`decoderlab.cli.resume`)
OPTIONS_KEY = "options"
SUMMARY_FILE = "summary.json"
#: train settings a resumed run cannot change: they define its validation split and its batches
RESUME_FIXED = ("seed", "val_fraction", "accumulate")
#: the kinds of training run a run.json records: kind -> (what it is, the command that continues one)
RUN_KINDS = {
    "train": ("a pretraining run (decoderlab train, train_lm)", "decoderlab train --resume {run_dir}"),
    "pairs": ("the lesson's pair training (decoderlab train --preset statquest, train_pairs)",
              "decoderlab train --preset statquest --resume {run_dir}"),
    "finetune": ("a fine-tuning run (decoderlab finetune, finetune)", "decoderlab finetune --resume {run_dir}"),
    "rl": ("a reinforcement-learning run (decoderlab rl, rl)", "decoderlab rl --resume {run_dir}"),
}


def run_kind(info: dict) -> str | None:
    """The kind (a key of :data:`RUN_KINDS`) of the run whose ``run.json`` is ``info``; None when it says none."""
    if info.get("task") == "pairs":
        return "pairs"
    if info.get("method") == "rl":
        return "rl"
    if info.get("task") == "chat":
        return "finetune"
    return "train" if "corpus_sha256" in info else None


def check_run_kind(run_dir: Path, info: dict, kind: str) -> None:
    """Refuse to resume a run of another kind than ``kind``, naming what it is and the command that continues it
    (a pretraining run resumed as a fine-tuning one would otherwise fail on data its run.json never held)."""
    found = run_kind(info)
    if found is not None and found != kind:
        what, command = RUN_KINDS[found]
        raise ValueError(f"cannot resume {run_dir} as {RUN_KINDS[kind][0].split(' (')[0]}: it is {what}; resume it "
                         f"with `{command.format(run_dir=run_dir)}`")
#: the training loss a summary reports is the mean over this many last steps (or all, when fewer)
SUMMARY_STEPS = 50
#: where launchers put a process's rank: torchrun and Lightning (RANK, LOCAL_RANK, NODE_RANK, GROUP_RANK),
#: SLURM, Open MPI, MPICH/Intel MPI, LSF
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK",
                   "PMI_RANK", "JSM_NAMESPACE_RANK")
#: Lightning warnings a run handles itself: few DataLoader workers (batches are cut in the process on purpose),
#: resuming a finished epoch, the SFT step returning a scaled loss, the checkpoint directory not empty (the
#: run directory holds the checkpoint), pytree's LeafSpec, a run directory that was moved (run_dir is where it
#: is now), a frozen reference model in eval mode (DPO's, RL's KL), and the sync_dist hint for the validation metrics LMMetrics has already summed over processes
_HANDLED_WARNINGS = (r".*(does not have many workers|resuming from a checkpoint that ended|`training_step` returned|"
                     r"exists and is not empty|LeafSpec|module\(s\) in eval mode at the start of training|no `val_dataloader`|The dirpath has changed from|"
                     r"It is recommended to use `self\.log\('val_(ppl|bpb)', \.\.\., sync_dist=True\)).*")


def default_run_dir() -> Path:
    """``runs/<UTC timestamp>``, or ``$DECODERLAB_RUN_DIR`` when set (the run directory of a process launched
    by a run)."""
    env = os.environ.get("DECODERLAB_RUN_DIR")
    if env:
        return Path(env)
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def first_process() -> bool:
    """True in global rank 0 -- or in a process no launcher gave a rank -- as the launch environment says
    (before Lightning's process group exists)."""
    return all(os.environ.get(k, "0") == "0" for k in _RANK_VARIABLES)


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
    found = _resolve(resume, run_dir)
    return None if found is None else found[:2]


def _resolve(resume, run_dir: Path | None) -> tuple[Path, Path, int] | None:
    """:func:`resolve_resume` with the checkpoint's step: ``(run_dir, checkpoint, global_step)``."""
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
        step, why = checkpoint_step(path)
        if why is not None:
            raise ValueError(f"cannot resume from {path}: the file is damaged ({why}); resume from the run "
                             f"directory to use its newest intact checkpoint")
        rdir = path.parent.parent if path.parent.name == LIGHTNING_DIR else path.parent
        return rdir, path, step
    return (path, *_newest_intact(path))


def _newest_intact(path: Path) -> tuple[Path, int]:
    """``(lightning/last.ckpt of the run directory path, its step)``, or when it is damaged or missing the intact
    ``best-step*.ckpt`` of the highest step (said on stderr). Raises as :func:`resolve_resume`."""
    ckpt = path / LIGHTNING_DIR / LAST_CKPT
    bests = sorted((path / LIGHTNING_DIR).glob("best-step*.ckpt"), key=_step_in_name, reverse=True)
    if not ckpt.is_file() and not bests:
        raise FileNotFoundError(
            f"cannot resume: no training checkpoint {ckpt} (a run directory written by `decoderlab train` holds "
            f"one after its first evaluation)"
        )
    damaged = []  # (file, why)
    if ckpt.is_file():
        step, why = checkpoint_step(ckpt)
        if why is None:
            return ckpt, step
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
    if first_process():
        problem = (f"{ckpt} is damaged ({damaged[0][1]})" if damaged and damaged[0][0] == ckpt
                   else f"{ckpt} is missing")
        print(f"decoderlab: {problem}; resuming from {best} (step {step}), the newest intact checkpoint",
              file=sys.stderr)
    return best, step


def check_new_run_dir(run_dir: str | os.PathLike) -> None:
    """A new run's output directory must not exist or be empty (checked by global rank 0; the others take its
    directory when the processes meet). Raises ``FileExistsError`` naming what it holds."""
    if first_process():
        check_output_dir(run_dir, new_run=True)


def _refusal(run_dir: Path, changed: dict, why: str) -> ValueError:
    """The error of a resume that changes settings it cannot change: ``changed`` is {name: (run's, new)}."""
    names = list(changed)
    return ValueError(
        f"cannot resume {run_dir} with {', '.join(f'{k}={new!r}' for k, (_, new) in changed.items())}: the run "
        f"was trained with {', '.join(f'{k}={old!r}' for k, (old, _) in changed.items())}, and "
        f"{', '.join(names)} cannot change on resume ({why}); resume without changing "
        f"{'it' if len(names) == 1 else 'them'}, or start a new run")


@dataclass
class Run:
    """Where a run writes and what it continues (see the module docstring).

    Attributes:
        run_dir: the run directory (on processes other than global rank 0, rank 0's once the processes met).
        ckpt_path: the Lightning checkpoint a resume continues from; None for a new run.
        cfg: the run's ``TrainConfig`` (validated).
        info: the resumed run's ``run.json`` ({} for a new run).
        changes: train settings a resume changes: {field: (the run's value, the new value)}.
        step: the optimizer steps the resumed checkpoint holds (None for a new run).
        notes: lines a task says about the run (its adapters, ...), printed by :meth:`announce` after the
            resume's line.
    """

    run_dir: Path
    ckpt_path: Path | None
    cfg: TrainConfig
    info: dict = dataclasses.field(default_factory=dict)
    changes: dict = dataclasses.field(default_factory=dict)
    step: int | None = None
    notes: list = dataclasses.field(default_factory=list)

    @property
    def resumed(self) -> bool:
        return self.ckpt_path is not None

    def keep(self, name: str, given, *, default=None, why: str = "it defines the run's data"):
        """The value of the run setting ``name``: on a resume the run's own (``run.json``), refusing a
        different ``given`` with a ``ValueError`` naming it; on a new run ``given``, or ``default`` when None."""
        if not self.resumed:
            return default if given is None else given
        stored = self.info.get(name)
        if given is not None and given != stored:
            raise _refusal(self.run_dir, {name: (stored, given)}, why)
        return stored

    def announce(self) -> None:
        """The run's first lines on stderr (the first process; after every refusal): a resume's -- "resuming from
        step N of max_steps (the checkpoint)" and the settings it changes --, then the :attr:`notes`."""
        if not first_process():
            return
        if self.resumed:
            changed = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in self.changes.items())
            changed = f"; changed settings: {changed}" if changed else ""
            print(f"decoderlab: resuming from step {self.step} of {self.cfg.max_steps} ({self.ckpt_path}){changed}",
                  file=sys.stderr, flush=True)
        for line in self.notes:
            print(f"decoderlab: {line}", file=sys.stderr, flush=True)

    def record(self, trainer: L.Trainer, model_config, tokenizer, launch: dict, /, **settings) -> None:
        """Global rank 0 writes the run's settings before the first step: a new run its ``config.json``,
        ``tokenizer.json`` and ``run.json`` (the task's ``settings``, the train config and the ``launch``:
        devices, strategy, num_nodes as given); a resume updates ``run.json`` to the settings now in force (the
        task's ``settings`` too), so that a later resume keeps them, and lists the resume with what it changed."""
        if not trainer.is_global_zero:
            return
        if self.resumed:
            info = {**self.info, **settings, "train_config": self.cfg.to_dict(), **launch}
            info["resumes"] = [*info.get("resumes", []), {"checkpoint": str(self.ckpt_path),
                                                          "changed": {k: list(v) for k, v in self.changes.items()}}]
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.run_dir / CONFIG_FILE, model_config.to_json())
            tokenizer.save(self.run_dir / TOKENIZER_FILE)
            info = {**settings, "train_config": self.cfg.to_dict(), **launch}
        atomic_write_text(self.run_dir / RUN_FILE, json.dumps(info, indent=2))

    def write_summary(self, trainer: L.Trainer, summary: "Summary") -> None:
        """``summary.json`` (global rank 0)."""
        if trainer.is_global_zero:
            atomic_write_text(self.run_dir / SUMMARY_FILE, json.dumps(summary.to_dict(), indent=2))


def plan_run(out, resume, train_config: TrainConfig | None = None, config_overrides: dict | None = None,
             default: TrainConfig | None = None, *, fixed: tuple[str, ...] = RESUME_FIXED,
             kind: str | None = None) -> Run:
    """The run directory, what to resume, and the effective ``TrainConfig``: ``train_config``, else the
    resumed run's, else ``default`` (else ``TrainConfig()``), with ``config_overrides`` (field -> value) on
    top, validated. A new run's directory is ``out`` or :func:`default_run_dir`, refused by global rank 0 when
    it holds anything; on a resume the ``fixed`` settings and the optimizer cannot change, and a run of another
    ``kind`` than the caller's (:data:`RUN_KINDS`) is refused naming the command that continues it.

    Raises:
        FileExistsError: ``out`` is a file or holds files (naming them; how to resume a run there).
        FileNotFoundError, ValueError: as :func:`resolve_resume`; a run directory without ``run.json`` or
            ``config.json``; bad config values; a change a resume cannot make (naming it).
    """
    run_dir = Path(out) if out is not None else None
    resumed = _resolve(resume, run_dir)
    if resumed is None:
        run_dir = default_run_dir() if run_dir is None else run_dir
        check_new_run_dir(run_dir)
        cfg = train_config or default or TrainConfig()
        cfg = cfg.replace(**config_overrides) if config_overrides else cfg
        cfg.validate()
        return Run(run_dir, None, cfg)
    run_dir, ckpt_path, step = resumed
    run_file = run_dir / RUN_FILE
    if not run_file.is_file() or not (run_dir / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"cannot resume: {run_dir} lacks {RUN_FILE} or {CONFIG_FILE} of a training run")
    info = json.loads(run_file.read_text(encoding="utf-8"))
    if kind is not None:
        check_run_kind(run_dir, info, kind)
    before = TrainConfig.from_dict(info["train_config"])
    cfg = train_config or before
    cfg = cfg.replace(**config_overrides) if config_overrides else cfg
    cfg.validate()
    now = cfg.to_dict()
    changes = {k: (old, now[k]) for k, old in before.to_dict().items() if now[k] != old}
    refused = {k: changes[k] for k in fixed if k in changes}
    if refused:
        raise _refusal(run_dir, refused, "they define the run's validation split and batches")
    if "optimizer" in changes:
        old, new = changes["optimizer"]
        raise ValueError(f"cannot resume {run_dir} with optimizer={new!r}: the run was trained with "
                         f"optimizer={old!r}, whose state its checkpoint holds; resume with optimizer={old!r}, "
                         f"or start a new run")
    return Run(run_dir, ckpt_path, cfg, info, changes, step)


class ShareRunDirectory(L.Callback):
    """Gives every process global rank 0's run directory once Lightning's processes have met (``setup``):
    rank 0 checked and wrote it before ``fit``; a process launched with its own default timestamp (another
    node, another second) takes rank 0's name, as do the callbacks of the run that name it in messages."""

    def __init__(self, run: Run):
        self.run = run

    def setup(self, trainer, pl_module, stage):
        if trainer.world_size == 1:
            return
        run_dir = Path(trainer.strategy.broadcast(str(self.run.run_dir), src=0))
        if run_dir != self.run.run_dir:
            self.run.run_dir = run_dir
            for cb in trainer.callbacks:
                if getattr(cb, "run_dir", None) is not None:
                    cb.run_dir = run_dir


class RecordOptions(L.Callback):
    """Adds ``options`` -- the options of the command that runs it, ``{dest: value}``
    (:mod:`decoderlab.cli.resume`) -- to the run's ``run.json`` under :data:`OPTIONS_KEY` before the first step
    (global rank 0, after :meth:`Run.record`), so that a resume restores every one of them. The run directory is
    the trainer's ``default_root_dir`` (:func:`~decoderlab.training.make_trainer`'s ``run_dir``)."""

    def __init__(self, options: dict):
        self.options = dict(options)

    def on_fit_start(self, trainer, pl_module):
        if trainer.is_global_zero:
            path = Path(trainer.default_root_dir) / RUN_FILE
            info = json.loads(path.read_text(encoding="utf-8"))
            atomic_write_text(path, json.dumps({**info, OPTIONS_KEY: self.options}, indent=2))


def recorded_options(run_dir: str | os.PathLike) -> dict:
    """The command-line options a run's ``run.json`` records (:class:`RecordOptions`); {} when it records none
    or cannot be read (the run's own loader names what is wrong with it)."""
    try:
        info = json.loads((Path(run_dir) / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    options = info.get(OPTIONS_KEY) if isinstance(info, dict) else None
    return options if isinstance(options, dict) else {}


def fit_run(trainer: L.Trainer, module: L.LightningModule, run: Run | None, **fit_kwargs) -> float:
    """``trainer.fit(module, **fit_kwargs)`` resuming from ``run.ckpt_path`` (``run`` None: a run without a run
    directory, the lesson's pair training); returns its wall seconds.

    Ctrl-C becomes :class:`~decoderlab.training.TrainingInterrupted` (:func:`~decoderlab.training.fit`);
    Lightning's warnings about what the run handles itself are left out; processes that Lightning launches
    (DDP on one machine) find the run directory in ``DECODERLAB_RUN_DIR``."""
    env_set = run is not None and "DECODERLAB_RUN_DIR" not in os.environ
    if env_set:
        os.environ["DECODERLAB_RUN_DIR"] = str(run.run_dir)
    ckpt_path = str(run.ckpt_path) if run is not None and run.ckpt_path else None
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_HANDLED_WARNINGS)
            fit(trainer, module, ckpt_path=ckpt_path, weights_only=False, **fit_kwargs)
    finally:
        if env_set:
            os.environ.pop("DECODERLAB_RUN_DIR", None)
    return time.perf_counter() - t0


def mean_of_last(losses, n: int = SUMMARY_STEPS) -> tuple[float, int]:
    """``(mean of the last min(n, len) losses, how many)``; NaN and 0 for none."""
    last = list(losses)[-n:]
    return (sum(last) / len(last) if last else float("nan")), len(last)


class Summary(Mapping):
    """Base of the run summaries (dataclasses): read as attributes (``summary.steps``) or as the mapping that
    ``summary.json`` holds (``summary["steps"]``, ``dict(summary)``); ``to_dict()`` is that mapping with nested
    dataclasses as dicts."""

    def _names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)]

    def __getitem__(self, key):
        if key not in self._names():
            raise KeyError(f"{key!r}; the summary's keys: {', '.join(self._names())}")
        return getattr(self, key)

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
