"""Training with Lightning: the lesson's pair training and language-model runs.

- :mod:`.optim`: ``TrainConfig``'s optimizer: AdamW groups, Muon + AdamW as one optimizer, the cosine and
  warm-up/stable/decay schedules (plain torch; ``TrainConfig`` and the recipes are :mod:`decoderlab.config`'s);
- :mod:`.evaluation`: ``evaluate_lm``, a language model's mean cross-entropy over windows (plain torch);
- :mod:`.module`: ``LitModel``, the ``LightningModule`` around a ``DecoderOnlyTransformer``;
- :mod:`.datamodule`: ``TokenDataModule`` (random windows, resumable, DDP-sliced);
- :mod:`.callbacks`, :mod:`.progress`, :mod:`.trainer`: metrics, guards, export, the progress display, the
  ``Trainer`` factory; :mod:`.interrupted`: Ctrl-C (what was kept, how to continue);
- :mod:`.timing`: ``ValidationClock``, every evaluation with its wall-clock time (subset or all windows);
- :mod:`.precision`: ``precision="auto"`` resolved for the machine; :mod:`.strategy`: ``--strategy fsdp``
  (FSDP2, one unit per decoder block) and the whole model after training; :mod:`.sums`: exact sums, float64
  on host copies only;
- :mod:`.run`: the run directory (plan, refuse, record, summary) and the one fit of every run;
- :mod:`.lm`: ``train_lm``; :mod:`.pairs`: ``train_pairs`` (the lesson);
- :mod:`.rows`: masked rows, the shared base of the methods above (``decoderlab.finetuning.sft``,
  ``decoderlab.finetuning.dpo``, ``decoderlab.reinforcement.grpo``): the label shift, collate, the masked sums,
  step-exact batches.
"""

from ..config.names import PRECISIONS
from ..config.train import TrainConfig
from .callbacks import ExportCheckpoint, LMMetrics, LossHistory, NonFiniteLossError, NonFiniteLossGuard
from .interrupted import InterruptNotice, TrainingInterrupted
from .evaluation import evaluate_lm
from .datamodule import TokenDataModule
from .lm import TrainSummary, train_lm
from .run import (RUN_FILE, SUMMARY_FILE, Run, ShareRunDirectory, Summary, default_run_dir, fit_run, mean_of_last,
                  plan_run, resolve_resume)
from .module import LitModel
from .optim import MuonAdamW, configure_optimizers, lr_at, parameter_groups
from .pairs import train_pairs
from .progress import PlainProgress, StepProgressBar
from .timing import ValidationClock
from .trainer import fit, make_trainer

__all__ = [
    "ExportCheckpoint", "InterruptNotice", "LMMetrics", "LossHistory", "NonFiniteLossError", "NonFiniteLossGuard",
    "PlainProgress", "StepProgressBar", "PRECISIONS", "TrainConfig", "configure_optimizers", "evaluate_lm", "lr_at",
    "parameter_groups", "TokenDataModule", "RUN_FILE", "SUMMARY_FILE", "TrainSummary", "default_run_dir",
    "resolve_resume", "train_lm", "LitModel", "train_pairs", "make_trainer", "MuonAdamW", "ValidationClock",
    "TrainingInterrupted", "fit", "Run", "ShareRunDirectory", "Summary", "fit_run", "mean_of_last", "plan_run",
]
